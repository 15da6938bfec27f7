"""A reader that falls behind pauses only its own request (and, past the
stall timeout, ends it); an engine that is lost is restarted while new
requests are refused. The scheduler against the fake engine."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import anyio
import pytest

from sluiceway.actors.channels import MailboxReader, open_mailbox
from sluiceway.actors.scheduler import SchedulerConfig, SchedulerHandle
from sluiceway.engines.base import DecodeResult
from sluiceway.protocol.errors import ServiceUnavailable
from sluiceway.protocol.messages import (
    FailureCause,
    RequestFailed,
    RequestOutput,
    StepOutput,
)
from tests.unit.test_scheduler import EOS, FakeEngine, collect, request, run_with, submit

pytestmark = pytest.mark.anyio

LIMIT = 4


def submit_paced(
    handle: SchedulerHandle, name: str, max_tokens: int
) -> MailboxReader[RequestOutput]:
    send, receive = open_mailbox(LIMIT, lambda: handle.resume(name))
    spec = request(name, [1], max_tokens=max_tokens, ignore_eos=True)
    handle.submit(spec, send, backlog=send)
    return receive


def tokens(messages: list[RequestOutput]) -> int:
    return sum(len(m.samples) for m in messages if isinstance(m, StepOutput))


async def until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    """Poll the scheduler's counters (they have no event to wait on)."""
    with anyio.fail_after(seconds):
        while not condition():  # noqa: ASYNC110
            await anyio.sleep(0.02)


def drain(reader: MailboxReader[RequestOutput]) -> list[RequestOutput]:
    taken = []
    while True:
        try:
            taken.append(reader.receive_nowait())
        except (anyio.WouldBlock, anyio.EndOfStream):
            return taken


async def test_a_reader_that_falls_behind_pauses_only_its_request() -> None:
    engine = FakeEngine()
    config = SchedulerConfig(eos_ids=frozenset({EOS}))

    async def body(handle: SchedulerHandle) -> None:
        slow = submit_paced(handle, "slow", max_tokens=200)
        fast = submit(handle, request("fast", [2], max_tokens=60, ignore_eos=True))
        assert tokens(await collect(fast)) == 60  # never held up by the slow one
        await anyio.sleep(0.05)
        assert handle.paused_requests == 1
        assert handle.running_requests == 1
        # Its buffer holds the limit, plus the steps already under way.
        waiting = drain(slow)
        assert LIMIT <= len(waiting) <= LIMIT + 2
        # Reading resumes it: it runs to its end.
        got = tokens(waiting)
        with anyio.fail_after(10):
            while True:
                try:
                    message = await slow.receive()
                except anyio.EndOfStream:
                    break
                got += tokens([message])
        assert got == 200

    await run_with(engine, config, body)
    decoded = [tokens for kind, tokens in engine.calls if kind == "decode"]
    # The fast request's 59 decode steps ran while the slow one sat out most of them.
    assert sum(1 for step in decoded if len(step) == 1) >= 50  # type: ignore[arg-type]


async def test_a_request_paused_past_the_stall_timeout_ends_and_frees_its_rows() -> None:
    engine = FakeEngine()
    config = SchedulerConfig(eos_ids=frozenset({EOS}), stall_timeout=0.3)

    async def body(handle: SchedulerHandle) -> None:
        stalled = submit_paced(handle, "stalled", max_tokens=10_000)
        started = time.monotonic()
        await anyio.sleep(0.1)
        # Paused: out of the batch (its KV cache freed), still running.
        assert (handle.paused_requests, handle.running_rows, handle.running_requests) == (1, 0, 1)
        await until(lambda: handle.running_requests == 0)
        assert time.monotonic() - started >= 0.3
        messages = drain(stalled)
        assert messages[-1] == RequestFailed(
            message="the client stopped reading", cause=FailureCause.STALLED
        )
        assert tokens(messages) <= LIMIT + 2
        assert handle.paused_requests == 0

    await run_with(engine, config, body)
    assert ("free", 1) in engine.calls


@dataclass
class MortalEngine(FakeEngine):
    """A fake engine that can be killed and restarted, like a child process."""

    alive: bool = True
    restarts: int = 0
    restart_seconds: float = 0.3

    def decode(self, tokens: Mapping[int, int]) -> DecodeResult:
        if not self.alive:
            raise RuntimeError("the engine process is gone")
        return super().decode(tokens)

    def restart(self) -> None:
        time.sleep(self.restart_seconds)
        self.running.clear()
        self.restarts += 1
        self.alive = True


async def test_a_lost_engine_fails_its_requests_refuses_new_ones_and_restarts() -> None:
    engine = MortalEngine()
    config = SchedulerConfig(eos_ids=frozenset({EOS}))

    async def body(handle: SchedulerHandle) -> None:
        running = submit(handle, request("a", [1], max_tokens=10_000, ignore_eos=True))
        async with running:
            await running.receive()
            engine.alive = False
            messages = [m async for m in running]
        assert isinstance(messages[-1], RequestFailed)
        assert messages[-1].cause is FailureCause.ENGINE
        assert not handle.engine_available
        with pytest.raises(ServiceUnavailable):
            submit(handle, request("b", [1]))
        await until(lambda: handle.engine_available)
        assert engine.restarts == 1
        after = await collect(submit(handle, request("c", [1], max_tokens=5)))
        assert tokens(after) == 5

    await run_with(engine, config, body)


async def test_mailbox_reports_full_until_its_reader_catches_up_halfway() -> None:
    drained: list[bool] = []
    send, receive = open_mailbox(4, lambda: drained.append(True))
    for i in range(5):
        send.send_nowait(i)
    assert send.full
    receive.receive_nowait()
    receive.receive_nowait()
    assert send.full  # 3 wait: still more than half of the limit
    assert not drained
    receive.receive_nowait()
    assert not send.full
    assert drained == [True]
