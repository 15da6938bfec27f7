"""A request whose reader falls behind leaves the batch (its KV cache freed)
and is prefilled back when the reader catches up: on both real engines, its
tokens are exactly those of a run that never paused (greedy, seeded, and
constrained by a grammar), and a request beside it is not held up."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from sluiceway.actors.channels import open_mailbox
from sluiceway.actors.scheduler import SchedulerHandle
from sluiceway.protocol.constraints import Constraint, ConstraintKind
from sluiceway.protocol.messages import GenerationRequest, Limits, RequestOutput, SamplingParams
from tests.engines.conftest import ENGINES
from tests.engines.constrained_rig import Outcome, Rig, open_rig, with_pipeline
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


#: Long enough to pause three times; a grammar that restarted after a pause
#: would ask for another "<" in the middle.
PATTERN = r"<[0-9]{150}>"


def seeded(
    rig: Rig, name: str, *, constrained: bool, temperature: float = 1.0, max_tokens: int = 200
) -> GenerationRequest:
    constraint = Constraint(kind=ConstraintKind.REGEX, text=PATTERN) if constrained else None
    return GenerationRequest(
        request_id=name,
        prompt_ids=tuple(rig.tokenizer.encode_prompt("Count for me.")),
        n=2,
        sampling=SamplingParams(temperature=temperature, seed=11),
        limits=Limits(max_tokens=max_tokens, ignore_eos=not constrained),
        constraint=constraint,
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


@pytest.mark.parametrize("kind", ["sampled", "sampled-constrained", "greedy-constrained"])
def test_a_paused_request_keeps_its_seed_and_its_grammar(rig: Rig, kind: str) -> None:
    """The sampler keeps a paused choice's random stream and grammar walk:
    the tokens after each pause continue the same run."""
    constrained = kind.endswith("constrained")
    temperature = 0.0 if kind.startswith("greedy") else 1.0

    def spec(name: str) -> GenerationRequest:
        return seeded(rig, name, constrained=constrained, temperature=temperature)

    async def body(handle: SchedulerHandle) -> None:
        expected = await ids_of(handle, spec("unpaused"), pauses=0)
        # Steps go on beside the pauses (a sampled neighbour), or the
        # sampler would never see the paused choice missing from one.
        async with anyio.create_task_group() as group:
            beside = seeded(rig, "beside", constrained=False, max_tokens=2000)
            group.start_soon(functools.partial(ids_of, handle, beside, pauses=0))
            paused = await ids_of(handle, spec("paused"), pauses=3)
            group.cancel_scope.cancel()
        assert paused == expected
        assert all(len(choice) > 3 * (LIMIT + 2) for choice in paused)
        if constrained:
            for choice in paused:
                text = rig.text(Outcome(choice, None))
                assert re.fullmatch(PATTERN, text), text

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
