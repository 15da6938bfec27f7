"""The Messages encoders: a reply's events to SSE frames, each with an
``event:`` line equal to its JSON ``type``, or to one ``message`` body. Both
are built from the same block events (:mod:`.blocks`).

A stream goes: ``message_start`` (the message with no content, the prompt's
token count), then per block ``content_block_start``, its deltas and
``content_block_stop``, then ``message_delta`` (the stop reason, the usage;
with ``return_token_ids`` the generated ids) and ``message_stop``; ``ping`` while nothing flows; an ``error`` event if the
generation fails after the stream started. A thinking block ends with an
empty ``signature_delta``, as Anthropic's do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from sluiceway.protocol.messages import ChoiceDelta, Completed, Deltas, EmitterEvent, Failed, Usage
from sluiceway.surfaces.anthropic.blocks import (
    Added,
    BlockEvent,
    BlockKind,
    Blocks,
    Opened,
    stop_reason,
)
from sluiceway.surfaces.anthropic.errors import error_body
from sluiceway.surfaces.anthropic.wire import (
    BlockWire,
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    InputJsonDelta,
    MessageDeltaEvent,
    MessageStartEvent,
    MessageStopEvent,
    MessageWire,
    PingEvent,
    SignatureDelta,
    StopDelta,
    StopReason,
    TextBlockWire,
    TextDelta,
    ThinkingBlockWire,
    ThinkingDelta,
    ToolUseBlockWire,
    UsageWire,
)
from sluiceway.surfaces.sse import json_string, sse
from sluiceway.surfaces.wire import WireModel


@dataclass(frozen=True, slots=True, kw_only=True)
class MessageReplyConfig:
    message_id: str
    model: str
    #: The prompt's length in tokens: ``message_start``'s ``input_tokens``,
    #: sent before the prefix cache's share is known; ``message_delta``
    #: then gives the split (:func:`usage_wire`), which the SDKs apply.
    input_tokens: int
    #: ``return_token_ids``: the prompt's ids (None: ids were not asked for).
    prompt_token_ids: tuple[int, ...] | None = None
    #: How many leading prompt ids were the client's own (None: it sent none).
    reused_prompt_tokens: int | None = None

    def message_fields(self) -> dict[str, Any]:
        """The message's extension fields that are known before generating."""
        fields: dict[str, Any] = {}
        if self.prompt_token_ids is not None:
            fields["prompt_token_ids"] = list(self.prompt_token_ids)
        if self.reused_prompt_tokens is not None:
            fields["reused_prompt_tokens"] = self.reused_prompt_tokens
        return fields

    def generated(self, ids: list[int]) -> dict[str, Any]:
        """The generated ids, when asked for."""
        return {} if self.prompt_token_ids is None else {"generation_token_ids": ids}


def usage_wire(prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> UsageWire:
    """Anthropic's usage: ``input_tokens`` counts only the prompt tokens that
    were prefilled, the ones the prefix cache supplied are
    ``cache_read_input_tokens`` (their sum is ``count_tokens``). The cache
    is filled as a side effect of every prefill, so no write is reported."""
    return UsageWire(
        input_tokens=prompt_tokens - cached_tokens,
        output_tokens=output_tokens,
        cache_creation_input_tokens=0,
        cache_read_input_tokens=cached_tokens,
    )


def final_usage(usage: Usage) -> UsageWire:
    return usage_wire(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)


def event(model: WireModel) -> bytes:
    """One stream event, its ``event:`` line naming its type."""
    payload = model.to_json()
    kind = getattr(model, "type", None)
    assert isinstance(kind, str)
    return sse(payload, event=kind)


#: The delta model of each kind of block, around its text.
_DELTAS: dict[BlockKind, Any] = {
    BlockKind.TEXT: lambda text: TextDelta(text=text),
    BlockKind.THINKING: lambda text: ThinkingDelta(thinking=text),
    BlockKind.TOOL_USE: lambda text: InputJsonDelta(partial_json=text),
}


def _delta_template(kind: BlockKind) -> tuple[bytes, bytes]:
    """The frame of a delta of ``kind`` cut around its index and text: most
    frames of a stream are these, and a template is several times cheaper
    than building and dumping the models."""
    marker = "\x00"
    frame = event(ContentBlockDeltaEvent(index=0, delta=_DELTAS[kind](marker)))
    head, _, tail = frame.partition(b'"index":0')
    return head + b'"index":', tail.replace(json_string(marker), b"%s", 1)


class MessageStreamEncoder:
    """Events of one request -> Messages SSE frames."""

    def __init__(self, config: MessageReplyConfig) -> None:
        self._config = config
        self._blocks = Blocks()
        self._stop: tuple[StopReason, str | None] = ("end_turn", None)
        self._templates = {kind: _delta_template(kind) for kind in BlockKind}
        self._token_ids: list[int] = []

    def start(self) -> bytes:
        config = self._config
        message = MessageWire(
            id=config.message_id,
            model=config.model,
            content=[],
            stop_reason=None,
            stop_sequence=None,
            usage=usage_wire(config.input_tokens, 0),
            **config.message_fields(),
        )
        return event(MessageStartEvent(message=message))

    def keepalive(self) -> bytes:
        return event(PingEvent())

    def encode(self, item: EmitterEvent) -> bytes:
        if isinstance(item, Deltas):
            return b"".join(self._delta_frames(delta) for delta in item.deltas)
        if isinstance(item, Completed):
            stop, sequence = self._stop
            return event(
                MessageDeltaEvent(
                    delta=StopDelta(
                        stop_reason=stop,
                        stop_sequence=sequence,
                        **self._config.generated(self._token_ids),
                    ),
                    usage=final_usage(item.usage),
                )
            ) + event(MessageStopEvent())
        if isinstance(item, Failed):
            return sse(error_body("api_error", item.message), event="error")
        return b""

    def _delta_frames(self, delta: ChoiceDelta) -> bytes:
        self._token_ids += delta.token_ids
        frames = b"".join(self._frame(block) for block in self._blocks.feed(delta))
        if delta.finish is not None:
            self._stop = stop_reason(delta)
        return frames

    def _frame(self, block: BlockEvent) -> bytes:
        if isinstance(block, Added):
            head, tail = self._templates[block.kind]
            return head + str(block.index).encode() + tail % json_string(block.text)
        if isinstance(block, Opened):
            return event(ContentBlockStartEvent(index=block.index, content_block=_empty(block)))
        stop = event(ContentBlockStopEvent(index=block.index))
        if block.kind is BlockKind.THINKING:
            signature = ContentBlockDeltaEvent(
                index=block.index, delta=SignatureDelta(signature="")
            )
            return event(signature) + stop
        return stop


def _empty(opened: Opened) -> BlockWire:
    """A block as ``content_block_start`` shows it, before any of its text."""
    if opened.kind is BlockKind.TEXT:
        return TextBlockWire(text="")
    if opened.kind is BlockKind.THINKING:
        return ThinkingBlockWire(thinking="", signature="")
    return ToolUseBlockWire(id=opened.tool_id, name=opened.name, input={})


@dataclass(slots=True)
class _Block:
    opened: Opened
    parts: list[str] = field(default_factory=list)

    def wire(self) -> BlockWire:
        text = "".join(self.parts)
        if self.opened.kind is BlockKind.TEXT:
            return TextBlockWire(text=text)
        if self.opened.kind is BlockKind.THINKING:
            return ThinkingBlockWire(thinking=text, signature="")
        return ToolUseBlockWire(
            id=self.opened.tool_id, name=self.opened.name, input=json.loads(text)
        )


class MessageAccumulator:
    """Events of one request -> one ``message`` (non-streaming)."""

    def __init__(self, config: MessageReplyConfig) -> None:
        self._config = config
        self._blocks = Blocks()
        self._content: list[_Block] = []
        self._stop: tuple[StopReason, str | None] = ("end_turn", None)
        self.usage: Usage | None = None
        self.failure: str | None = None
        self._token_ids: list[int] = []

    def add(self, item: EmitterEvent) -> None:
        if isinstance(item, Deltas):
            for delta in item.deltas:
                self._add_delta(delta)
        elif isinstance(item, Completed):
            self.usage = item.usage
        elif isinstance(item, Failed):
            self.failure = item.message

    def _add_delta(self, delta: ChoiceDelta) -> None:
        self._token_ids += delta.token_ids
        for block in self._blocks.feed(delta):
            if isinstance(block, Opened):
                self._content.append(_Block(block))
            elif isinstance(block, Added):
                self._content[block.index].parts.append(block.text)
        if delta.finish is not None:
            self._stop = stop_reason(delta)

    def to_json(self) -> str:
        return self.build().to_json()

    def build(self) -> MessageWire:
        assert self.usage is not None, "build() before the request completed"
        stop, sequence = self._stop
        return MessageWire(
            id=self._config.message_id,
            model=self._config.model,
            content=[block.wire() for block in self._content],
            stop_reason=stop,
            stop_sequence=sequence,
            usage=final_usage(self.usage),
            **self._config.message_fields(),
            **self._config.generated(self._token_ids),
        )
