"""Wire models of the Messages API: the requests of ``/v1/messages`` and
``/v1/messages/count_tokens``, and the reply, stream-event, error and model
shapes, written from Anthropic's published API reference.

Requests are lenient about keys they do not name, at the top level as in
every block: Claude Code sends new fields with each release behind an
``anthropic-beta`` value, and the SDKs echo reply blocks back with keys of
their own (``citations``, ``caller``). What each field does here is in
docs/api.md.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr

from sluiceway.surfaces.wire import LenientModel, WireModel

# --- request content blocks --------------------------------------------------


class TextBlock(LenientModel):
    type: Literal["text"]
    text: StrictStr


class ImageBlock(LenientModel):
    """Named only to be refused by name: the served models read text."""

    type: Literal["image"]


class DocumentBlock(LenientModel):
    type: Literal["document"]


class ToolUseBlock(LenientModel):
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any]


ToolResultPart = Annotated[TextBlock | ImageBlock | DocumentBlock, Field(discriminator="type")]


class ToolResultBlock(LenientModel):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: StrictStr | list[ToolResultPart] | None = None
    is_error: StrictBool = False


class ThinkingBlock(LenientModel):
    type: Literal["thinking"]
    thinking: StrictStr
    #: Accepted and ignored (there is nothing to verify it against).
    signature: StrictStr | None = None


class RedactedThinkingBlock(LenientModel):
    type: Literal["redacted_thinking"]
    data: StrictStr = ""


ContentBlock = Annotated[
    TextBlock
    | ImageBlock
    | DocumentBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class MessageParam(LenientModel):
    #: ``system`` inside the conversation: Anthropic's mid-conversation
    #: system messages (the ``mid-conversation-system`` beta).
    role: Literal["user", "assistant", "system"]
    content: StrictStr | list[ContentBlock]
    #: Extension (issue K): the ids of the reply an assistant message came
    #: from (the reply's own ``prompt_token_ids`` / ``generation_token_ids``
    #: with ``return_token_ids``), so the next prompt starts with them exactly.
    prompt_token_ids: list[StrictInt] | None = None
    generation_token_ids: list[StrictInt] | None = None


# --- tools and options ---------------------------------------------------------


class ToolParam(LenientModel):
    name: Annotated[StrictStr, Field(min_length=1, max_length=128)]
    description: StrictStr | None = None
    input_schema: dict[str, Any] | None = None
    #: ``custom`` (or absent) for a client tool; anything else is a server tool.
    type: StrictStr | None = None
    strict: StrictBool | None = None


class ToolChoiceAuto(LenientModel):
    type: Literal["auto"]
    disable_parallel_tool_use: StrictBool = False


class ToolChoiceAny(LenientModel):
    type: Literal["any"]
    disable_parallel_tool_use: StrictBool = False


class ToolChoiceTool(LenientModel):
    type: Literal["tool"]
    name: StrictStr
    disable_parallel_tool_use: StrictBool = False


class ToolChoiceNone(LenientModel):
    type: Literal["none"]
    disable_parallel_tool_use: StrictBool = False


ToolChoiceParam = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone,
    Field(discriminator="type"),
]


class ThinkingEnabled(LenientModel):
    type: Literal["enabled"]
    #: Accepted and ignored: the template's switch is on or off.
    budget_tokens: Annotated[StrictInt, Field(ge=0)]


class ThinkingAdaptive(LenientModel):
    type: Literal["adaptive"]


class ThinkingBetweenTools(LenientModel):
    type: Literal["between_tools"]


class ThinkingDisabled(LenientModel):
    type: Literal["disabled"]


ThinkingParam = Annotated[
    ThinkingEnabled | ThinkingAdaptive | ThinkingBetweenTools | ThinkingDisabled,
    Field(discriminator="type"),
]

EffortLevel = Literal["low", "medium", "high", "xhigh", "max"]


class OutputConfig(LenientModel):
    effort: EffortLevel | None = None
    #: A JSON schema for the output: refused until constrained decoding exists.
    format: dict[str, Any] | None = None


class ThinkingTurns(LenientModel):
    type: Literal["thinking_turns"]
    value: Annotated[StrictInt, Field(ge=0)]


class ContextEdit(LenientModel):
    """One edit of ``context_management``; only ``clear_thinking_*`` edits
    change the prompt, the others are accepted and ignored."""

    type: StrictStr
    keep: Literal["all"] | ThinkingTurns | dict[str, Any] | None = None


class ContextManagement(LenientModel):
    edits: list[ContextEdit] = Field(default_factory=list)


class Metadata(LenientModel):
    #: Claude Code sends a JSON document as a string here.
    user_id: StrictStr | None = None


class ConversationFields(LenientModel):
    """What ``/v1/messages`` and ``/v1/messages/count_tokens`` share."""

    model: StrictStr
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    system: StrictStr | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    output_config: OutputConfig | None = None
    context_management: ContextManagement | None = None
    #: Extension (as on chat completions): chat template variables.
    chat_template_kwargs: dict[str, Any] | None = None


class MessagesRequest(ConversationFields):
    max_tokens: Annotated[StrictInt, Field(ge=1)]
    stop_sequences: list[StrictStr] | None = None
    stream: StrictBool = False
    temperature: Annotated[StrictFloat, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[StrictFloat, Field(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None
    metadata: Metadata | None = None
    service_tier: StrictStr | None = None
    #: Extension (as on chat): the prompt's and the reply's token ids.
    return_token_ids: StrictBool = False


class CountTokensRequest(ConversationFields):
    pass


# --- replies ---------------------------------------------------------------------


class TextBlockWire(WireModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlockWire(WireModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    #: Always empty: nothing here signs the thinking.
    signature: str = ""


class ToolUseBlockWire(WireModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


BlockWire = TextBlockWire | ThinkingBlockWire | ToolUseBlockWire

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class UsageWire(WireModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageWire(WireModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[BlockWire]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: UsageWire
    #: Extensions (issue K): ``return_token_ids``'s prompt and generated ids
    #: (streamed: the prompt's in ``message_start``, the generated ones in
    #: ``message_delta``'s ``delta``), and how many leading prompt ids were
    #: an assistant message's own.
    prompt_token_ids: list[int] | None = None
    generation_token_ids: list[int] | None = None
    reused_prompt_tokens: int | None = None


class MessageStartEvent(WireModel):
    type: Literal["message_start"] = "message_start"
    message: MessageWire


class ContentBlockStartEvent(WireModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: BlockWire


class TextDelta(WireModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDelta(WireModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class InputJsonDelta(WireModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class SignatureDelta(WireModel):
    type: Literal["signature_delta"] = "signature_delta"
    signature: str


class ContentBlockDeltaEvent(WireModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | ThinkingDelta | InputJsonDelta | SignatureDelta


class ContentBlockStopEvent(WireModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class StopDelta(WireModel):
    stop_reason: StopReason
    stop_sequence: str | None
    #: Extension (``return_token_ids``): the reply's generated ids.
    generation_token_ids: list[int] | None = None


class MessageDeltaEvent(WireModel):
    type: Literal["message_delta"] = "message_delta"
    delta: StopDelta
    usage: UsageWire


class MessageStopEvent(WireModel):
    type: Literal["message_stop"] = "message_stop"


class PingEvent(WireModel):
    type: Literal["ping"] = "ping"


class ErrorDetail(WireModel):
    type: str
    message: str


class ErrorBody(WireModel):
    """Both the error body of a refused request and the ``error`` event of a
    stream that failed after it started."""

    type: Literal["error"] = "error"
    error: ErrorDetail


class TokenCount(WireModel):
    input_tokens: int


class ModelInfo(WireModel):
    type: Literal["model"] = "model"
    id: str
    display_name: str
    #: RFC 3339: when the model was loaded.
    created_at: str
    lifecycle: Literal["active"] = "active"
    #: The context length, and so the most ``max_tokens`` can be.
    max_input_tokens: int | None = None
    max_tokens: int | None = None


class ModelListWire(WireModel):
    data: list[ModelInfo]
    first_id: str | None
    last_id: str | None
    has_more: bool = False
