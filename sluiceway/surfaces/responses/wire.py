"""Wire models of a ``POST /v1/responses`` request (stateless).

Top-level fields are checked strictly (an unknown one is a 400, as OpenAI
answers); the items and tools inside are lenient, because clients replay
items from earlier replies with every field they got (``id``, ``status``,
``annotations``, ``logprobs``, ...) and send tool fields this server has no
use for.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import (
    Discriminator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    Tag,
    model_validator,
)

from sluiceway.surfaces.wire import LenientModel, StrictModel

#: Tools that OpenAI runs on its side, or that need a client protocol this
#: server does not speak (``shell_call``, ``apply_patch_call`` items).
HostedType = Literal[
    "web_search",
    "web_search_2025_08_26",
    "web_search_preview",
    "web_search_preview_2025_03_11",
    "file_search",
    "code_interpreter",
    "computer",
    "computer_use_preview",
    "image_generation",
    "mcp",
    "tool_search",
    "local_shell",
    "shell",
    "apply_patch",
]
#: Accepted in ``tools`` and not offered to the model.
HOSTED_TOOL_TYPES: tuple[str, ...] = get_args(HostedType)

#: ``include`` values: logprobs are produced; encrypted reasoning comes back
#: as null (nothing is encrypted here); the rest concern hosted tools, whose
#: calls never appear.
IncludeValue = Literal[
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
]

# --- input items -------------------------------------------------------------


class InputText(LenientModel):
    type: Literal["input_text", "output_text", "text"]
    text: str


class Refusal(LenientModel):
    type: Literal["refusal"]
    refusal: str


class MediaPart(LenientModel):
    """An image, file or audio part: refused (the models served here read text)."""

    type: Literal["input_image", "input_file", "input_audio"]


ContentPart = Annotated[InputText | Refusal | MediaPart, Field(discriminator="type")]


def _text_or_list(value: Any) -> str:
    return "text" if isinstance(value, str) else "list"


#: A string, or a list of parts (errors name the part, not both shapes).
Content = Annotated[
    Annotated[str, Tag("text")] | Annotated[list[ContentPart], Tag("list")],
    Discriminator(_text_or_list),
]


def _text_of(parts: str | list[ContentPart]) -> str | None:
    """The text of a content list; None when it holds a media part."""
    if isinstance(parts, str):
        return parts
    texts = []
    for part in parts:
        if isinstance(part, MediaPart):
            return None
        texts.append(part.text if isinstance(part, InputText) else part.refusal)
    return "".join(texts)


class TurnIdsFields(LenientModel):
    """Extension (issue K): the ids of the reply an assistant turn's items
    came from (as ``return_token_ids`` puts them on its last output item),
    so the next prompt starts with them exactly."""

    prompt_token_ids: list[StrictInt] | None = None
    generation_token_ids: list[StrictInt] | None = None


class MessageItem(TurnIdsFields):
    """A message; ``type`` may be left out (OpenAI's "easy" input message)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Content

    def text(self) -> str | None:
        return _text_of(self.content)


class FunctionCallItem(TurnIdsFields):
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: str
    namespace: str | None = None


class CustomToolCallItem(TurnIdsFields):
    type: Literal["custom_tool_call"]
    call_id: StrictStr
    name: StrictStr
    input: str
    namespace: str | None = None


class CallOutputItem(TurnIdsFields):
    """The result of a function or custom tool call, as text or text parts."""

    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: StrictStr
    output: Content

    def text(self) -> str | None:
        return _text_of(self.output)


class ReasoningText(LenientModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(TurnIdsFields):
    """Reasoning passed back: its text parts (``content``, else the summary)."""

    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    encrypted_content: str | None = None

    def text(self) -> str:
        parts = self.content if self.content else self.summary
        return "\n\n".join(part.text for part in parts)


class ItemReference(LenientModel):
    """A reference to a stored item: refused (nothing is stored)."""

    type: Literal["item_reference"]
    id: str


def _item_tag(value: Any) -> str | None:
    if isinstance(value, dict):
        return str(value.get("type", "message"))
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[CustomToolCallItem, Tag("custom_tool_call")]
    | Annotated[CallOutputItem, Tag("function_call_output")]
    | Annotated[CallOutputItem, Tag("custom_tool_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[ItemReference, Tag("item_reference")],
    Discriminator(_item_tag),
]

# --- tools ---------------------------------------------------------------------


class FunctionTool(LenientModel):
    type: Literal["function"]
    name: Annotated[StrictStr, Field(min_length=1, max_length=128)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class CustomFormat(LenientModel):
    """A custom tool's input format: free text, or a grammar (``lark`` or
    ``regex``) that is shown to the model, not enforced."""

    type: Literal["text", "grammar"]
    syntax: str | None = None
    definition: str | None = None


class CustomTool(LenientModel):
    type: Literal["custom"]
    name: Annotated[StrictStr, Field(min_length=1, max_length=128)]
    description: str | None = None
    format: CustomFormat | None = None


MemberTool = Annotated[FunctionTool | CustomTool, Field(discriminator="type")]


class NamespaceTool(LenientModel):
    type: Literal["namespace"]
    name: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    description: str | None = None
    tools: list[MemberTool]


class HostedTool(LenientModel):
    type: HostedType


Tool = Annotated[
    FunctionTool | CustomTool | NamespaceTool | HostedTool, Field(discriminator="type")
]


class NamedChoice(LenientModel):
    """``{"type": "function" | "custom", "name"}``: this tool must be called."""

    type: Literal["function", "custom"]
    name: StrictStr


class AllowedTool(LenientModel):
    type: str
    name: str | None = None


class AllowedToolsChoice(LenientModel):
    """Only these tools, in ``mode`` (``auto`` or ``required``)."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[AllowedTool]


class HostedChoice(LenientModel):
    """A hosted tool named as the tool to call: refused (it is not offered)."""

    type: HostedType


ToolChoiceObject = Annotated[
    NamedChoice | AllowedToolsChoice | HostedChoice, Field(discriminator="type")
]

# --- settings -----------------------------------------------------------------

Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class ReasoningConfig(LenientModel):
    effort: Effort | None = None
    summary: Literal["auto", "concise", "detailed", "none"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class TextFormat(LenientModel):
    """``text.format``: free text, any JSON object, or JSON that matches
    ``schema`` (``name``, ``description`` and ``strict`` are echoed; the
    schema is always enforced)."""

    type: Literal["text", "json_schema", "json_object"]
    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and (self.schema_ is None or not self.name):
            raise ValueError("a json_schema format needs a name and a schema")
        return self


class TextConfig(LenientModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class StreamOptions(StrictModel):
    include_obfuscation: StrictBool | None = None


class ResponsesRequest(StrictModel):
    model: StrictStr
    input: Annotated[
        Annotated[StrictStr, Tag("text")]
        | Annotated[list[InputItem], Field(min_length=1), Tag("list")],
        Discriminator(_text_or_list),
    ]
    instructions: StrictStr | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceObject | None = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[StrictFloat, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[StrictFloat, Field(ge=0.0, le=1.0)] | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    include: list[IncludeValue] | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    truncation: Literal["disabled", "auto"] | None = None
    # Stateful features, refused with a 400 that says why.
    previous_response_id: StrictStr | None = None
    conversation: StrictStr | dict[str, Any] | None = None
    background: StrictBool | None = None
    prompt: dict[str, Any] | None = None
    # Accepted and echoed; they do not change generation here.
    store: StrictBool | None = None
    metadata: dict[str, str] | None = None
    user: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    prompt_cache_retention: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    service_tier: StrictStr | None = None
    max_tool_calls: Annotated[StrictInt, Field(ge=1)] | None = None
    client_metadata: dict[str, Any] | None = None
    # Extension (vLLM's): variables for the chat template.
    chat_template_kwargs: dict[str, Any] | None = None
    # Extension (as on chat): the prompt's and the reply's token ids, on the
    # reply's last output item (issue K).
    return_token_ids: StrictBool = False

    @property
    def wants_logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or ())
