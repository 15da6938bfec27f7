"""``execute``'s path for the steady step, a plan that only decodes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np
import pytest

from sluiceway.actors.engine_work import StepOutcome, StepPlan, execute
from sluiceway.actors.sampling import Draw
from sluiceway.engines.base import DecodeResult
from tests.unit.test_run_ahead import HistoryEngine


def _started(engine: HistoryEngine) -> None:
    engine.prefill(0, [1, 2, 3])
    engine.prefill(1, [4, 5])


def test_a_greedy_decode_only_plan_gives_the_argmax_and_nothing_else() -> None:
    engine = HistoryEngine()
    _started(engine)
    outcome = execute(engine, StepPlan(decode={0: 6, 1: 7}, greedy=True))
    assert outcome.decode is not None
    assert outcome.decode.slots == (0, 1)
    assert outcome.decode_greedy is not None
    assert outcome.decode_greedy.tolist() == outcome.decode.logits.argmax(axis=-1).tolist()
    assert (outcome.prefills, outcome.late, outcome.decode_logprobs) == ([], [], None)
    assert outcome.cache_error is None
    assert outcome.decode_error is None
    assert engine.running == {0: [1, 2, 3, 6], 1: [4, 5, 7]}


def test_a_decode_run_ahead_is_not_run_again() -> None:
    engine = HistoryEngine()
    _started(engine)
    ahead = engine.decode({0: 6, 1: 7})
    outcome = execute(engine, StepPlan(decode={0: 6, 1: 7}, greedy=True), decoded=ahead)
    assert outcome.decode is ahead
    assert engine.decodes == 1


@pytest.mark.parametrize("drawn", [False, True])
def test_the_decode_only_path_gives_what_the_whole_path_gives(drawn: bool) -> None:
    draw = Draw(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, uniform=0.5, top=2)
    plan = StepPlan(decode={0: 6, 1: 7}, greedy=True, draws={1: draw} if drawn else {})
    results = []
    # Freeing a slot that is not in use sends the plan down the whole path.
    for frees in [(), (9,)]:
        engine = HistoryEngine()
        _started(engine)
        results.append(execute(engine, replace(plan, frees=frees)))
    quick, whole = results
    assert quick.decode is not None
    assert whole.decode is not None
    assert quick.decode.slots == whole.decode.slots
    assert np.array_equal(quick.decode.logits, whole.decode.logits)
    assert quick.decode_greedy is not None
    assert whole.decode_greedy is not None
    assert quick.decode_greedy.tolist() == whole.decode_greedy.tolist()
    assert quick.decode_logprobs == whole.decode_logprobs
    assert (quick.decode_logprobs is not None) == drawn


class _FailingDecode(HistoryEngine):
    def decode(self, tokens: Mapping[int, int]) -> DecodeResult:
        raise RuntimeError("out of memory")


def test_a_failed_decode_is_reported_not_raised() -> None:
    engine = _FailingDecode()
    _started(engine)
    outcome = execute(engine, StepPlan(decode={0: 6, 1: 7}, greedy=True))
    assert outcome == StepOutcome(prefills=[], decode_error="decode failed: out of memory")


@pytest.mark.parametrize("greedy", [True, False])
def test_a_plan_with_nothing_to_do_does_nothing(greedy: bool) -> None:
    engine = HistoryEngine()
    outcome = execute(engine, StepPlan(greedy=greedy))
    assert outcome == StepOutcome(prefills=[])
    assert engine.decodes == 0
