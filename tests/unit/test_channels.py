"""The per-token channels: a request's mailbox and the engine thread's handover."""

from __future__ import annotations

import threading
from collections.abc import Callable

import anyio
import anyio.lowlevel
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream
from hypothesis import given, settings
from hypothesis import strategies as st

from sluiceway.actors.channels import Mailbox, MailboxReader, open_mailbox
from sluiceway.actors.engine_work import EngineThread, LoopLink

pytestmark = pytest.mark.anyio


async def test_mailbox_delivers_in_order_then_ends() -> None:
    send, receive = open_mailbox()
    assert not receive.ready
    for message in ("a", "b", "c"):
        send.send_nowait(message)
    send.close()
    assert receive.ready
    assert [await receive.receive() for _ in range(3)] == ["a", "b", "c"]
    assert receive.ready  # the end is waiting
    with pytest.raises(anyio.EndOfStream):
        await receive.receive()
    with pytest.raises(anyio.EndOfStream):
        receive.receive_nowait()
    with pytest.raises(anyio.ClosedResourceError):
        send.send_nowait("late")


async def test_mailbox_reader_waits_for_the_writer() -> None:
    send, receive = open_mailbox()
    got: list[str] = []

    async def read_all() -> None:
        while True:
            try:
                got.append(await receive.receive())
            except anyio.EndOfStream:
                return

    async with anyio.create_task_group() as group:
        group.start_soon(read_all)
        await anyio.wait_all_tasks_blocked()
        with pytest.raises(anyio.WouldBlock):
            receive.receive_nowait()
        send.send_nowait("one")
        await anyio.wait_all_tasks_blocked()
        assert got == ["one"]
        send.send_nowait("two")
        send.close()
    assert got == ["one", "two"]


async def test_a_closed_reader_breaks_the_writer_and_drops_what_waits() -> None:
    send, receive = open_mailbox()
    send.send_nowait(1)
    receive.close()
    with pytest.raises(anyio.BrokenResourceError):
        send.send_nowait(2)
    with pytest.raises(anyio.ClosedResourceError):
        receive.receive_nowait()
    send.close()  # closing the writer after the reader is harmless


async def test_a_reader_cancelled_while_waiting_can_wait_again() -> None:
    send, receive = open_mailbox()
    with anyio.move_on_after(0.01):
        await receive.receive()
    send.send_nowait("after")
    with anyio.fail_after(1):
        assert await receive.receive() == "after"


async def test_a_mailbox_has_one_reader_at_a_time() -> None:
    _, receive = open_mailbox()
    async with anyio.create_task_group() as group:
        group.start_soon(receive.receive)
        await anyio.wait_all_tasks_blocked()
        with pytest.raises(RuntimeError, match="one reader"):
            await receive.receive()
        group.cancel_scope.cancel()


async def read_in_batches(
    receive: MailboxReader[int], written: MemoryObjectReceiveStream[None], writing: list[bool]
) -> list[list[int]]:
    """What each wake-up of the reader finds: the message it waited for and
    those already waiting beside it; after each, it waits for ``written``
    (the reply's write, during which more messages may come), ``writing``
    meanwhile."""
    batches: list[list[int]] = []
    while True:
        try:
            batch = [await receive.receive()]
        except anyio.EndOfStream:
            return batches
        while receive.ready:
            try:
                batch.append(receive.receive_nowait())
            except anyio.EndOfStream:
                break
        batches.append(batch)
        writing[0] = True
        await written.receive()
        writing[0] = False


async def settle() -> None:
    """Let the other task run until it waits again (anyio's
    ``wait_all_tasks_blocked`` polls every 0.1 s on asyncio: too slow for a
    property's hundreds of turns)."""
    for _ in range(8):
        await anyio.lowlevel.checkpoint()


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@settings(max_examples=60, deadline=None)
@given(
    every=st.integers(1, 8),
    bursts=st.lists(st.integers(1, 3), max_size=20),
    slack=st.integers(0, 8),
)
def test_a_batched_mailbox_wakes_its_reader_first_then_every_n(
    backend: str, every: int, bursts: list[int], slack: int
) -> None:
    """The writer sends bursts of messages (steps that came while the reader
    was busy make a burst), each while the reader waits for the mailbox or
    for its write to end, and then ends that write: the reader's first wake
    takes the first burst, every later one finds at least ``every`` messages,
    but the last, which the end wakes; whatever the limit above the batch."""

    async def run() -> list[list[int]]:
        mailbox: Mailbox[int] = open_mailbox(every + slack, every=every)
        send, receive = mailbox
        end_write, written = anyio.create_memory_object_stream[None](1)
        found: list[list[list[int]]] = []
        writing = [False]

        async def reader() -> None:
            found.append(await read_in_batches(receive, written, writing))

        async with end_write, written, anyio.create_task_group() as group:
            group.start_soon(reader)
            sent = 0
            for burst in bursts:
                await settle()
                for _ in range(burst):
                    send.send_nowait(sent)
                    sent += 1
                if writing[0]:
                    end_write.send_nowait(None)
            send.close()
            while not found:  # the reader's last writes end too
                await settle()
                if writing[0]:
                    end_write.send_nowait(None)
        return found[0]

    batches = anyio.run(run, backend=backend)
    assert [m for batch in batches for m in batch] == list(range(sum(bursts)))
    sizes = [len(batch) for batch in batches]
    if bursts:
        assert sizes[0] == bursts[0]
    assert all(size >= every for size in sizes[1:-1])


def test_a_batch_larger_than_the_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="between 1 and the limit"):
        open_mailbox(4, every=5)
    with pytest.raises(ValueError, match="between 1 and the limit"):
        open_mailbox(every=0)


async def test_engine_thread_reports_results_and_errors() -> None:
    thread = EngineThread()
    try:
        assert await thread.run(lambda: threading.current_thread().name) == "engine"

        def fail() -> None:
            raise ValueError("engine broke")

        with pytest.raises(ValueError, match="engine broke"):
            await thread.run(fail)
        assert await thread.run(lambda: 42) == 42  # the thread survives a failure
    finally:
        thread.close()


async def test_a_cancelled_wait_still_waits_for_the_engine() -> None:
    """Cancelling the caller must not leave the engine mid-call: the wait
    ends only once the work is done, and then the cancellation goes on."""
    thread = EngineThread()
    release = threading.Event()
    finished = threading.Event()

    def slow(report: Callable[[str], None]) -> None:
        release.wait(5)
        finished.set()
        report("done")

    try:
        running = thread.start_reporting(LoopLink.here(), slow)
        with anyio.move_on_after(0.05) as scope:
            async with anyio.create_task_group() as group:
                group.start_soon(running.result)
                await anyio.sleep(0.02)
                threading.Timer(0.2, release.set).start()
        assert scope.cancelled_caught
        assert finished.is_set()
    finally:
        release.set()
        thread.close()


async def test_work_that_fails_after_its_handover_is_only_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    thread = EngineThread()

    def report_then_fail(report: Callable[[str], None]) -> None:
        report("handed over")
        raise RuntimeError("after the handover")

    try:
        running = thread.start_reporting(LoopLink.here(), report_then_fail)
        assert await running.result() == "handed over"
        assert await thread.run(lambda: "still up") == "still up"
    finally:
        thread.close()
    assert "after the handover failed" in caplog.text
