"""Driving an engine greedily, alone or in a scripted batch, and the oracle's numbers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from sluiceway.engines.base import Engine

#: Largest |logprob| difference from the float32 oracle, by the engine's
#: compute dtype: float32 is exact up to summation order; bfloat16 keeps 8
#: bits of mantissa, so a logprob of the tiny models moves by a few hundredths.
LOGPROB_TOLERANCES = {"float32": 1e-4, "bfloat16": 0.1}
LOGPROB_TOLERANCE = LOGPROB_TOLERANCES["float32"]


def exact_dtype(engine: str) -> str:
    """The ``--dtype`` at which ``engine`` is held to the float32 oracle:
    float32 for transformers (whose ``auto`` is bfloat16 on a CPU with
    AVX512-BF16 or AMX); ``auto`` for mlx, which takes the checkpoint's
    (float32 here) and warns about any other value."""
    return "float32" if engine == "transformers" else "auto"


Array = npt.NDArray[np.float64]


def log_softmax(logits: npt.NDArray[Any]) -> Array:
    wide = np.asarray(logits, dtype=np.float64)
    shifted = wide - wide.max(axis=-1, keepdims=True)
    result: Array = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return result


@dataclass
class Trace:
    """One row's greedy tokens and the log-softmax each was chosen from."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[Array] = field(default_factory=list)

    def take(self, logits: npt.NDArray[np.float32]) -> int:
        self.logprobs.append(log_softmax(logits))
        self.tokens.append(int(np.argmax(logits)))
        return self.tokens[-1]


def greedy_alone(engine: Engine, prompt: Sequence[int], steps: int, *, slot: int = 0) -> Trace:
    """``steps`` greedy tokens for one row with nothing else in the batch."""
    trace = Trace()
    token = trace.take(engine.prefill(slot, prompt)[-1])
    for _ in range(steps - 1):
        result = engine.decode({slot: token})
        assert result.slots == (slot,)
        token = trace.take(result.logits[0])
    engine.free(slot)
    return trace


def run_schedule(
    engine: Engine,
    prompts: Mapping[int, Sequence[int]],
    joins: Mapping[int, Sequence[int]],
    leaves: Mapping[int, Sequence[int]],
    steps: int,
) -> list[tuple[int, Trace]]:
    """Decode ``steps`` batched steps; before step ``s`` free ``leaves[s]``, then prefill ``joins[s]``.

    A row that runs from the first step to the end gets ``steps + 1`` tokens (one from prefill).

    Returns every row that ran, as ``(slot, trace)`` (a reused slot appears once per use).
    """
    done: list[tuple[int, Trace]] = []
    traces: dict[int, Trace] = {}
    running: dict[int, int] = {}
    for step in range(steps):
        for slot in leaves.get(step, ()):
            engine.free(slot)
            del running[slot]
            done.append((slot, traces.pop(slot)))
        for slot in joins.get(step, ()):
            traces[slot] = Trace()
            running[slot] = traces[slot].take(engine.prefill(slot, prompts[slot])[-1])
        if not running:
            continue
        result = engine.decode(dict(running))
        assert sorted(result.slots) == sorted(running)
        assert result.logits.shape[0] == len(running)
        for slot, logits in zip(result.slots, result.logits, strict=True):
            running[slot] = traces[slot].take(logits)
    for slot in list(running):
        engine.free(slot)
    return [*done, *traces.items()]


def assert_same_trace(actual: Trace, expected: Trace, what: str) -> None:
    """Identical greedy tokens, logprobs within tolerance, over ``actual``'s length."""
    assert len(actual.tokens) <= len(expected.tokens), what
    assert actual.tokens == expected.tokens[: len(actual.tokens)], what
    for step, (got, want) in enumerate(zip(actual.logprobs, expected.logprobs, strict=False)):
        error = float(np.max(np.abs(got - want)))
        assert error < LOGPROB_TOLERANCE, f"{what}: step {step} differs by {error:.2e}"
