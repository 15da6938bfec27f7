"""Reducing a step's logits to the logprobs rows asked for (pure NumPy).

Only the rows that asked are touched: their log-softmax normaliser, the
sampled token's logprob, the top-k (k = the largest asked for in the step;
each row keeps its own k) and any requested token ids. The full-vocabulary
array is not kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from sluiceway.protocol.messages import LogprobParams, TokenLogprob

#: The value reported for a logprob of -inf (a token that cannot be sampled):
#: JSON has no infinity, and clients parse this as "impossible".
LOGPROB_FLOOR = -9999.0

FloatArray = npt.NDArray[np.float32]


def _finite(value: float) -> float:
    if value != value or value < LOGPROB_FLOOR:  # NaN or -inf or below the floor
        return LOGPROB_FLOOR
    return value


def log_normaliser(rows: FloatArray) -> npt.NDArray[np.float64]:
    """log(sum(exp(row))) per row, stable."""
    peak = rows.max(axis=-1, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    shifted = np.exp((rows - peak).astype(np.float64))
    normaliser: npt.NDArray[np.float64] = np.log(shifted.sum(axis=-1)) + peak[:, 0]
    return normaliser


def top_k(row: FloatArray, k: int) -> npt.NDArray[np.int64]:
    """The ``k`` best ids of a row, best first, ties by lower id."""
    if k <= 0:
        return np.empty(0, dtype=np.int64)
    k = min(k, row.shape[0])
    candidates = np.argpartition(-row, k - 1)[:k]
    order = np.lexsort((candidates, -row[candidates]))
    return candidates[order].astype(np.int64)


def reduce_rows(
    logits: FloatArray,
    token_ids: Sequence[int],
    params: Sequence[LogprobParams],
) -> list[TokenLogprob | None]:
    """Reduce each row that asked; rows that did not get ``None``."""
    asked = [i for i, p in enumerate(params) if p.per_token]
    result: list[TokenLogprob | None] = [None] * len(params)
    if not asked:
        return result
    rows = logits[asked] if len(asked) < len(params) else logits
    normaliser = log_normaliser(rows)
    for local, index in enumerate(asked):
        row = rows[local]
        base = float(normaliser[local])
        p = params[index]
        chosen = int(token_ids[index])
        top = top_k(row, p.top or 0)
        result[index] = TokenLogprob(
            logprob=_finite(float(row[chosen]) - base),
            top=tuple((int(t), _finite(float(row[t]) - base)) for t in top),
            requested=tuple((int(t), _finite(float(row[t]) - base)) for t in p.token_ids),
        )
    return result


def reduce_targets(logits: FloatArray, targets: Sequence[int], top: int) -> list[TokenLogprob]:
    """Logprob of ``targets[i]`` under ``logits[i]`` (plus the top ``top``),
    for as many rows as there are targets."""
    rows = logits[: len(targets)]
    if not len(targets):
        return []
    normaliser = log_normaliser(rows)
    entries = []
    for position, target in enumerate(targets):
        row = rows[position]
        base = float(normaliser[position])
        entries.append(
            TokenLogprob(
                logprob=_finite(float(row[int(target)]) - base),
                top=tuple((int(t), _finite(float(row[t]) - base)) for t in top_k(row, top)),
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
