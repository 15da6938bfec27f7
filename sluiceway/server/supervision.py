"""Ending generating exchanges from outside: the drain on shutdown,
per-request deadlines, and clients that stop reading.

Every exchange that submits jobs registers an :class:`OpenExchange` for its
lifetime. The :class:`Supervisor` ends one by putting a ``RequestFailed``
into its requests' mailboxes, behind whatever tokens already wait there: the
output core turns it into a ``Failed`` event, and the route's surface into
its failure frame (its error body, for a whole reply), exactly as it does an
engine failure. Nothing on the per-token path changes for it, and the server
never spells any surface's error.

A watchdog looks at every open exchange once a second. Past its deadline
(``--request-timeout``) an exchange is failed. A write to the client that has
not returned for ``--stall-timeout`` is cancelled, which abandons the
response and closes the connection (under Hypercorn's trio worker a write is
shielded from cancellation; there the scheduler's own stall timeout frees the
request's rows, and the write ends when the connection does).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import anyio
from anyio import CancelScope

from sluiceway.protocol.messages import FailureCause, Outbox, RequestFailed, RequestOutput

logger = logging.getLogger(__name__)

#: How often the watchdog looks at the open exchanges.
WATCH_INTERVAL_SECONDS = 1.0


@dataclass(slots=True, eq=False)
class OpenExchange:
    """One exchange while it generates."""

    #: Where its requests' outputs go (one mailbox per job).
    outboxes: Sequence[Outbox[RequestOutput]]
    #: The exchange's task group: cancelling it abandons the reply.
    scope: CancelScope
    #: When it must end (monotonic seconds), if ever.
    deadline: float | None = None
    #: Since when a write to the client has been under way (None: none is).
    writing_since: float | None = None
    failed: bool = field(default=False)

    def fail(self, message: str, cause: FailureCause) -> None:
        """End the exchange's requests with ``message``, after what waits."""
        if self.failed:
            return
        self.failed = True
        for outbox in self.outboxes:
            # A closed mailbox belongs to a request that already ended.
            with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
                outbox.send_nowait(RequestFailed(message=message, cause=cause))


class Supervisor:
    """The open exchanges, and what ends them from outside."""

    def __init__(
        self, *, request_timeout: float | None = None, stall_timeout: float | None = None
    ) -> None:
        self.request_timeout = request_timeout
        self.stall_timeout = stall_timeout
        self._open: set[OpenExchange] = set()
        self._emptied: anyio.Event | None = None

    @property
    def open_count(self) -> int:
        return len(self._open)

    @contextlib.contextmanager
    def track(
        self, outboxes: Sequence[Outbox[RequestOutput]], scope: CancelScope
    ) -> Iterator[OpenExchange]:
        """Register an exchange for as long as the context lasts."""
        deadline = None
        if self.request_timeout is not None:
            deadline = time.monotonic() + self.request_timeout
        exchange = OpenExchange(outboxes, scope, deadline)
        self._open.add(exchange)
        try:
            yield exchange
        finally:
            self._open.discard(exchange)
            if not self._open and self._emptied is not None:
                self._emptied.set()

    def fail_all(self, message: str, cause: FailureCause) -> None:
        for exchange in list(self._open):
            exchange.fail(message, cause)

    async def wait_empty(self, seconds: float) -> bool:
        """Wait until no exchange is open; False if ``seconds`` passed first."""
        with anyio.move_on_after(seconds):
            while self._open:
                self._emptied = anyio.Event()
                await self._emptied.wait()
            return True
        return False

    async def watch(self) -> None:
        """Check every open exchange's deadline and writes, forever."""
        while True:
            await anyio.sleep(WATCH_INTERVAL_SECONDS)
            self.check(time.monotonic())

    def check(self, now: float) -> None:
        for exchange in list(self._open):
            if exchange.deadline is not None and now >= exchange.deadline:
                exchange.fail(
                    f"the request ran past the server's {self.request_timeout:g} s limit",
                    FailureCause.DEADLINE,
                )
            since, limit = exchange.writing_since, self.stall_timeout
            if since is not None and limit is not None and now - since >= limit:
                logger.warning("a client stopped reading; abandoning its reply")
                exchange.scope.cancel()
