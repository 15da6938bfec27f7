"""The Responses encoders: output events -> the SSE event stream of a
response, or one ``response`` body. Both are built from the same items
(``items.py``).

The stream, every event with an ``event:`` line equal to its ``type`` and a
``sequence_number`` counting from 0:

    response.created, response.in_progress
    per item, in order:
      response.output_item.added
        message:   content_part.added, output_text.delta..., output_text.done, content_part.done
        reasoning: reasoning_text.delta..., reasoning_text.done
        function:  function_call_arguments.delta..., function_call_arguments.done
        custom:    custom_tool_call_input.delta, custom_tool_call_input.done
      response.output_item.done
    response.completed | response.incomplete (token limit) | response.failed

A custom tool's input goes out whole when its call ends: the model writes it
as a JSON string (``{"input": "..."}``), whose text is known only then.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter

from sluiceway.protocol.messages import (
    Completed,
    Deltas,
    EmitterEvent,
    Failed,
    FinishCause,
    LogprobEntry,
    Usage,
)
from sluiceway.surfaces.responses.items import (
    ItemAdded,
    ItemEvent,
    ItemKind,
    OutputItem,
    OutputItems,
    TextAdded,
)
from sluiceway.surfaces.responses.reply_wire import (
    ArgumentsDoneEvent,
    CallDeltaEvent,
    CustomInputDoneEvent,
    CustomToolCallWire,
    FunctionCallWire,
    IncompleteDetails,
    InputTokensDetails,
    LifecycleEvent,
    LogprobWire,
    MessageWire,
    OutputItemEvent,
    OutputItemWire,
    OutputTextPart,
    OutputTokensDetails,
    PartEvent,
    ReasoningTextPart,
    ReasoningWire,
    ResponseErrorWire,
    ResponseStatus,
    ResponseWire,
    TextDoneEvent,
    TopLogprobWire,
    UsageWire,
)
from sluiceway.surfaces.responses.tools import ToolTable
from sluiceway.surfaces.sse import comment, json_string, sse
from sluiceway.surfaces.wire import WireModel

KEEPALIVE = comment("keepalive")
CANCELLED = "the server stopped before the response was complete"

_LOGPROBS = TypeAdapter(list[LogprobWire])


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplyConfig:
    response_id: str
    created_at: int
    model: str
    tools: ToolTable
    logprobs: bool
    #: The request's settings as the ``response`` object echoes them.
    echo: Mapping[str, Any]
    #: ``return_token_ids``: the prompt's ids (None: ids were not asked for).
    prompt_token_ids: tuple[int, ...] | None = None
    #: How many leading prompt ids were the client's own (None: it sent none).
    reused_prompt_tokens: int | None = None


def logprobs_wire(entries: list[LogprobEntry] | tuple[LogprobEntry, ...]) -> list[LogprobWire]:
    return [
        LogprobWire(
            token=entry.token,
            logprob=entry.logprob,
            bytes=list(entry.bytes),
            top_logprobs=[
                TopLogprobWire(token=top.token, logprob=top.logprob, bytes=list(top.bytes))
                for top in entry.top_logprobs
            ],
        )
        for entry in entries
    ]


def _namespace(item: OutputItem) -> dict[str, str]:
    return {} if item.namespace is None else {"namespace": item.namespace}


def item_wire(
    item: OutputItem, *, added: bool = False, ids: dict[str, list[int]] | None = None
) -> OutputItemWire:
    """An item as it stands, or (``added``) as it was announced: empty;
    ``ids``: the turn's token ids, which its last item carries."""
    wire = _item_wire(item, added=added)
    if ids:
        for name, values in ids.items():
            setattr(wire, name, values)
    return wire


def turn_ids(config: ReplyConfig, items: OutputItems, item: OutputItem) -> dict[str, list[int]]:
    """The ids ``item`` carries: the turn's, on its last item, when asked for."""
    if config.prompt_token_ids is None or item is not items.last:
        return {}
    return {
        "prompt_token_ids": list(config.prompt_token_ids),
        "generation_token_ids": list(items.token_ids),
    }


def _item_wire(item: OutputItem, *, added: bool) -> OutputItemWire:
    status: Any = "in_progress" if added else item.status
    if item.kind is ItemKind.MESSAGE:
        parts = [] if added else [text_part(item)]
        return MessageWire(id=item.id, status=status, content=parts)
    if item.kind is ItemKind.REASONING:
        content = [] if added else [ReasoningTextPart(text=item.text)]
        return ReasoningWire(id=item.id, status=status, content=content, encrypted_content=None)
    if item.kind is ItemKind.FUNCTION_CALL:
        return FunctionCallWire(
            id=item.id,
            status=status,
            call_id=item.call_id,
            name=item.name,
            arguments="" if added else item.text,
            **_namespace(item),
        )
    return CustomToolCallWire(
        id=item.id,
        status=status,
        call_id=item.call_id,
        name=item.name,
        input="" if added else item.custom_input,
        **_namespace(item),
    )


def text_part(item: OutputItem) -> OutputTextPart:
    return OutputTextPart(text=item.text, logprobs=logprobs_wire(item.entries))


def usage_wire(usage: Usage) -> UsageWire:
    return UsageWire(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=usage.cached_tokens),
        output_tokens=usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=usage.reasoning_tokens),
        total_tokens=usage.total_tokens,
    )


def response_wire(
    config: ReplyConfig,
    status: ResponseStatus,
    items: OutputItems,
    *,
    usage: Usage | None = None,
    error: str | None = None,
) -> ResponseWire:
    return ResponseWire(
        id=config.response_id,
        created_at=config.created_at,
        status=status,
        **({"completed_at": int(time.time())} if status == "completed" else {}),
        error=None if error is None else ResponseErrorWire(code="server_error", message=error),
        incomplete_details=(
            IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
        ),
        model=config.model,
        output=[item_wire(item, ids=turn_ids(config, items, item)) for item in items.items],
        usage=None if usage is None else usage_wire(usage),
        **config.echo,
        **_reused(config),
    )


def _reused(config: ReplyConfig) -> dict[str, int]:
    reused = config.reused_prompt_tokens
    return {} if reused is None else {"reused_prompt_tokens": reused}


def final_status(finish: FinishCause | None) -> tuple[ResponseStatus, str | None]:
    """The status a response ends with, and the error of a failed one."""
    if finish is FinishCause.MAX_TOKENS:
        return "incomplete", None
    if finish is FinishCause.CANCELLED:
        return "failed", CANCELLED
    return "completed", None


class ResponsesStreamEncoder:
    """Events of one request -> the Responses SSE event stream."""

    def __init__(self, config: ReplyConfig) -> None:
        self._config = config
        self._items = OutputItems(config.tools, logprobs=config.logprobs)
        self._sequence = 0
        #: Per item (by output index): its delta frames' fixed parts.
        self._templates: dict[int, tuple[bytes, bytes]] = {}

    def _frame(self, event: WireModel, event_type: str) -> bytes:
        return sse(event.to_json(), event=event_type)

    def _next(self) -> int:
        number = self._sequence
        self._sequence += 1
        return number

    def _lifecycle(
        self,
        event_type: str,
        status: ResponseStatus,
        *,
        usage: Usage | None = None,
        error: str | None = None,
    ) -> bytes:
        response = response_wire(self._config, status, self._items, usage=usage, error=error)
        event = LifecycleEvent(type=event_type, sequence_number=self._next(), response=response)
        return self._frame(event, event_type)

    def start(self) -> bytes:
        return self._lifecycle("response.created", "in_progress") + self._lifecycle(
            "response.in_progress", "in_progress"
        )

    def keepalive(self) -> bytes:
        return KEEPALIVE

    def encode(self, event: EmitterEvent) -> bytes:
        if isinstance(event, Deltas):
            return b"".join(
                self._item_frames(item_event)
                for delta in event.deltas
                for item_event in self._items.feed(delta)
            )
        if isinstance(event, Completed):
            status, error = final_status(self._items.finish)
            return self._lifecycle(f"response.{status}", status, usage=event.usage, error=error)
        if isinstance(event, Failed):
            return self._lifecycle("response.failed", "failed", error=event.message)
        return b""

    def _item_frames(self, event: ItemEvent) -> bytes:
        if isinstance(event, TextAdded):
            return self._text_frame(event)
        if isinstance(event, ItemAdded):
            return self._added_frames(event.item)
        return self._done_frames(event.item)

    def _item_event(self, event_type: str, item: OutputItem, *, added: bool = False) -> bytes:
        wire = OutputItemEvent(
            type=event_type,
            sequence_number=self._next(),
            output_index=item.index,
            item=item_wire(
                item, added=added, ids=None if added else turn_ids(self._config, self._items, item)
            ),
        )
        return self._frame(wire, event_type)

    def _part_event(self, event_type: str, item: OutputItem, part: OutputTextPart) -> bytes:
        wire = PartEvent(
            type=event_type,
            sequence_number=self._next(),
            item_id=item.id,
            output_index=item.index,
            content_index=0,
            part=part,
        )
        return self._frame(wire, event_type)

    def _added_frames(self, item: OutputItem) -> bytes:
        frames = self._item_event("response.output_item.added", item, added=True)
        if item.kind is ItemKind.MESSAGE:
            empty = OutputTextPart(text="", logprobs=[])
            frames += self._part_event("response.content_part.added", item, empty)
        return frames

    def _text_frame(self, event: TextAdded) -> bytes:
        """A delta event, framed from its item's template (most events of a
        stream are these; the models frame them several times slower)."""
        item = event.item
        if item.kind is ItemKind.CUSTOM_TOOL_CALL:
            return b""  # its input goes out whole when the call ends
        template = self._templates.get(item.index)
        if template is None:
            template = self._templates[item.index] = _delta_template(item)
        head, middle = template
        parts = [head, str(self._next()).encode(), middle, json_string(event.text)]
        if item.kind is ItemKind.MESSAGE:
            entries = event.entries
            parts += (
                b',"logprobs":',
                _LOGPROBS.dump_json(logprobs_wire(entries)) if entries else b"[]",
            )
        parts.append(b"}\n\n")
        return b"".join(parts)

    def _done_frames(self, item: OutputItem) -> bytes:
        frames = b""
        if item.kind is ItemKind.MESSAGE:
            part = text_part(item)
            frames += self._text_done("response.output_text.done", item, part.logprobs)
            frames += self._part_event("response.content_part.done", item, part)
        elif item.kind is ItemKind.REASONING:
            frames += self._text_done("response.reasoning_text.done", item, None)
        elif item.kind is ItemKind.FUNCTION_CALL:
            done = ArgumentsDoneEvent(
                sequence_number=self._next(),
                item_id=item.id,
                output_index=item.index,
                name=item.name,
                arguments=item.text,
            )
            frames += self._frame(done, done.type)
        else:
            frames += self._custom_input(item)
        return frames + self._item_event("response.output_item.done", item)

    def _text_done(
        self, event_type: str, item: OutputItem, logprobs: list[LogprobWire] | None
    ) -> bytes:
        done = TextDoneEvent(
            type=event_type,
            sequence_number=self._next(),
            item_id=item.id,
            output_index=item.index,
            content_index=0,
            text=item.text,
        )
        if logprobs is not None:
            done.logprobs = logprobs
        return self._frame(done, event_type)

    def _custom_input(self, item: OutputItem) -> bytes:
        text = item.custom_input
        frames = b""
        if text:
            delta = CallDeltaEvent(
                type="response.custom_tool_call_input.delta",
                sequence_number=self._next(),
                item_id=item.id,
                output_index=item.index,
                delta=text,
            )
            frames += self._frame(delta, delta.type)
        done = CustomInputDoneEvent(
            sequence_number=self._next(), item_id=item.id, output_index=item.index, input=text
        )
        return frames + self._frame(done, done.type)


_DELTAS = {
    ItemKind.MESSAGE: b"response.output_text.delta",
    ItemKind.REASONING: b"response.reasoning_text.delta",
    ItemKind.FUNCTION_CALL: b"response.function_call_arguments.delta",
}


def _delta_template(item: OutputItem) -> tuple[bytes, bytes]:
    """What a delta frame of this item holds around its sequence number and
    text: the fields of ``TextDeltaEvent`` / ``CallDeltaEvent``, in order."""
    event_type = _DELTAS[item.kind]
    head = b"event: " + event_type + b'\ndata: {"type":"' + event_type + b'","sequence_number":'
    middle = b',"item_id":' + json_string(item.id) + b',"output_index":' + str(item.index).encode()
    if item.kind is not ItemKind.FUNCTION_CALL:
        middle += b',"content_index":0'
    return head, middle + b',"delta":'


class ResponsesAccumulator:
    """Events of one request -> one ``response`` body (non-streaming)."""

    def __init__(self, config: ReplyConfig) -> None:
        self._config = config
        self._items = OutputItems(config.tools, logprobs=config.logprobs)
        self._usage: Usage | None = None
        self._failure: str | None = None

    @property
    def failure(self) -> str | None:
        return self._failure or final_status(self._items.finish)[1]

    def add(self, event: EmitterEvent) -> None:
        if isinstance(event, Deltas):
            for delta in event.deltas:
                self._items.feed(delta)
        elif isinstance(event, Completed):
            self._usage = event.usage
        elif isinstance(event, Failed):
            self._failure = event.message

    def build(self) -> ResponseWire:
        assert self._usage is not None, "build() before the request completed"
        status, _ = final_status(self._items.finish)
        return response_wire(self._config, status, self._items, usage=self._usage)

    def to_json(self) -> str:
        return self.build().to_json()
