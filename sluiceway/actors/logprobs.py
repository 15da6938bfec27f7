"""Reducing a step's logits to the logprobs rows asked for (pure NumPy).

Only the rows that asked are touched: their log-softmax normaliser, the
sampled token's logprob, the top-k (k = the largest asked for in the step;
each row keeps its own k) and any requested token ids. The full-vocabulary
array is not kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import numpy.typing as npt

from sluiceway.protocol.messages import LogprobParams, SampledStep, TokenLogprob

#: The value reported for a logprob of -inf (a token that cannot be sampled):
#: JSON has no infinity, and clients parse this as "impossible".
LOGPROB_FLOOR = -9999.0

FloatArray = npt.NDArray[np.float32]


def _finite(value: float) -> float:
    if value != value or value < LOGPROB_FLOOR:  # NaN or -inf or below the floor
        return LOGPROB_FLOOR
    return value


def log_normaliser(rows: FloatArray) -> npt.NDArray[np.float32]:
    """log(sum(exp(row))) per row, stable.

    Float32 throughout: the logits are float32 already, and a pairwise sum
    over a 150k vocabulary stays within ~1e-6 of a float64 one at a quarter
    of the cost (SIMD exp).
    """
    peak = rows.max(axis=-1, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, np.float32(0.0))
    shifted = np.exp(rows - peak)
    normaliser: npt.NDArray[np.float32] = np.log(shifted.sum(axis=-1)) + peak[:, 0]
    return normaliser


#: Width of the blocks ``top_k`` skims. A selection over the block maxima
#: narrows a 150k vocabulary to ``k`` blocks in about one pass of ``max``.
_BLOCK = 128
#: A row this short is selected from whole: skimming its few blocks costs
#: more NumPy calls than the one selection over it saves.
_WHOLE_ROW = 8192


def top_k(row: FloatArray, k: int) -> npt.NDArray[np.int64]:
    """The ``k`` best ids of a row, best first, ties by lower id."""
    if k <= 0:
        return np.empty(0, dtype=np.int64)
    width = row.shape[0]
    k = min(k, width)
    if width <= _WHOLE_ROW:
        # One selection over the row itself: its k-th best value, then every
        # id at or above it (ties included, so the id tie-break holds).
        kth = row[np.argpartition(row, width - k)[width - k :]].min()
        if kth == kth:  # NaN sorts last in a selection and would select nothing
            chosen = np.flatnonzero(row >= kth)
            ranked = chosen[np.lexsort((chosen, -row[chosen]))[:k]]
            return ranked.astype(np.int64, copy=False)
    candidates = _candidates(row, k)
    values = row[candidates]
    if candidates.shape[0] > k:
        keep = np.argpartition(-values, k - 1)[:k]
        # Values tied with the k-th best all stay in, so the id tie-break holds.
        keep = np.flatnonzero(values >= values[keep].min())
        candidates, values = candidates[keep], values[keep]
    order = np.lexsort((candidates, -values))[:k]
    return candidates[order].astype(np.int64)


def _candidates(row: FloatArray, k: int) -> npt.NDArray[np.int64]:
    """Ids that include every one of the row's ``k`` best (ties included).

    The k-th largest block maximum is at most the k-th largest value, so any
    block holding a top-k value has a maximum at least that large.
    """
    blocks = row.shape[0] // _BLOCK
    if blocks <= k or row.shape[0] <= _WHOLE_ROW:
        return np.arange(row.shape[0], dtype=np.int64)
    maxima = row[: blocks * _BLOCK].reshape(blocks, _BLOCK).max(axis=1)
    threshold = np.partition(maxima, blocks - k)[blocks - k]
    chosen = np.flatnonzero(maxima >= threshold)
    ids = (chosen[:, None] * _BLOCK + np.arange(_BLOCK)).ravel()
    tail = np.arange(blocks * _BLOCK, row.shape[0], dtype=np.int64)
    return np.concatenate((ids.astype(np.int64), tail))


def top_k_rows(rows: FloatArray, k: int) -> npt.NDArray[np.int64]:
    """:func:`top_k` of every row at once: a ``(rows, k)`` array of ids.

    A step's rows share a handful of NumPy calls instead of a handful per
    row, which is what top-5 logprobs cost per token at high concurrency.
    The order is the same total one (value down, then id up), so any row's
    first ``j <= k`` ids are its own top ``j``.
    """
    count, width = rows.shape
    k = max(0, min(k, width))
    if k == 0 or count == 0:
        return np.empty((count, k), dtype=np.int64)
    if count == 1 or width > _WHOLE_ROW:
        return _one_by_one(rows, k)
    floor = _block_floor(rows, k)
    chosen = rows >= floor[:, None]
    # NaN selects nothing; a tie across much of a row (a flat tail, -inf
    # after filtering) selects too much to sort in one go.
    if np.isnan(floor).any() or np.count_nonzero(chosen) > _CROWD * k * count:
        return _one_by_one(rows, k)
    # One flat pass: 2-D ``nonzero`` costs ~20x more at these sizes.
    where, ids = np.divmod(np.flatnonzero(chosen), width)
    # Each row's ids come in rising order and lexsort is stable, so equal
    # values stay lower id first.
    ranked = ids[np.lexsort((-rows[where, ids], where))]
    counts = np.bincount(where, minlength=count)
    starts = np.cumsum(counts) - counts
    best: npt.NDArray[np.int64] = ranked[starts[:, None] + np.arange(k)]
    return best


def _one_by_one(rows: FloatArray, k: int) -> npt.NDArray[np.int64]:
    if rows.shape[0] == 1:  # a step of one row (``np.stack`` alone costs ~5 µs)
        return top_k(rows[0], k)[None, :]
    return np.stack([top_k(row, k) for row in rows])


#: More candidates per wanted id than this and rows are selected one by one.
_CROWD = 8


def _block_floor(rows: FloatArray, k: int) -> FloatArray:
    """Per row, a value at most its k-th best: the k-th best block maximum.

    The k best blocks each hold a distinct value at least that large, so
    every value at or above the row's k-th best (ties included) is at or
    above it, and few others are.
    """
    count, width = rows.shape
    size = max(1, min(_BLOCK, width // (2 * k)))
    blocks = width // size
    maxima = rows[:, : blocks * size].reshape(count, blocks, size).max(axis=2)
    if blocks * size < width:
        tail = rows[:, blocks * size :].max(axis=1, keepdims=True)
        maxima = np.concatenate((maxima, tail), axis=1)
    total = maxima.shape[1]
    floor: FloatArray = np.partition(maxima, total - k, axis=1)[:, total - k]
    return floor


def reduce_rows(
    logits: FloatArray,
    token_ids: Sequence[int],
    params: Sequence[LogprobParams],
    *,
    normalisers: npt.NDArray[np.float32] | None = None,
) -> list[TokenLogprob | None]:
    """Reduce each row that asked; rows that did not get ``None``.
    ``normalisers``: every row's :func:`log_normaliser`, where the caller
    computed them already (a draw exponentiates the same logits)."""
    asked = [i for i, p in enumerate(params) if p.per_token]
    result: list[TokenLogprob | None] = [None] * len(params)
    if not asked:
        return result
    rows = logits[asked] if len(asked) < len(params) else logits
    if normalisers is None:
        normalisers = log_normaliser(rows)
    elif len(asked) < len(params):
        normalisers = normalisers[asked]
    # In float64, as Python floats would subtract: the whole step's in two calls.
    bases = normalisers.astype(np.float64)
    if np.isnan(bases).any():
        rows, bases = _without_nan(rows, bases)
    chosen = [int(token_ids[index]) for index in asked]
    picked: list[float] = _floored(rows[np.arange(len(asked)), chosen] - bases).tolist()
    top_ids = top_k_rows(rows, max(params[index].top or 0 for index in asked))
    ranked: list[list[int]] = top_ids.tolist()
    top_values = np.take_along_axis(rows, top_ids, axis=1) - bases[:, None]
    ranked_values: list[list[float]] = _floored(top_values).tolist()
    for local, index in enumerate(asked):
        p = params[index]
        k = p.top or 0
        requested: tuple[tuple[int, float], ...] = ()
        if p.token_ids:
            scores = rows[local, list(p.token_ids)].tolist()
            requested = _entries(p.token_ids, scores, float(bases[local]))
        result[index] = TokenLogprob(
            picked[local],
            tuple(zip(ranked[local][:k], ranked_values[local][:k], strict=True)),
            requested,
        )
    return result


def _without_nan(
    rows: FloatArray, bases: npt.NDArray[np.float64]
) -> tuple[FloatArray, npt.NDArray[np.float64]]:
    """The rows with each NaN logit (a model's overflow) as -inf, and their
    normalisers again: a NaN token floors and ranks last, instead of one
    row's NaN making the step's top-k fail for every row in it. Only the
    rows whose normaliser came out NaN hold one, so only those are read."""
    rows, bases = rows.copy(), bases.copy()
    sick = np.flatnonzero(np.isnan(bases))
    for index in sick.tolist():
        row = rows[index]
        row[np.isnan(row)] = -np.inf
    bases[sick] = log_normaliser(rows[sick])
    return rows, bases


def _floored(values: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """:func:`_finite` of every value at once (NaN and -inf to the floor)."""
    return np.where(values >= LOGPROB_FLOOR, values, LOGPROB_FLOOR)


def _entries(
    ids: Sequence[int], values: Sequence[float], base: float
) -> tuple[tuple[int, float], ...]:
    return tuple((t, _finite(v - base)) for t, v in zip(ids, values, strict=True))


def reduce_step(step: SampledStep) -> SampledStep:
    """A sampled step with its logprobs reduced and its logits released."""
    source = step.processed if step.processed is not None else step.logits
    assert source is not None, "only steps that carry logits are reduced"
    logprobs = reduce_rows(source, step.token_ids, [row.logprobs for row in step.rows])
    return replace(step, logprobs=tuple(logprobs), logits=None, processed=None)


def reduce_targets(logits: FloatArray, targets: Sequence[int], top: int) -> list[TokenLogprob]:
    """Logprob of ``targets[i]`` under ``logits[i]`` (plus the top ``top``
    and the target's rank), for as many rows as there are targets."""
    rows = logits[: len(targets)]
    if not len(targets):
        return []
    normaliser = log_normaliser(rows)
    # 1 + how many ids score above the target (vLLM's rank), one pass per row.
    ranks = (rows > rows[np.arange(len(targets)), np.asarray(targets)][:, None]).sum(axis=-1)
    entries = []
    for position, target in enumerate(targets):
        row = rows[position]
        base = float(normaliser[position])
        entries.append(
            TokenLogprob(
                logprob=_finite(float(row[int(target)]) - base),
                top=tuple((int(t), _finite(float(row[t]) - base)) for t in top_k(row, top)),
                rank=int(ranks[position]) + 1,
            )
        )
    return entries


def reduce_prompt(
    logits: FloatArray, prompt_ids: Sequence[int], top: int
) -> tuple[TokenLogprob | None, ...]:
    """Logprobs of each prompt token given the ones before it.

    ``logits[i]`` is the distribution after prompt position ``i``; the first
    prompt token has no distribution, hence ``None``.
    """
    return (None, *reduce_targets(logits, prompt_ids[1:], top))
