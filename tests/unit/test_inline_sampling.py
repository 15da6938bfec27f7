"""Small steps are sampled and reduced on the event loop; large ones in a thread.

The sampler and reducer actors skip ``anyio.to_thread`` for a step of at most
``INLINE_LOGITS`` logits (NumPy holds the GIL on so few numbers, so the thread
only costs hops); a larger step must still leave the event loop.
"""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest

from sluiceway.actors import reducer, sampler
from sluiceway.actors.sampler import INLINE_LOGITS, SamplerConfig
from sluiceway.protocol.messages import LogitsStep, LogprobParams, Row, SampledStep, SamplingParams


def _row(index: int) -> Row:
    return Row(
        request_id=f"r{index}",
        choice=0,
        sampling=SamplingParams(temperature=1.0, seed=index),
        logprobs=LogprobParams(top=5),
        prompt_ids=(1, 2, 3),
        first=True,
    )


async def _through_both(rows: int, vocab: int) -> tuple[SampledStep, int]:
    """One sampled step with top-5 logprobs through both actors; how many
    thread hops it took."""
    hops = 0
    run_sync = anyio.to_thread.run_sync

    async def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal hops
        hops += 1
        return await run_sync(*args, **kwargs)

    logits = np.random.default_rng(0).standard_normal((rows, vocab)).astype(np.float32)
    step = LogitsStep(step=1, rows=tuple(_row(i) for i in range(rows)), logits=logits)
    to_sampler, sampler_in = anyio.create_memory_object_stream[LogitsStep](1)
    to_reducer, reducer_in = anyio.create_memory_object_stream[SampledStep](1)
    out, results = anyio.create_memory_object_stream[SampledStep](1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(anyio.to_thread, "run_sync", counting)
        async with anyio.create_task_group() as group, results:
            group.start_soon(sampler.run, sampler_in, to_reducer, SamplerConfig())
            group.start_soon(reducer.run, reducer_in, out)
            async with to_sampler:
                await to_sampler.send(step)
            sampled = await results.receive()
    return sampled, hops


@pytest.mark.anyio
async def test_a_small_step_stays_on_the_event_loop() -> None:
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
