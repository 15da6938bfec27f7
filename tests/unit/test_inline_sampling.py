"""Small steps are sampled and reduced on the event loop; large ones in a thread.

The scheduler samples and reduces a step of at most ``INLINE_LOGITS`` logits
itself, through the sampler's core (a round through the sampler and reducer
tasks costs more than the work); the actors take the rest, and a step too
large for the event loop still leaves it for a worker thread.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import anyio
import numpy as np
import pytest
from anyio.abc import ObjectReceiveStream

from sluiceway.actors import reducer, sampler
from sluiceway.actors.sampler import INLINE_LOGITS, SamplerConfig, StepSampler
from sluiceway.actors.scheduler import SchedulerConfig, SchedulerHandle
from sluiceway.protocol.constraints import Constraint, ConstraintKind
from sluiceway.protocol.messages import (
    LogitsStep,
    LogprobParams,
    Row,
    SampledStep,
    SamplingParams,
    StepOutput,
)
from tests.unit.test_scheduler import EOS, FakeEngine, collect, request, run_with, submit


def _row(index: int, constraint: Constraint | None = None) -> Row:
    return Row(
        request_id=f"r{index}",
        choice=0,
        sampling=SamplingParams(temperature=1.0, seed=index),
        logprobs=LogprobParams(top=5),
        prompt_ids=(1, 2, 3),
        first=True,
        constraint=constraint,
    )


def _step(rows: int, vocab: int) -> LogitsStep:
    logits = np.random.default_rng(0).standard_normal((rows, vocab)).astype(np.float32)
    return LogitsStep(step=1, rows=tuple(_row(i) for i in range(rows)), logits=logits)


async def _through_both(rows: int, vocab: int) -> tuple[SampledStep, int]:
    """One sampled step with top-5 logprobs through both actors; how many
    thread hops it took."""
    hops = 0
    run_sync = anyio.to_thread.run_sync

    async def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal hops
        hops += 1
        return await run_sync(*args, **kwargs)

    core = StepSampler(SamplerConfig(), reduce=True)
    to_sampler, sampler_in = anyio.create_memory_object_stream[LogitsStep](1)
    to_reducer, reducer_in = anyio.create_memory_object_stream[SampledStep](1)
    out, results = anyio.create_memory_object_stream[SampledStep](1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(anyio.to_thread, "run_sync", counting)
        async with anyio.create_task_group() as group, results:
            group.start_soon(sampler.run, sampler_in, to_reducer, core)
            group.start_soon(reducer.run, reducer_in, out)
            async with to_sampler:
                await to_sampler.send(_step(rows, vocab))
            sampled = await results.receive()
    return sampled, hops


@pytest.mark.anyio
async def test_a_small_step_reaching_the_actors_stays_on_the_event_loop() -> None:
    sampled, hops = await _through_both(rows=4, vocab=1920)
    assert hops == 0
    assert sampled.logprobs is not None
    assert all(entry is not None and len(entry.top) == 5 for entry in sampled.logprobs)
    assert sampled.logits is None  # released by the reducer


@pytest.mark.anyio
async def test_a_large_step_is_sampled_and_reduced_in_worker_threads() -> None:
    vocab = INLINE_LOGITS // 2 + 1
    sampled, hops = await _through_both(rows=2, vocab=vocab)
    assert hops == 2
    assert sampled.logprobs is not None
    assert len(sampled.token_ids) == 2


def test_inline_samples_and_reduces_a_small_step_like_the_actors() -> None:
    step = _step(rows=4, vocab=1920)
    inline = StepSampler(SamplerConfig(), reduce=True).inline(step)
    assert inline is not None
    assert inline.logits is None
    assert inline.processed is None
    assert inline.logprobs is not None
    assert all(entry is not None and len(entry.top) == 5 for entry in inline.logprobs)
    # The same seeds give the same tokens as a fresh sampler behind the actors.
    direct = sampler.sample_step(sampler.Sampler(), step, SamplerConfig())
    assert inline.token_ids == direct.token_ids


def test_inline_declines_large_constrained_and_mask_waiting_steps() -> None:
    core = StepSampler(SamplerConfig(), reduce=True)
    assert core.inline(_step(rows=2, vocab=INLINE_LOGITS // 2 + 1)) is None
    small = _step(rows=1, vocab=64)
    constrained = LogitsStep(
        step=1,
        rows=(_row(0, Constraint(kind=ConstraintKind.REGEX, text="a+")),),
        logits=small.logits,
    )
    assert core.inline(constrained) is None
    core.preparing_masks = True  # a worker thread reads the sampler's state
    assert core.inline(small) is None
    core.preparing_masks = False
    assert core.inline(small) is not None


def test_without_a_reducer_inline_leaves_logprobs_unreduced() -> None:
    sampled = StepSampler(SamplerConfig(forward_logits=False), reduce=False).inline(
        _step(rows=1, vocab=64)
    )
    assert sampled is not None
    assert sampled.logprobs is None
    assert sampled.logits is None


@pytest.mark.anyio
async def test_the_scheduler_samples_small_steps_without_the_actors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sampled requests with top-5 logprobs on a small vocabulary: every
    step is sampled and reduced in the scheduler's task, none reaches the
    sampler or reducer actor, and each token still has its entry."""
    reached: list[str] = []

    def counted(name: str, run: Any) -> Any:
        async def wrapper(receive: ObjectReceiveStream[Any], *args: Any) -> None:
            class Counting:
                def __aiter__(self) -> Any:
                    return self

                async def __anext__(self) -> Any:
                    message = await receive.__anext__()
                    reached.append(name)
                    return message

                async def __aenter__(self) -> Any:
                    return self

                async def __aexit__(self, *exc: object) -> None:
                    await receive.aclose()

            await run(Counting(), *args)

        return wrapper

    monkeypatch.setattr(sampler, "run", counted("sampler", sampler.run))
    monkeypatch.setattr(reducer, "run", counted("reducer", reducer.run))
    engine = FakeEngine()
    config = SchedulerConfig(eos_ids=frozenset({EOS}))
    outputs = []

    async def body(handle: SchedulerHandle) -> None:
        for name in ("a", "b"):
            spec = replace(
                request(name, [1, 2, 3], max_tokens=6),
                sampling=SamplingParams(temperature=1.0, seed=3),
                logprobs=LogprobParams(top=5),
            )
            outputs.append(submit(handle, spec))
        for stream in outputs:
            messages = await collect(stream)
            samples = [s for m in messages if isinstance(m, StepOutput) for s in m.samples]
            assert len(samples) == 6
            assert all(s.logprob is not None and len(s.logprob.top) == 5 for s in samples)

    await run_with(engine, config, body)
    assert reached == []
