"""A sampled row's weights from its tempered logits: ``top_k``, then
``exp(x - peak)``, then ``min_p`` and ``top_p`` (pure NumPy, no I/O).

Every step works on a block of rows at once, each row with its own
parameters, and defines its result per row: a row gets the same weights in
a block of one (:func:`sluiceway.actors.sampling.draw`) as beside others
(a step's group of drawn rows), so a seeded request picks the same tokens
whoever it is batched with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from sluiceway.actors.cdf import crossings

FloatArray = npt.NDArray[np.float32]


class Filters(Protocol):
    """What the filters read of a row's parameters."""

    @property
    def temperature(self) -> float: ...
    @property
    def top_p(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def min_p(self) -> float: ...


def filtered(params: Filters, vocab: int) -> bool:
    """Whether ``top_k``, ``min_p`` or ``top_p`` shapes a row beside its temperature."""
    return 0 < params.top_k < vocab or params.min_p > 0.0 or params.top_p < 1.0


def weights(x: FloatArray, params: Sequence[Filters]) -> tuple[FloatArray, FloatArray]:
    """Each row's sampling weights and its peak, from ``x`` (rows of logits
    already divided by their temperature, float32). ``top_k`` sets the ids
    below a row's k-th largest logit to -inf in ``x`` itself (ties at the
    k-th are kept); the weights of ids that ``min_p`` (relative to the
    peak, whose weight is 1) or ``top_p`` leave out are zero.

    A row whose peak is not finite (NaN logits, or all -inf) has NaN
    weights; the caller picks its argmax.
    """
    vocab = x.shape[1]
    plain = not any(filtered(p, vocab) for p in params)
    if not plain:
        _top_k(x, [p.top_k for p in params])
    peaks = x.max(axis=1)
    with np.errstate(invalid="ignore"):
        shaped = np.exp(x - peaks[:, None])
    if plain:  # the usual sampled step: temperature alone
        return shaped, peaks
    min_ps = [p.min_p for p in params]
    if any(m > 0.0 for m in min_ps):
        shaped[shaped < np.array(min_ps, dtype=np.float32)[:, None]] = 0.0
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if nucleus:
        top_ps = np.array([params[i].top_p for i in nucleus])
        with np.errstate(invalid="ignore"):
            if len(nucleus) == len(params):  # the usual step: no row to leave out
                shaped = _nucleus(shaped, top_ps)
            else:
                shaped[nucleus] = _nucleus(shaped[nucleus], top_ps)
    return shaped, peaks


def _top_k(x: FloatArray, ks: Sequence[int]) -> None:
    vocab = x.shape[1]
    rows = [i for i, k in enumerate(ks) if 0 < k < vocab]
    if not rows:
        return
    # The k-th largest logit is the (vocab - k)-th smallest: one partition
    # at every row's position (rows mostly share one k) holds each row's.
    positions = [vocab - ks[i] for i in rows]
    every = len(rows) == len(ks)  # the usual step: no fancy indexing (~5 µs a call)
    tail = x if every else x[rows]
    ordered = np.partition(tail, sorted(set(positions)), axis=1)
    kths = ordered[np.arange(len(rows)), positions]
    tail[tail < kths[:, None]] = -np.inf
    if not every:
        x[rows] = tail


def _nucleus(shaped: FloatArray, top_ps: npt.NDArray[np.float64]) -> FloatArray:
    """The rows with every weight outside the smallest set whose mass
    reaches ``top_p`` of the row's set to zero: the heaviest ids first,
    ties by the lower id, as a stable sort by descending weight orders them.

    The weights are sorted (values, not ids: several times faster than an
    argsort), the cut found on their two-level running sums, and every id
    at or above the cut's weight kept, less the highest-numbered ties where
    the cut falls among equal weights.
    """
    count = shaped.shape[0]
    if count == 1:
        return _nucleus_row(shaped[0], float(top_ps[0]))[None, :]
    ordered = np.sort(shaped, axis=1)[:, ::-1]
    cut, _ = crossings(ordered, top_ps, "left")
    thresholds = ordered[np.arange(count), cut]
    kept = shaped >= thresholds[:, None]
    extra = kept.sum(axis=1) - (cut + 1)
    for row in np.flatnonzero(extra > 0).tolist():
        kept[row] = _without_last_ties(kept[row], shaped[row], thresholds[row], int(extra[row]))
    return shaped * kept


def _nucleus_row(shaped: FloatArray, top_p: float) -> FloatArray:
    """:func:`_nucleus` of one row, in array methods (see ``_crossing_row``)."""
    ordered = np.sort(shaped)[::-1]
    cut, _ = crossings(ordered[None, :], np.array([top_p]), "left")
    threshold: np.float32 = ordered[cut[0]]
    kept = shaped >= threshold
    extra = int(kept.sum()) - int(cut[0]) - 1
    if extra > 0:
        kept = _without_last_ties(kept, shaped, threshold, extra)
    return shaped * kept


def _without_last_ties(
    kept: npt.NDArray[np.bool_], shaped: FloatArray, threshold: np.float32, extra: int
) -> npt.NDArray[np.bool_]:
    """``kept`` less its ``extra`` highest-numbered ids of weight ``threshold``."""
    ties = np.flatnonzero(shaped == threshold)
    kept[ties[len(ties) - extra :]] = False
    return kept
