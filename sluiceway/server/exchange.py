"""Running one generation request against the pipeline, for one HTTP exchange.

The request gets its own task group: the output actor, the emitter, and a
watcher that awaits ``http.disconnect`` (under Hypercorn's trio worker a
disconnect only reaches an app with a task awaiting ``receive()``). Whichever
ends first -- the reply or the client -- cancels the rest, and the scheduler is
told to drop the request, which frees its slots within one step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import anyio
from anyio import CancelScope
from anyio.streams.memory import MemoryObjectSendStream

from sluiceway.actors import output
from sluiceway.actors.emitters.common import StreamEncoder, stream
from sluiceway.actors.output import ChoiceFinisher, OutputConfig
from sluiceway.protocol.messages import EmitterEvent, GenerationRequest, RequestOutput
from sluiceway.server.http import SSE_HEADERS, Receive, Send


class Submitter(ChoiceFinisher, Protocol):
    def submit(
        self, request: GenerationRequest, output: MemoryObjectSendStream[RequestOutput]
    ) -> None: ...

    def cancel(self, request_id: str) -> None: ...


async def _cancel_on_disconnect(receive: Receive, scope: CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


def _token_buffer(request: GenerationRequest) -> int:
    # One message per step at most: the scheduler never blocks on a slow client,
    # and this is still a bound (the request cannot produce more).
    return request.limits.max_tokens + 2


async def stream_reply(
    receive: Receive,
    send: Send,
    scheduler: Submitter,
    request: GenerationRequest,
    config: OutputConfig,
    encoder: StreamEncoder,
) -> None:
    """Submit ``request`` and stream its SSE frames until done or disconnected."""
    tokens_send, tokens_receive = anyio.create_memory_object_stream[RequestOutput](
        _token_buffer(request)
    )
    events_send, events_receive = anyio.create_memory_object_stream[EmitterEvent](4)
    frames_send, frames_receive = anyio.create_memory_object_stream[bytes](4)
    try:
        scheduler.submit(request, tokens_send)
        async with anyio.create_task_group() as group:
            group.start_soon(output.run, tokens_receive, events_send, scheduler, config)
            group.start_soon(stream, events_receive, frames_send, encoder)
            group.start_soon(_cancel_on_disconnect, receive, group.cancel_scope)
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            async with frames_receive:
                async for frame in frames_receive:
                    await send({"type": "http.response.body", "body": frame, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            group.cancel_scope.cancel()
    finally:
        scheduler.cancel(request.request_id)
        for end in (tokens_send, tokens_receive, events_send, events_receive):
            end.close()
        frames_send.close()
        frames_receive.close()


async def collect_reply(
    receive: Receive,
    scheduler: Submitter,
    request: GenerationRequest,
    config: OutputConfig,
    collect: Callable[[EmitterEvent], None],
) -> bool:
    """Submit ``request`` and hand every event to ``collect``.

    Returns False when the client disconnected first.
    """
    tokens_send, tokens_receive = anyio.create_memory_object_stream[RequestOutput](
        _token_buffer(request)
    )
    events_send, events_receive = anyio.create_memory_object_stream[EmitterEvent](4)
    finished = False
    try:
        scheduler.submit(request, tokens_send)
        async with anyio.create_task_group() as group:
            group.start_soon(output.run, tokens_receive, events_send, scheduler, config)
            group.start_soon(_cancel_on_disconnect, receive, group.cancel_scope)
            async with events_receive:
                async for event in events_receive:
                    collect(event)
            finished = True
            group.cancel_scope.cancel()
    finally:
        scheduler.cancel(request.request_id)
        for end in (tokens_send, tokens_receive, events_send, events_receive):
            end.close()
    return finished
