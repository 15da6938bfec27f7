"""Taking back a decode step, and greedy steps decoded ahead, on both real engines."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from sluiceway.actors.engine_work import EngineThread, PrefillWork, StepOutcome, StepPlan, execute
from sluiceway.actors.run_ahead import SteppingThread
from sluiceway.engines.base import DecodeResult, Engine
from sluiceway.engines.loader import ModelSource
from sluiceway.engines.select import make_engine
from tests.engines.helpers import exact_dtype
from tests.engines.test_parity import PROMPTS


def test_undo_decode_takes_back_exactly_one_step(engine: Engine, tiny_model: ModelSource) -> None:
    first, second = PROMPTS["short"], PROMPTS["medium"]
    tokens = {
        0: int(engine.prefill(0, first)[-1].argmax()),
        1: int(engine.prefill(1, second)[-1].argmax()),
    }
    step = engine.decode(tokens)
    following = {slot: int(row.argmax()) for slot, row in zip(step.slots, step.logits, strict=True)}
    expected = engine.decode(following)
    engine.undo_decode()
    again = engine.decode(following)
    assert again.slots == expected.slots
    np.testing.assert_allclose(again.logits, expected.logits, atol=1e-5)
    # Taken back, then other tokens: as if the first try never ran.
    engine.undo_decode()
    other = {slot: (token + 1) % 100 for slot, token in following.items()}
    changed = engine.decode(other)

    def never_taken_back(fresh: Engine) -> DecodeResult:
        fresh.prefill(0, first)
        fresh.prefill(1, second)
        fresh.decode(tokens)
        return fresh.decode(other)

    _same(changed, _on_a_fresh_engine(engine, tiny_model, never_taken_back))


def test_undo_decode_keeps_a_row_that_joined_in_it(engine: Engine, tiny_model: ModelSource) -> None:
    """A decode taken back in which a prefilled row joined: the row stays in
    the batch with its prompt, and the next decode is as if it joined there."""
    first, second = PROMPTS["short"], PROMPTS["medium"]
    tokens = {0: int(engine.prefill(0, first)[-1].argmax())}
    step = engine.decode(tokens)
    following = {0: int(step.logits[0].argmax()), 1: int(engine.prefill(1, second)[-1].argmax())}
    engine.decode(following)  # slot 1 joins here
    engine.undo_decode()
    other = {slot: (token + 1) % 100 for slot, token in following.items()}
    changed = engine.decode(other)

    def joined_later(fresh: Engine) -> DecodeResult:
        fresh.prefill(0, first)
        fresh.decode(tokens)
        fresh.prefill(1, second)
        return fresh.decode(other)

    _same(changed, _on_a_fresh_engine(engine, tiny_model, joined_later))


def _on_a_fresh_engine(
    engine: Engine, tiny_model: ModelSource, script: Callable[[Engine], DecodeResult]
) -> DecodeResult:
    fresh = make_engine(
        engine.info.name, tiny_model, device="auto", dtype=exact_dtype(engine.info.name)
    )
    try:
        return script(fresh)
    finally:
        fresh.close()


def _same(got: DecodeResult, expected: DecodeResult) -> None:
    assert got.slots == expected.slots
    np.testing.assert_allclose(got.logits, expected.logits, atol=1e-5)


def _prefill(slot: int, prompt: list[int]) -> PrefillWork:
    return PrefillWork(request_id=f"r{slot}", slot=slot, tokens=tuple(prompt), final=True)


def _next_plan(plan: StepPlan, outcome: StepOutcome, step: int) -> StepPlan:
    """Greedy tokens for every row; a row joins at step 3, one leaves at step 7."""
    tokens: dict[int, int] = {}
    if outcome.decode is not None and outcome.decode_greedy is not None:
        tokens |= dict(zip(outcome.decode.slots, outcome.decode_greedy.tolist(), strict=True))
    for work, prefilled in zip(plan.prefills, outcome.prefills, strict=True):
        assert prefilled.greedy is not None
        tokens[work.slot] = int(prefilled.greedy[0])
    prefills = (_prefill(5, PROMPTS["long"]),) if step == 3 else ()
    frees = (2,) if step == 7 else ()
    decode = {slot: token for slot, token in tokens.items() if slot not in frees}
    return StepPlan(frees=frees, prefills=prefills, decode=decode, greedy=True)


@pytest.mark.anyio
async def test_steps_decoded_ahead_equal_steps_run_plainly(
    engine: Engine, tiny_model: ModelSource
) -> None:
    plain = make_engine(
        engine.info.name, tiny_model, device="auto", dtype=exact_dtype(engine.info.name)
    )
    await _decode_ahead_like_plain(engine, plain)


@pytest.mark.anyio
async def test_steps_queued_ahead_equal_steps_run_plainly(tiny_model: ModelSource) -> None:
    """The mlx engine queues the step after the one decoded ahead: the steady
    steps are taken over, and nothing changes against an engine that does not."""
    pytest.importorskip("mlx.core")
    from sluiceway.engines.mlx_engine import MlxEngine

    engine = MlxEngine(tiny_model)
    try:
        await _decode_ahead_like_plain(engine, MlxEngine(tiny_model, queue_ahead=False))
        assert engine.queued_taken >= 4
    finally:
        engine.close()


async def _decode_ahead_like_plain(engine: Engine, plain: Engine) -> None:
    thread = EngineThread()
    stepping = SteppingThread(engine, thread)
    try:
        plan = StepPlan(
            prefills=(_prefill(1, PROMPTS["short"]), _prefill(2, PROMPTS["medium"])), greedy=True
        )
        for step in range(12):
            got = await stepping.start(plan).result()
            expected = execute(plain, plan)
            if expected.decode is not None:
                assert got.decode is not None
                assert got.decode.slots == expected.decode.slots
                np.testing.assert_allclose(got.decode.logits, expected.decode.logits, atol=1e-5)
            plan = _next_plan(plan, got, step)
        await stepping.start(StepPlan(frees=(1, 5))).result()
        # Steady steps came from ahead; the last plan (frees only) took one back.
        assert stepping.runner.served >= 6
        assert stepping.runner.taken_back >= 1
    finally:
        await thread.run(plain.close)
        thread.close()
