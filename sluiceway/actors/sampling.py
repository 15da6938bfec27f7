"""Vectorised sampling over one step's batch of logits (pure NumPy, no I/O).

Each row is a choice with its own parameters and its own random stream, so a
request's samples do not depend on what it is batched with: a row draws one
uniform number per step from a generator seeded by ``(seed, choice)`` and
picks its token by inverting the cumulative distribution. Greedy rows never
touch the generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from sluiceway.protocol.messages import Row, SamplingParams

FloatArray = npt.NDArray[np.float32]

#: top_p is first tried on this many best candidates; a full sort only when
#: their mass falls short of top_p.
_TOP_P_CANDIDATES = 1024


@dataclass(slots=True)
class RowState:
    """What the sampler remembers about a running choice."""

    rng: np.random.Generator
    counts: dict[int, int] = field(default_factory=dict)
    prompt_ids: npt.NDArray[np.int64] | None = None


def row_generator(params: SamplingParams, choice: int) -> np.random.Generator:
    entropy = [params.seed, choice] if params.seed is not None else None
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))


@dataclass(slots=True)
class SampleResult:
    token_ids: npt.NDArray[np.int64]
    processed: FloatArray | None


class Sampler:
    """Per-row state plus the vectorised sampling step."""

    def __init__(self) -> None:
        self._states: dict[tuple[str, int], RowState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def sample(
        self,
        logits: FloatArray,
        rows: Sequence[Row],
        *,
        keep_processed: bool = False,
    ) -> SampleResult:
        """Pick one token per row."""
        states = self._sync_states(rows)
        plain = all(r.sampling.greedy and not _adjusts(r.sampling) and not r.suppress for r in rows)
        if plain:
            token_ids = logits.argmax(axis=-1).astype(np.int64)
            self._record(states, token_ids)
            return SampleResult(token_ids, logits if keep_processed else None)
        processed = np.array(logits, dtype=np.float32, copy=True)
        token_ids = np.empty(len(rows), dtype=np.int64)
        for i, (row, state) in enumerate(zip(rows, states, strict=True)):
            x = processed[i]
            _adjust(x, row.sampling, state)
            if row.suppress:
                x[np.asarray(row.suppress, dtype=np.int64)] = -np.inf
            if row.sampling.greedy:
                token_ids[i] = int(x.argmax())
            else:
                token_ids[i] = _draw(x, row.sampling, state.rng)
        self._record(states, token_ids)
        return SampleResult(token_ids, processed if keep_processed else None)

    def _sync_states(self, rows: Sequence[Row]) -> list[RowState]:
        # Every running row is in every step, so a row missing from this step
        # has finished and its state can go.
        live = {row.key for row in rows}
        for key in [key for key in self._states if key not in live]:
            del self._states[key]
        states = []
        for row in rows:
            state = self._states.get(row.key)
            if state is None or row.first:
                state = RowState(rng=row_generator(row.sampling, row.choice))
                if row.sampling.repetition_penalty != 1.0:
                    state.prompt_ids = np.unique(np.asarray(row.prompt_ids, dtype=np.int64))
                self._states[row.key] = state
            states.append(state)
        return states

    @staticmethod
    def _record(states: Sequence[RowState], token_ids: npt.NDArray[np.int64]) -> None:
        for state, token in zip(states, token_ids.tolist(), strict=True):
            state.counts[token] = state.counts.get(token, 0) + 1


def _adjusts(params: SamplingParams) -> bool:
    return bool(params.logit_bias) or params.penalised


def _adjust(x: FloatArray, params: SamplingParams, state: RowState) -> None:
    """Logit bias and penalties, in place, on one row."""
    if params.logit_bias:
        ids = np.fromiter((t for t, _ in params.logit_bias), dtype=np.int64)
        x[ids] += np.fromiter((b for _, b in params.logit_bias), dtype=np.float32)
    if not params.penalised or not (state.counts or state.prompt_ids is not None):
        return
    seen = np.fromiter(state.counts.keys(), dtype=np.int64, count=len(state.counts))
    times = np.fromiter(state.counts.values(), dtype=np.float32, count=len(state.counts))
    if params.repetition_penalty != 1.0:
        penalised = seen if state.prompt_ids is None else np.union1d(seen, state.prompt_ids)
        values = x[penalised]
        x[penalised] = np.where(
            values > 0, values / params.repetition_penalty, values * params.repetition_penalty
        )
    if seen.size:
        x[seen] -= params.frequency_penalty * times + params.presence_penalty


def _draw(x: FloatArray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Sample one id from one row of adjusted logits (modified in place)."""
    x /= np.float32(params.temperature)
    vocab = x.shape[0]
    if 0 < params.top_k < vocab:
        kth = np.partition(x, vocab - params.top_k)[vocab - params.top_k]
        x[x < kth] = -np.inf
    peak = x.max()
    probs = np.exp(x - peak)
    if params.min_p > 0.0:
        probs[probs < params.min_p] = 0.0  # relative to the peak, whose weight is 1
    if params.top_p < 1.0:
        _nucleus(probs, params.top_p)
    # Keep the processed row a true log-distribution for --logprobs-mode processed.
    total = probs.sum(dtype=np.float64)
    with np.errstate(divide="ignore"):
        x[:] = np.log(probs / total)
    cumulative = np.cumsum(probs, dtype=np.float64)
    index = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    return min(index, vocab - 1) if probs[min(index, vocab - 1)] > 0 else int(probs.argmax())


def _nucleus(probs: FloatArray, top_p: float) -> None:
    """Zero every weight outside the smallest set whose mass reaches ``top_p``."""
    total = probs.sum(dtype=np.float64)
    target = top_p * total
    count = min(_TOP_P_CANDIDATES, probs.shape[0])
    candidates = np.argpartition(probs, probs.shape[0] - count)[probs.shape[0] - count :]
    if probs[candidates].sum(dtype=np.float64) < target:
        candidates = np.arange(probs.shape[0])
    order = candidates[np.argsort(-probs[candidates], kind="stable")]
    mass = np.cumsum(probs[order], dtype=np.float64)
    keep = int(np.searchsorted(mass, target, side="left")) + 1
    mask = np.zeros(probs.shape[0], dtype=bool)
    mask[order[:keep]] = True
    probs[~mask] = 0.0
