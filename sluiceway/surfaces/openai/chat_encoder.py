"""The chat encoder: output events to ``chat.completion.chunk`` SSE frames, or
to one ``chat.completion`` body. Both shapes come from the same deltas."""

from __future__ import annotations

from dataclasses import dataclass, field

from sluiceway.protocol.messages import (
    ChoiceDelta,
    ChoiceLogprobs,
    Completed,
    Deltas,
    EmitterEvent,
    Failed,
    LogprobEntry,
    PromptLogprobs,
    Usage,
)
from sluiceway.surfaces.openai.chat_wire import (
    AssistantMessageWire,
    ChatChoiceWire,
    ChatChunk,
    ChatCompletion,
    ChoiceLogprobsWire,
    ChunkChoiceWire,
    DeltaWire,
    FunctionWire,
    ReasoningField,
    ToolCallDeltaWire,
    ToolCallMessageWire,
)
from sluiceway.surfaces.openai.encoding import (
    DONE,
    KEEPALIVE,
    EntryJson,
    entries_wire,
    finish_reason,
    ids_json,
    prompt_entries_wire,
    tool_call_id,
    usage_wire,
)
from sluiceway.surfaces.openai.errors import error_frame
from sluiceway.surfaces.openai.wire import TokenLogprobWire, UsageWire
from sluiceway.surfaces.sse import json_string, sse


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatReplyConfig:
    completion_id: str
    created: int
    model: str
    n: int
    logprobs: bool
    prompt_logprobs: int | None = None
    include_usage: bool = False
    reasoning_field: ReasoningField = "reasoning_content"
    #: Logprob tokens as ``token_id:N``.
    tokens_as_ids: bool = False
    #: ``return_token_ids``: the prompt's ids (None: ids were not asked for).
    prompt_token_ids: tuple[int, ...] | None = None
    #: How many leading prompt ids were the client's own (None: it sent none).
    reused_prompt_tokens: int | None = None


def _reasoning_fields(text: str | None, field_name: ReasoningField) -> dict[str, str | None]:
    if field_name == "both":
        return {"reasoning_content": text, "reasoning": text}
    return {field_name: text}


def _logprobs_wire(logprobs: ChoiceLogprobs, as_ids: bool) -> ChoiceLogprobsWire:
    wire = ChoiceLogprobsWire(content=entries_wire(logprobs.content, as_ids), refusal=None)
    if logprobs.reasoning:
        wire.reasoning_content = entries_wire(logprobs.reasoning, as_ids)
    if logprobs.tool_calls:
        wire.tool_calls = entries_wire(logprobs.tool_calls, as_ids)
    return wire


def _delta_wire(delta: ChoiceDelta, reasoning_field: ReasoningField) -> DeltaWire:
    fields: dict[str, object] = {}
    if delta.reasoning:
        fields |= _reasoning_fields(delta.reasoning, reasoning_field)
    if delta.content:
        fields["content"] = delta.content
    if delta.tool_calls:
        fields["tool_calls"] = [
            ToolCallDeltaWire(
                index=call.index,
                id=call.call_id or tool_call_id(),
                type="function",
                function=FunctionWire(name=call.name, arguments=call.arguments),
            )
            if call.name is not None
            else ToolCallDeltaWire(
                index=call.index, function=FunctionWire(arguments=call.arguments)
            )
            for call in delta.tool_calls
        ]
    return DeltaWire.model_validate(fields)


class ChatStreamEncoder:
    """Events of one request -> ``chat.completion.chunk`` SSE frames."""

    def __init__(self, config: ChatReplyConfig) -> None:
        self._config = config
        self._with_ids = config.prompt_token_ids is not None
        self._prompt_logprobs: list[TokenLogprobWire | None] | None = None
        # The frame of a text delta, around its index, text, logprobs and
        # ids: most frames of a stream are these, and a template is several
        # times cheaper than building and dumping the models.
        bare = self._chunk([self._choice(0, DeltaWire())])
        head, _, tail = bare.partition(b'{"index":0,"delta":{}')
        before, marker, after = tail.partition(b'"token_ids":[')
        self._head, self._tail, self._ids_tail = head + b'{"index":', before + marker, after
        no_logprobs = b',"logprobs":null'
        assert self._tail.startswith(no_logprobs), "the template's logprobs follow its delta"
        self._after_logprobs = self._tail[len(no_logprobs) :]
        self._entries = EntryJson(config.tokens_as_ids)

    def _choice(self, index: int, delta: DeltaWire, ids: tuple[int, ...] = ()) -> ChunkChoiceWire:
        choice = ChunkChoiceWire(index=index, delta=delta, logprobs=None, finish_reason=None)
        if self._with_ids:
            choice.token_ids = list(ids)
        return choice

    def _chunk(
        self,
        choices: list[ChunkChoiceWire],
        usage: UsageWire | None = None,
        prompt_ids: tuple[int, ...] | None = None,
        *,
        opening: bool = False,
    ) -> bytes:
        chunk = ChatChunk(
            id=self._config.completion_id,
            created=self._config.created,
            model=self._config.model,
            choices=choices,
        )
        if self._config.include_usage:
            chunk.usage = usage
        if self._prompt_logprobs is not None and choices:
            chunk.prompt_logprobs, self._prompt_logprobs = self._prompt_logprobs, None
        if prompt_ids is not None:
            chunk.prompt_token_ids = list(prompt_ids)
        if opening and self._config.reused_prompt_tokens is not None:
            chunk.reused_prompt_tokens = self._config.reused_prompt_tokens
        return sse(chunk.to_json())

    def start(self) -> bytes:
        opening = DeltaWire(role="assistant", content="", refusal=None)
        return b"".join(
            self._chunk(
                [self._choice(index, opening)],
                prompt_ids=self._config.prompt_token_ids,
                opening=True,
            )
            for index in range(self._config.n)
        )

    def keepalive(self) -> bytes:
        return KEEPALIVE

    def encode(self, event: EmitterEvent) -> bytes:
        if isinstance(event, Deltas):
            deltas = event.deltas
            if len(deltas) == 1:  # one choice's token: most frames of a stream
                return self._delta_frame(deltas[0])
            return b"".join([self._delta_frame(delta) for delta in deltas])
        if isinstance(event, Completed):
            tail = b""
            if self._config.include_usage:
                tail = self._chunk([], usage_wire(event.usage))
            return tail + DONE
        if isinstance(event, Failed):
            return error_frame(event.message) + DONE
        if isinstance(event, PromptLogprobs) and self._config.prompt_logprobs is not None:
            # Travels on the next chunk that carries a choice.
            self._prompt_logprobs = prompt_entries_wire(
                event.entries, self._config.prompt_logprobs, self._config.tokens_as_ids
            )
        return b""

    def _delta_frame(self, delta: ChoiceDelta) -> bytes:
        fast = self._text_frame(delta)
        if fast is not None:
            return fast
        config = self._config
        logprobs = delta.logprobs
        choice = self._choice(
            delta.index, _delta_wire(delta, config.reasoning_field), delta.token_ids
        )
        if logprobs is not None:
            choice.logprobs = _logprobs_wire(logprobs, config.tokens_as_ids)
        choice.finish_reason = finish_reason(delta)
        if delta.finish is not None:
            choice.matched_stop = delta.matched_stop
        return self._chunk([choice])

    def _text_frame(self, delta: ChoiceDelta) -> bytes | None:
        """The frame of a delta that carries only text (and its tokens'
        logprobs and ids), from the template."""
        if (
            delta.tool_calls
            or delta.finish is not None
            or self._prompt_logprobs is not None
            or bool(delta.content) == bool(delta.reasoning)
        ):
            return None
        if delta.content:
            fields = b'"content":' + json_string(delta.content)
        else:
            text = json_string(delta.reasoning)
            names = _reasoning_fields(None, self._config.reasoning_field)
            fields = b",".join(b'"' + name.encode() + b'":' + text for name in names)
        frame = self._head + str(delta.index).encode() + b',"delta":{' + fields + b"}"
        if delta.logprobs is None:
            frame += self._tail
        else:
            frame += b',"logprobs":' + self._logprobs_json(delta.logprobs) + self._after_logprobs
        if self._with_ids:
            frame += ids_json(delta.token_ids) + self._ids_tail
        return frame

    def _logprobs_json(self, logprobs: ChoiceLogprobs) -> bytes:
        """What ``_logprobs_wire(logprobs).to_json()`` gives."""
        text = b'{"content":' + self._entries.array(logprobs.content) + b',"refusal":null'
        if logprobs.reasoning:
            text += b',"reasoning_content":' + self._entries.array(logprobs.reasoning)
        if logprobs.tool_calls:
            text += b',"tool_calls":' + self._entries.array(logprobs.tool_calls)
        return text + b"}"


@dataclass(slots=True)
class _ToolCall:
    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _ChoiceTotals:
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, _ToolCall] = field(default_factory=dict)
    content_entries: list[LogprobEntry] = field(default_factory=list)
    reasoning_entries: list[LogprobEntry] = field(default_factory=list)
    tool_entries: list[LogprobEntry] = field(default_factory=list)
    finish_reason: str = "stop"
    matched_stop: str | int | None = None
    token_ids: list[int] = field(default_factory=list)

    def add(self, delta: ChoiceDelta) -> None:
        self.token_ids += delta.token_ids
        self.content.append(delta.content)
        self.reasoning.append(delta.reasoning)
        for fragment in delta.tool_calls:
            call = self.tool_calls.setdefault(fragment.index, _ToolCall())
            if fragment.name is not None:
                call.name, call.id = fragment.name, fragment.call_id or tool_call_id()
            call.arguments.append(fragment.arguments)
        if delta.logprobs is not None:
            self.content_entries += delta.logprobs.content
            self.reasoning_entries += delta.logprobs.reasoning
            self.tool_entries += delta.logprobs.tool_calls
        reason = finish_reason(delta)
        if reason is not None:
            self.finish_reason = reason
            self.matched_stop = delta.matched_stop


class ChatAccumulator:
    """Events of one request -> one ``chat.completion`` (non-streaming)."""

    def __init__(self, config: ChatReplyConfig) -> None:
        self._config = config
        self._choices = [_ChoiceTotals() for _ in range(config.n)]
        self.usage: Usage | None = None
        self.failure: str | None = None
        self.prompt_logprobs: PromptLogprobs | None = None

    def add(self, event: EmitterEvent) -> None:
        if isinstance(event, Deltas):
            for delta in event.deltas:
                self._choices[delta.index].add(delta)
        elif isinstance(event, Completed):
            self.usage = event.usage
        elif isinstance(event, Failed):
            self.failure = event.message
        elif isinstance(event, PromptLogprobs):
            self.prompt_logprobs = event

    def to_json(self) -> str:
        return self.build().to_json()

    def build(self) -> ChatCompletion:
        assert self.usage is not None, "build() before the request completed"
        completion = ChatCompletion(
            id=self._config.completion_id,
            created=self._config.created,
            model=self._config.model,
            choices=[self._choice(i, totals) for i, totals in enumerate(self._choices)],
            usage=usage_wire(self.usage),
        )
        if self._config.prompt_logprobs is not None and self.prompt_logprobs is not None:
            completion.prompt_logprobs = prompt_entries_wire(
                self.prompt_logprobs.entries,
                self._config.prompt_logprobs,
                self._config.tokens_as_ids,
            )
        if self._config.prompt_token_ids is not None:
            completion.prompt_token_ids = list(self._config.prompt_token_ids)
        if self._config.reused_prompt_tokens is not None:
            completion.reused_prompt_tokens = self._config.reused_prompt_tokens
        return completion

    def _choice(self, index: int, totals: _ChoiceTotals) -> ChatChoiceWire:
        calls = [
            ToolCallMessageWire(
                id=call.id, function=FunctionWire(name=call.name, arguments="".join(call.arguments))
            )
            for _, call in sorted(totals.tool_calls.items())
        ]
        text = "".join(totals.content)
        message = AssistantMessageWire(
            content=text if text or not calls else None,
            refusal=None,
        )
        reasoning = "".join(totals.reasoning)
        if reasoning:
            for key, value in _reasoning_fields(reasoning, self._config.reasoning_field).items():
                setattr(message, key, value)
        if calls:
            message.tool_calls = calls
        logprobs = None
        if self._config.logprobs:
            logprobs = _logprobs_wire(
                ChoiceLogprobs(
                    content=tuple(totals.content_entries),
                    reasoning=tuple(totals.reasoning_entries),
                    tool_calls=tuple(totals.tool_entries),
                ),
                self._config.tokens_as_ids,
            )
        choice = ChatChoiceWire(
            index=index,
            message=message,
            logprobs=logprobs,
            finish_reason=totals.finish_reason,
            matched_stop=totals.matched_stop,
        )
        if self._config.prompt_token_ids is not None:
            choice.token_ids = totals.token_ids
        return choice
