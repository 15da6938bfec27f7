"""Running generation requests against the pipeline, for one HTTP exchange.

An exchange has one job per prompt (chat: always one; legacy completions: one
per prompt in the list), each with its own output actor, all feeding one
emitter. The exchange gets its own task group: the output actors, the emitter,
and a watcher that awaits ``http.disconnect`` (under Hypercorn's trio worker a
disconnect only reaches an app with a task awaiting ``receive()``). Whichever
ends first -- the reply or the client -- cancels the rest, and the scheduler is
told to drop the requests, which frees their slots within one step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import anyio
from anyio import CancelScope
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from sluiceway.actors import output
from sluiceway.actors.channels import take
from sluiceway.actors.emitters.common import KEEPALIVE, StreamEncoder
from sluiceway.actors.output import ChoiceFinisher, OutputConfig
from sluiceway.protocol.messages import Deltas, EmitterEvent, GenerationRequest, RequestOutput
from sluiceway.server.http import SSE_HEADERS, Receive, Send


class Submitter(ChoiceFinisher, Protocol):
    def submit(
        self, request: GenerationRequest, output: MemoryObjectSendStream[RequestOutput]
    ) -> None: ...

    def cancel(self, request_id: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Job:
    request: GenerationRequest
    output: OutputConfig


async def _cancel_on_disconnect(receive: Receive, scope: CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


def _submit_all(
    scheduler: Submitter, jobs: Sequence[Job]
) -> list[MemoryObjectReceiveStream[RequestOutput]]:
    """Submit every job, or none: a refusal (queue full) cancels the others."""
    streams = []
    try:
        for job in jobs:
            # One message per step at most, so this bound is never reached: the
            # scheduler never blocks on a slow client.
            send, receive = anyio.create_memory_object_stream[RequestOutput](
                job.request.limits.max_tokens + 2
            )
            streams.append(receive)
            scheduler.submit(job.request, send)
    except BaseException:
        for job in jobs:
            scheduler.cancel(job.request.request_id)
        for receive in streams:
            receive.close()
        raise
    return streams


def _start_outputs(
    group: TaskGroup,
    scheduler: Submitter,
    jobs: Sequence[Job],
    streams: Sequence[MemoryObjectReceiveStream[RequestOutput]],
    events: MemoryObjectSendStream[EmitterEvent],
) -> None:
    with events:
        for job, tokens in zip(jobs, streams, strict=True):
            group.start_soon(output.run, tokens, events.clone(), scheduler, job.output)


def _cancel_jobs(scheduler: Submitter, jobs: Sequence[Job]) -> None:
    for job in jobs:
        scheduler.cancel(job.request.request_id)


async def stream_reply(
    receive: Receive,
    send: Send,
    scheduler: Submitter,
    jobs: Sequence[Job],
    encoder: StreamEncoder,
    keepalive_seconds: float,
) -> None:
    """Submit the jobs and stream their SSE frames until done or disconnected.

    The encoder runs in this task: output events are framed and written as
    they arrive, and events already waiting go out in one write.
    """
    streams = _submit_all(scheduler, jobs)
    events_send, events_receive = anyio.create_memory_object_stream[EmitterEvent](4)
    try:
        async with anyio.create_task_group() as group:
            _start_outputs(group, scheduler, jobs, streams, events_send)
            group.start_soon(_cancel_on_disconnect, receive, group.cancel_scope)
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            await _body(send, encoder.start())
            async with events_receive:
                await _relay(events_receive, send, encoder, keepalive_seconds)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            group.cancel_scope.cancel()
    finally:
        _cancel_jobs(scheduler, jobs)


async def _body(send: Send, frame: bytes) -> None:
    await send({"type": "http.response.body", "body": frame, "more_body": True})


async def _relay(
    events: MemoryObjectReceiveStream[EmitterEvent],
    send: Send,
    encoder: StreamEncoder,
    keepalive_seconds: float,
) -> None:
    """Frame events until the outputs are done.

    Until the first delta, a quiet ``keepalive_seconds`` (a request waiting
    in the queue, a long prompt being prefilled) sends an SSE comment so that
    proxies and clients do not time the stream out.
    """
    flowing = False
    while True:
        if flowing:
            try:
                event = await take(events)
            except anyio.EndOfStream:
                return
        else:
            with anyio.move_on_after(keepalive_seconds) as waited:
                try:
                    event = await events.receive()
                except anyio.EndOfStream:
                    return
            if waited.cancelled_caught:
                await _body(send, KEEPALIVE)
                continue
            flowing = isinstance(event, Deltas)
        frame = encoder.encode(event)
        while True:  # whatever else is already waiting goes in the same write
            try:
                frame += encoder.encode(events.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream):
                break
        if frame:
            await _body(send, frame)


async def collect_reply(
    receive: Receive,
    scheduler: Submitter,
    jobs: Sequence[Job],
    collect: Callable[[EmitterEvent], None],
) -> bool:
    """Submit the jobs and hand every event to ``collect``.

    Returns False when the client disconnected first.
    """
    streams = _submit_all(scheduler, jobs)
    events_send, events_receive = anyio.create_memory_object_stream[EmitterEvent](4)
    finished = False
    try:
        async with anyio.create_task_group() as group:
            _start_outputs(group, scheduler, jobs, streams, events_send)
            group.start_soon(_cancel_on_disconnect, receive, group.cancel_scope)
            async with events_receive:
                async for event in events_receive:
                    collect(event)
            finished = True
            group.cancel_scope.cancel()
    finally:
        _cancel_jobs(scheduler, jobs)
    return finished
