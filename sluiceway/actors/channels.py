"""Channel helpers for the per-token path.

anyio's ``send``/``receive`` always pass a checkpoint first, and looking up the
backend for it is a noticeable share of the event loop's time per streamed
token. Where a message is already waiting (or there is room for one), these
helpers skip that checkpoint; when they do wait, they wait the normal way.

A request's output goes through a :func:`open_mailbox` instead of a memory
object stream: the scheduler drops each step's message in without waiting,
and the one reader waits on a plain event (on asyncio, a bare future). A
memory stream's ``receive`` passes a checkpoint before it waits, which costs
the event loop a whole extra turn per streamed token.

A mailbox may have a high-water mark (``limit``). The writer never waits or
refuses a message; instead the mailbox reports ``full`` once ``limit``
messages wait unread, and stays full until the reader has taken it down to
half of that, when it calls ``on_drained``. The scheduler reads ``full`` to
pause a request whose client does not keep up, and the drained call tells it
to resume: a stalled reader costs its request a bounded buffer, not a
generation that runs on.

A mailbox may also wake its reader in batches (``every``): the first message
wakes it at once, and after that a waiting reader wakes only once ``every``
messages wait, or when the writer closes. The reader then takes them all in
one turn, so a stream's task wakes, and its reply writes, once per ``every``
steps instead of once per step (the server's ``--stream-interval``).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Generic, Protocol, TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

T = TypeVar("T")


async def take(receive: MemoryObjectReceiveStream[T]) -> T:
    """Like ``await receive.receive()`` (``EndOfStream`` at the end), without a
    checkpoint when a message is already waiting."""
    try:
        return receive.receive_nowait()
    except anyio.WouldBlock:
        return await receive.receive()


async def put(send: MemoryObjectSendStream[T], message: T) -> None:
    """Like ``await send.send(message)``, without a checkpoint when there is room."""
    try:
        send.send_nowait(message)
    except anyio.WouldBlock:
        await send.send(message)


def event_factory() -> Callable[[], anyio.Event]:
    """The running backend's event class. Making an event from it skips the
    backend lookup that ``anyio.Event()`` does each time; call this inside the
    event loop whose events it will make."""
    return type(anyio.Event())


class _Waiter(Protocol):
    def set(self) -> None: ...

    def wait(self) -> Awaitable[object]: ...


class _Wakeup:
    """A mailbox reader's one wake-up on asyncio: a bare future, awaited
    directly. anyio's event wraps asyncio's, which wraps a future: two more
    coroutine frames to resume, and a waiter set to keep, per streamed token.
    (A cancelled reader drops its wake-up and makes a new one next time, so
    a future, which cannot be awaited again once cancelled, is enough.)"""

    __slots__ = ("_future",)

    def __init__(self, future: asyncio.Future[None]) -> None:
        self._future = future

    def set(self) -> None:
        if not self._future.done():
            self._future.set_result(None)

    def wait(self) -> Awaitable[object]:
        return self._future


def _waiter_factory() -> Callable[[], _Waiter]:
    """Wake-ups for the running loop: futures on asyncio, anyio's events on
    any other backend."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not asyncio
        return event_factory()
    return lambda: _Wakeup(loop.create_future())


class _MailboxState(Generic[T]):
    __slots__ = (
        "every",
        "full",
        "limit",
        "make_waiter",
        "messages",
        "on_drained",
        "reader_closed",
        "waiter",
        "wake_at",
        "writer_closed",
    )

    def __init__(
        self,
        make_waiter: Callable[[], _Waiter],
        limit: int | None,
        on_drained: Callable[[], None] | None,
        every: int = 1,
    ) -> None:
        self.messages: deque[T] = deque()
        self.waiter: _Waiter | None = None
        self.make_waiter = make_waiter
        self.writer_closed = False
        self.reader_closed = False
        self.limit = limit
        self.on_drained = on_drained
        self.full = False
        self.every = every
        #: Messages that wake a waiting reader: 1 until it has read one.
        self.wake_at = 1

    def due(self) -> bool:
        """Whether a waiting reader should wake."""
        return len(self.messages) >= self.wake_at or self.writer_closed or self.reader_closed

    def wake(self) -> None:
        if self.waiter is not None:
            self.waiter.set()
            self.waiter = None


class MailboxWriter(Generic[T]):
    """The sending half: never waits and never refuses (``full`` is advice)."""

    __slots__ = ("_state",)

    def __init__(self, state: _MailboxState[T]) -> None:
        self._state = state

    def send_nowait(self, message: T) -> None:
        """Raises ``ClosedResourceError`` after :meth:`close`, and
        ``BrokenResourceError`` once the reader has gone."""
        state = self._state
        if state.writer_closed:
            raise anyio.ClosedResourceError
        if state.reader_closed:
            raise anyio.BrokenResourceError
        state.messages.append(message)
        if state.limit is not None and len(state.messages) >= state.limit:
            state.full = True
        if len(state.messages) >= state.wake_at:
            state.wake()

    @property
    def full(self) -> bool:
        """Whether the reader is ``limit`` messages behind (and has not yet
        caught up to half of that)."""
        return self._state.full

    def close(self) -> None:
        """No more messages: the reader gets ``EndOfStream`` after the last one."""
        self._state.writer_closed = True
        self._state.wake()


class MailboxReader(Generic[T]):
    """The receiving half, for one task at a time."""

    __slots__ = ("_state",)

    def __init__(self, state: _MailboxState[T]) -> None:
        self._state = state

    def receive_nowait(self) -> T:
        """A waiting message; ``WouldBlock`` if there is none yet, ``EndOfStream``
        once the writer closed and every message was read."""
        state = self._state
        if state.reader_closed:
            raise anyio.ClosedResourceError
        if state.messages:
            message = state.messages.popleft()
            state.wake_at = state.every
            if state.full and len(state.messages) * 2 <= (state.limit or 0):
                state.full = False
                if state.on_drained is not None:
                    state.on_drained()
            return message
        if state.writer_closed:
            raise anyio.EndOfStream
        raise anyio.WouldBlock

    @property
    def ready(self) -> bool:
        """Whether :meth:`receive_nowait` would return at once (a message, or
        the end), without raising ``WouldBlock``; cheaper than trying it."""
        state = self._state
        return bool(state.messages) or state.writer_closed or state.reader_closed

    async def receive(self) -> T:
        """The next message, waiting for it if needed (no checkpoint first);
        past the first message, a mailbox opened with ``every`` waits until
        that many are there (or the end)."""
        state = self._state
        while not state.due():
            if state.waiter is not None:
                raise RuntimeError("a mailbox has one reader at a time")
            waiter = state.waiter = state.make_waiter()
            try:
                await waiter.wait()
            finally:
                if state.waiter is waiter:  # cancelled while waiting
                    state.waiter = None
        return self.receive_nowait()

    def close(self) -> None:
        """The reader is gone: messages still waiting are dropped, and the
        writer's next send raises ``BrokenResourceError``."""
        self._state.reader_closed = True
        self._state.messages.clear()

    async def __aenter__(self) -> MailboxReader[T]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


Mailbox = tuple[MailboxWriter[T], MailboxReader[T]]


def open_mailbox(
    limit: int | None = None, on_drained: Callable[[], None] | None = None, every: int = 1
) -> Mailbox[T]:
    """A one-reader channel that never blocks its writer; with a ``limit``,
    it reports ``full`` past it and calls ``on_drained`` once the reader has
    caught up; with ``every``, it wakes its reader in batches (see the
    module's docstring). Open it inside the event loop that uses it."""
    if every < 1 or (limit is not None and every > limit):
        # Past the limit the writer's request pauses, so a batch larger than
        # the limit would never fill and its reader would never wake.
        raise ValueError(f"every must be between 1 and the limit ({limit}), not {every}")
    state: _MailboxState[T] = _MailboxState(_waiter_factory(), limit, on_drained, every)
    return MailboxWriter(state), MailboxReader(state)
