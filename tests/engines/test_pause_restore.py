"""A request whose reader falls behind leaves the batch (its KV cache freed)
and is prefilled back when the reader catches up: on both real engines, its
tokens are exactly those of a run that never paused, and a request beside it
is not held up."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from sluiceway.actors.channels import open_mailbox
from sluiceway.actors.scheduler import SchedulerHandle
from sluiceway.protocol.messages import GenerationRequest, Limits, RequestOutput, SamplingParams
from tests.engines.conftest import ENGINES
from tests.engines.constrained_rig import Rig, open_rig, with_pipeline
from tests.unit.test_pacing import tokens, until

LIMIT = 8


@pytest.fixture(scope="module", params=ENGINES)
def rig(request: pytest.FixtureRequest, default_model: Path) -> Iterator[Rig]:
    yield from open_rig(default_model, str(request.param), in_child=False)


def greedy(rig: Rig, name: str, max_tokens: int, n: int = 1) -> GenerationRequest:
    return GenerationRequest(
        request_id=name,
        prompt_ids=tuple(rig.tokenizer.encode_prompt("Tell me about rivers.")),
        n=n,
        sampling=SamplingParams(temperature=0.0),
        limits=Limits(max_tokens=max_tokens, ignore_eos=True),
    )


async def ids_of(handle: SchedulerHandle, request: GenerationRequest, *, pauses: int) -> list:
    """Run ``request``; the ids of each choice. Its reader stalls ``pauses``
    times: it stops reading until the scheduler has paused the request, then
    reads until it has caught up (which resumes it), then reads freely.
    (A ``Resume`` restores the request by prefilling its prompt and tokens.)

    A reader that only stalls once its mailbox is full never stalls at all:
    it takes each step's message while the engine computes the next, so the
    mailbox never fills. The stall has to come first."""
    send, receive = open_mailbox(LIMIT, lambda: handle.resume(request.request_id))
    handle.submit(request, send, backlog=send)
    got: list[list[int]] = [[] for _ in range(request.n)]
    stalls = 0
    async with receive:
        while True:
            if stalls < pauses and not send.full:
                # Until the request is paused: its mailbox full, its rows out.
                await until(lambda: send.full and handle.paused_requests == 1, 30)
                stalls += 1
            try:
                message: RequestOutput = await receive.receive()
            except anyio.EndOfStream:
                break
            for sample in getattr(message, "samples", ()):
                got[sample.choice].append(sample.token_id)
    return got


def test_a_paused_request_resumes_with_the_same_tokens(rig: Rig) -> None:
    async def body(handle: SchedulerHandle) -> None:
        expected = await ids_of(handle, greedy(rig, "unpaused", 120, n=2), pauses=0)
        paused = await ids_of(handle, greedy(rig, "paused", 120, n=2), pauses=3)
        assert paused == expected
        assert [len(choice) for choice in paused] == [120, 120]
        assert handle.paused_requests == 0

    anyio.run(with_pipeline, rig.model, body)


def test_a_paused_request_does_not_hold_up_another(rig: Rig) -> None:
    async def body(handle: SchedulerHandle) -> None:
        send, stalled = open_mailbox(LIMIT, lambda: handle.resume("stalled"))
        handle.submit(greedy(rig, "stalled", 400), send, backlog=send)
        beside = await ids_of(handle, greedy(rig, "beside", 200), pauses=0)
        assert len(beside[0]) == 200
        assert handle.paused_requests == 1
        waiting = []
        while True:
            try:
                waiting.append(stalled.receive_nowait())
            except anyio.WouldBlock:
                break
        assert tokens(waiting) <= LIMIT + 2
        stalled.close()

    anyio.run(with_pipeline, rig.model, body)
