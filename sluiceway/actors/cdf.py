"""Where a fraction of a row's total weight falls in its cumulative sums
(pure NumPy): the inverse of the cumulative distribution a draw takes, and
the cut of a nucleus.

The sums are taken in two levels, in float64: each block of
:data:`CDF_BLOCK` ids is summed, the block sums are added up in order, and
only the block the target lands in is added up id by id. A single running
sum over a whole row cost ~6 ns an id (NumPy's accumulate has no vector
loop) and was most of a sampled step's picks at batch 16. The sums are
defined per row, whatever the rows beside it, so a row gets the same answer
alone (fewer NumPy calls) as in a group.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float32]
Side = Literal["left", "right"]

#: Width of the blocks the sums first choose among.
CDF_BLOCK = 128


def crossings(
    weights: npt.NDArray[np.floating], fractions: npt.NDArray[np.float64], side: Side
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
    """Per row of non-negative ``weights``, how many of its running sums are
    below (``side="left"``) or at most (``"right"``) ``fraction * total``,
    at most the row's last index; and each row's total.

    ``"right"`` is where a draw falls (the id whose span holds the target);
    ``"left"`` is the first id whose running sum reaches the target.
    """
    count, width = weights.shape
    if count == 1:
        position, total = _crossing_row(weights[0], float(fractions[0]), side)
        return np.array([position], dtype=np.int64), np.array([total])
    blocks = -(-width // CDF_BLOCK)
    wide = _widened(weights, blocks * CDF_BLOCK).reshape(count, blocks, CDF_BLOCK)
    # Each row's running sums of whole blocks, after a leading zero.
    ends = np.zeros((count, blocks + 1))
    np.cumsum(wide.sum(axis=2), axis=1, out=ends[:, 1:])
    totals = ends[:, -1]
    targets = (fractions * totals)[:, None]
    below = np.less if side == "left" else np.less_equal
    block = np.minimum(below(ends[:, 1:], targets).sum(axis=1), blocks - 1)
    every = np.arange(count)
    inner = np.cumsum(wide[every, block], axis=1) + ends[every, block][:, None]
    offset = np.minimum(below(inner, targets).sum(axis=1), CDF_BLOCK - 1)
    position = block * CDF_BLOCK + offset
    if width % CDF_BLOCK:  # not past the row into its padding
        np.minimum(position, width - 1, out=position)
    return position, totals


def _crossing_row(
    weights: npt.NDArray[np.floating], fraction: float, side: Side
) -> tuple[int, float]:
    """:func:`crossings` of one row: the same sums, in the same order, in
    array methods (each NumPy function call costs ~1 µs more, and a row's
    draw is a dozen of them)."""
    width = weights.shape[0]
    blocks = -(-width // CDF_BLOCK)
    wide = _widened(weights[None, :], blocks * CDF_BLOCK)[0]
    ends = wide.reshape(blocks, CDF_BLOCK).sum(axis=1).cumsum()
    total = float(ends[-1])
    target = fraction * total
    block = min(int(ends.searchsorted(target, side=side)), blocks - 1)
    start = block * CDF_BLOCK
    inner = wide[start : start + CDF_BLOCK].cumsum()
    if block:
        inner += ends[block - 1]
    offset = min(int(inner.searchsorted(target, side=side)), CDF_BLOCK - 1)
    return min(start + offset, width - 1), total


def invert(
    probs: FloatArray, uniforms: npt.NDArray[np.float64]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
    """Per row of weights (``probs``, float32, non-negative), the id where
    ``uniform * total`` falls in the row's cumulative sums, and the total.

    An id of weight zero is never picked while the total is positive and
    finite; a row whose total is not is the caller's to handle (its id here
    is meaningless).
    """
    picked, totals = crossings(probs, uniforms, "right")
    if probs.shape[0] == 1:  # a row alone: no fancy indexing (~5 µs a call)
        if not probs[0, picked[0]] > 0:
            picked[0] = _last_positive(probs[0], int(picked[0]))
        return picked, totals
    every = np.arange(probs.shape[0])
    # (A NaN total picks nothing meaningful, and the caller knows it.)
    for row in np.flatnonzero(probs[every, picked] <= 0).tolist():
        picked[row] = _last_positive(probs[row], int(picked[row]))
    return picked, totals


def _widened(weights: npt.NDArray[np.floating], width: int) -> npt.NDArray[np.float64]:
    """The rows in float64, zero-padded to ``width`` ids."""
    if weights.shape[1] == width:
        return weights.astype(np.float64)
    wide = np.zeros((weights.shape[0], width))
    wide[:, : weights.shape[1]] = weights
    return wide


def _last_positive(probs: FloatArray, picked: int) -> int:
    """Rounding between the two levels, or a draw that rounds up to the
    total, can leave the target past a block's last running sum, on an id
    of weight zero (or past the row): the last id of positive weight up to
    there is taken instead."""
    positive = np.flatnonzero(probs[: picked + 1] > 0)
    return int(positive[-1]) if positive.size else 0
