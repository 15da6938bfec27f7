"""Running generation requests against the pipeline, for one HTTP exchange.

An exchange has one job per prompt (chat: always one; legacy completions: one
per prompt in the list), each with its own output actor, all feeding one
emitter. With one job, the output actor's sans-IO core runs in the exchange's
own task, beside the emitter; with several, each runs in a task of its own and
they merge into one channel. The exchange gets its own task group: those
output tasks, and a watcher that awaits ``http.disconnect`` (under Hypercorn's trio worker a
disconnect only reaches an app with a task awaiting ``receive()``). Whichever
ends first -- the reply or the client -- cancels the rest, and the scheduler is
told to drop the requests, which frees their slots within one step.

A request's mailbox has a high-water mark (:data:`MAILBOX_LIMIT` steps):
when the client reads slower than the model writes, the reply's writes wait
on the connection, the mailbox fills, and the scheduler pauses the request
until it drains (see ``sluiceway.actors.channels``). The exchange registers
with the :class:`~sluiceway.server.supervision.Supervisor`, which can end it
from outside (shutdown, deadline) and abandon a write that stalls.

With a stream interval of N (``--stream-interval``), a request's mailbox
wakes its reader for the first step and then once every N steps (or at the
end): the output actor, the encoder and the write then run once for N steps'
tokens. The frames are the same; fewer writes carry them.
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager, closing
from dataclasses import dataclass, field
from typing import Protocol

import anyio
from anyio import CancelScope
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream

from sluiceway.actors import output
from sluiceway.actors.channels import Mailbox, MailboxReader, open_mailbox, take
from sluiceway.actors.output import ChoiceFinisher
from sluiceway.protocol.messages import (
    Backlog,
    Completed,
    Deltas,
    EmitterEvent,
    GenerationRequest,
    Outbox,
    RequestOutput,
)
from sluiceway.server.http import (
    SSE_HEADERS,
    Receive,
    Scope,
    Send,
    read_body,
    send_bytes,
)
from sluiceway.server.record import RequestRecord
from sluiceway.server.supervision import OpenExchange, Supervisor
from sluiceway.surfaces.base import JSON_HEADERS, Headers, Job, StreamEncoder

#: Steps a request's output may run ahead of its client before the request
#: pauses (a step is a token per choice; the SSE frames of these are a few
#: tens of kilobytes at most).
MAILBOX_LIMIT = 64


class Submitter(ChoiceFinisher, Protocol):
    def submit(
        self,
        request: GenerationRequest,
        output: Outbox[RequestOutput],
        *,
        backlog: Backlog | None = None,
    ) -> None: ...

    def cancel(self, request_id: str) -> None: ...

    def resume(self, request_id: str) -> None: ...


@dataclass(slots=True)
class Tracking:
    """What an exchange reports to (the supervisor, the request's record),
    and how often it reads its outputs (the stream interval, in steps)."""

    supervisor: Supervisor = field(default_factory=Supervisor)
    record: RequestRecord = field(default_factory=lambda: RequestRecord("-", "-", "-"))
    stream_interval: int = 1


async def _cancel_on_disconnect(receive: Receive, scope: CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


def _submit_all(
    scheduler: Submitter, jobs: Sequence[Job], every: int
) -> tuple[list[Outbox[RequestOutput]], list[MailboxReader[RequestOutput]]]:
    """Submit every job, or none: a refusal (queue full) cancels the others.
    Returns the mailboxes' two ends."""
    outboxes: list[Outbox[RequestOutput]] = []
    streams: list[MailboxReader[RequestOutput]] = []
    try:
        for job in jobs:
            # The scheduler never waits on a mailbox: past the limit it
            # pauses the request instead, until the reader catches up.
            request_id = job.request.request_id
            mailbox: Mailbox[RequestOutput] = open_mailbox(
                MAILBOX_LIMIT, functools.partial(scheduler.resume, request_id), every
            )
            send, receive = mailbox
            streams.append(receive)
            outboxes.append(send)
            scheduler.submit(job.request, send, backlog=send)
    except BaseException:
        for job in jobs:
            scheduler.cancel(job.request.request_id)
        for receive in streams:
            receive.close()
        raise
    return outboxes, streams


class _Events(Protocol):
    """Where an exchange reads its emitter events from."""

    async def next(self) -> list[EmitterEvent]:
        """The next events (possibly none); ``EndOfStream`` once all are read."""
        ...

    def waiting(self) -> list[EmitterEvent]:
        """Events ready now, without waiting."""
        ...

    def close(self) -> None: ...


@dataclass(slots=True)
class _Merged:
    """Several output actors, each in its own task, feeding one channel."""

    events: MemoryObjectReceiveStream[EmitterEvent]

    async def next(self) -> list[EmitterEvent]:
        return [await take(self.events)]

    def waiting(self) -> list[EmitterEvent]:
        try:
            return [self.events.receive_nowait()]
        except (anyio.WouldBlock, anyio.EndOfStream):
            return []

    def close(self) -> None:
        self.events.close()


@dataclass(slots=True)
class _Inline:
    """One request's output actor run in the exchange's own task: a reply fed
    by a single request saves a task hop per token."""

    tokens: MailboxReader[RequestOutput]
    outputs: output.RequestOutputs

    async def next(self) -> list[EmitterEvent]:
        if self.outputs.ended:
            raise anyio.EndOfStream
        try:
            return self.outputs.handle(await self.tokens.receive())
        except anyio.EndOfStream:
            return self.outputs.close()

    def waiting(self) -> list[EmitterEvent]:
        if not self.tokens.ready:
            return []
        try:
            return self.outputs.handle(self.tokens.receive_nowait())
        except anyio.EndOfStream:
            return self.outputs.close()

    def close(self) -> None:
        self.tokens.close()


def _start_events(
    group: TaskGroup,
    scheduler: Submitter,
    jobs: Sequence[Job],
    streams: Sequence[MailboxReader[RequestOutput]],
) -> _Events:
    if len(jobs) == 1:
        return _Inline(streams[0], output.RequestOutputs(jobs[0].output, scheduler))
    events_send, events_receive = anyio.create_memory_object_stream[EmitterEvent](4)
    with events_send:
        for job, tokens in zip(jobs, streams, strict=True):
            group.start_soon(output.run, tokens, events_send.clone(), scheduler, job.output)
    return _Merged(events_receive)


def _cancel_jobs(
    scheduler: Submitter,
    jobs: Sequence[Job],
    streams: Sequence[MailboxReader[RequestOutput]],
) -> None:
    for job in jobs:
        scheduler.cancel(job.request.request_id)
    for tokens in streams:
        tokens.close()  # the output tasks close theirs too; closing twice is harmless


@asynccontextmanager
async def _exchange(
    receive: Receive, scheduler: Submitter, jobs: Sequence[Job], tracking: Tracking
) -> AsyncIterator[tuple[_Events, OpenExchange]]:
    """Submit the jobs and yield their events, in a task group that a client
    disconnect (or a stalled write) cancels: the body under this context is
    then cut short, and the context exits quietly. Whatever ends, the
    requests are dropped."""
    outboxes, streams = _submit_all(scheduler, jobs, tracking.stream_interval)
    tracking.record.generated = True
    try:
        async with anyio.create_task_group() as group:
            events = _start_events(group, scheduler, jobs, streams)
            group.start_soon(_cancel_on_disconnect, receive, group.cancel_scope)
            with closing(events), tracking.supervisor.track(outboxes, group.cancel_scope) as live:
                yield events, live
            group.cancel_scope.cancel()
    finally:
        _cancel_jobs(scheduler, jobs, streams)


def _note(record: RequestRecord, events: list[EmitterEvent]) -> None:
    """Time the deltas and count the tokens of events going out."""
    for event in events:
        if type(event) is Deltas:
            record.delta()
        elif type(event) is Completed:
            record.usage(event.usage)


async def stream_reply(
    receive: Receive,
    send: Send,
    scheduler: Submitter,
    jobs: Sequence[Job],
    encoder: StreamEncoder,
    keepalive_seconds: float,
    tracking: Tracking | None = None,
) -> None:
    """Submit the jobs and stream their SSE frames until done or disconnected.

    The encoder runs in this task: output events are framed and written as
    they arrive, and events already waiting go out in one write.
    """
    tracking = tracking or Tracking()
    async with _exchange(receive, scheduler, jobs, tracking) as (events, live):
        writer = _Writer(send, live)
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        await writer.body(encoder.start())
        await _relay(events, writer, encoder, keepalive_seconds, tracking.record)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


@dataclass(slots=True)
class _Writer:
    """Writes body frames, telling the supervisor while a write is under way
    (a client that stops reading leaves one under way)."""

    send: Send
    live: OpenExchange

    async def body(self, frame: bytes) -> None:
        self.live.writing_since = time.monotonic()
        await self.send({"type": "http.response.body", "body": frame, "more_body": True})
        self.live.writing_since = None


async def _relay(
    events: _Events,
    writer: _Writer,
    encoder: StreamEncoder,
    keepalive_seconds: float,
    record: RequestRecord,
) -> None:
    """Frame events until the outputs are done.

    Until the first delta, a quiet ``keepalive_seconds`` (a request waiting
    in the queue, a long prompt being prefilled) sends the encoder's
    keepalive frame so that proxies and clients do not time the stream out.
    """
    flowing = False
    while True:
        try:
            if flowing:
                ready = await events.next()
            else:
                ready = []
                with anyio.move_on_after(keepalive_seconds) as waited:
                    ready = await events.next()
                if waited.cancelled_caught:
                    await writer.body(encoder.keepalive())
                    continue
                flowing = any(isinstance(event, Deltas) for event in ready)
        except anyio.EndOfStream:
            return
        frame = _frames(ready, encoder, record)
        while more := events.waiting():  # what is already waiting goes in the same write
            frame += _frames(more, encoder, record)
        if frame:
            await writer.body(frame)


def _frames(events: list[EmitterEvent], encoder: StreamEncoder, record: RequestRecord) -> bytes:
    """The frames of events going out, noted in the request's record."""
    _note(record, events)
    if len(events) == 1:  # one step's deltas: nearly every wake of a stream
        return encoder.encode(events[0])
    return b"".join([encoder.encode(event) for event in events])


async def collect_reply(
    receive: Receive,
    scheduler: Submitter,
    jobs: Sequence[Job],
    collect: Callable[[EmitterEvent], None],
    tracking: Tracking | None = None,
) -> bool:
    """Submit the jobs and hand every event to ``collect``.

    Returns False when the client disconnected first.
    """
    tracking = tracking or Tracking()
    finished = False
    async with _exchange(receive, scheduler, jobs, tracking) as (events, _):
        while True:
            try:
                ready = await events.next()
            except anyio.EndOfStream:
                break
            _note(tracking.record, ready)
            for event in ready:
                collect(event)
        finished = True
    return finished


@dataclass(slots=True)
class HttpCall:
    """One HTTP exchange as a surface's handler sees it (the ``Call`` seam)."""

    scope: Scope
    receive: Receive
    send: Send
    scheduler: Submitter
    params: Mapping[str, str]
    max_body_bytes: int
    keepalive_seconds: float
    tracking: Tracking = field(default_factory=Tracking)

    @property
    def method(self) -> str:
        method: str = self.scope["method"]
        return method

    @property
    def headers(self) -> Headers:
        headers: Headers = self.scope.get("headers", ())
        return headers

    async def body(self) -> bytes:
        return await read_body(self.scope, self.receive, self.max_body_bytes)

    async def send_json(self, text: str, status: int = 200) -> None:
        await self.send_bytes(status, text.encode("utf-8"), JSON_HEADERS)

    async def send_bytes(self, status: int, body: bytes, headers: Headers) -> None:
        await send_bytes(self.send, status, body, headers, head=self.method == "HEAD")

    async def stream(self, jobs: Sequence[Job], encoder: StreamEncoder) -> None:
        await stream_reply(
            self.receive,
            self.send,
            self.scheduler,
            jobs,
            encoder,
            self.keepalive_seconds,
            self.tracking,
        )

    async def collect(self, jobs: Sequence[Job], collect: Callable[[EmitterEvent], None]) -> bool:
        return await collect_reply(self.receive, self.scheduler, jobs, collect, self.tracking)
