"""Wire models of ``/v1/chat/completions``: the request and both reply shapes."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    model_validator,
)

from sluiceway.surfaces.openai.wire import TokenLogprobWire, UsageWire
from sluiceway.surfaces.structured import StructuredOutputs
from sluiceway.surfaces.wire import LenientModel, StrictModel, WireModel

Probability = Annotated[StrictFloat, Field(ge=0.0, le=1.0)]

#: Which delta/message field(s) carry reasoning text (``--reasoning-field``).
ReasoningField = Literal["reasoning_content", "reasoning", "both"]


class TextPart(LenientModel):
    type: Literal["text"]
    text: str


class FunctionCallWire(LenientModel):
    name: str
    arguments: str


class ToolCallWire(LenientModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallWire


class ChatMessage(LenientModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallWire] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    #: Extensions (issue K): the ids of the reply an assistant message came
    #: from, so the next prompt starts with them exactly. ``token_ids`` (as
    #: ``return_token_ids`` replies name them) is a synonym of
    #: ``generation_token_ids``.
    prompt_token_ids: list[StrictInt] | None = None
    generation_token_ids: list[StrictInt] | None = None
    token_ids: list[StrictInt] | None = None

    @model_validator(mode="after")
    def _content_where_required(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        if (
            self.token_ids is not None
            and self.generation_token_ids is not None
            and self.token_ids != self.generation_token_ids
        ):
            raise ValueError("token_ids and generation_token_ids differ; send one of them")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionSpec(LenientModel):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.:-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(LenientModel):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(LenientModel):
    name: str


class NamedToolChoice(LenientModel):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(StrictModel):
    include_usage: StrictBool = False


class JsonSchemaFormat(StrictModel):
    """``response_format.json_schema``."""

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]
    description: str | None = None
    # ``schema`` would shadow a BaseModel attribute.
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    #: The output is held to the schema whatever this says.
    strict: StrictBool | None = None


class ResponseFormat(LenientModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_where_required(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema goes with type json_schema, and only with it")
        return self


class SamplingFields(StrictModel):
    """Fields shared with ``/v1/completions``."""

    model: StrictStr
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[StrictFloat, Field(ge=0.0, le=2.0)] | None = None
    top_p: Probability | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    min_p: Probability | None = None
    n: Annotated[StrictInt, Field(ge=1, le=128)] = 1
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    presence_penalty: Annotated[StrictFloat, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[StrictFloat, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[StrictFloat, Field(gt=0.0, le=10.0)] | None = None
    logit_bias: dict[str, Annotated[StrictFloat, Field(ge=-100.0, le=100.0)]] | None = None
    user: str | None = None
    # Extensions shared with vLLM and SGLang.
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool = False
    prompt_logprobs: Annotated[StrictInt, Field(ge=0)] | None = None
    logprob_token_ids: list[StrictInt] | None = None
    return_tokens_as_token_ids: StrictBool | None = None
    return_token_ids: StrictBool = False
    structured_outputs: StructuredOutputs | None = None


class ChatRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0)] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Accepted for compatibility; they do not change generation here.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    modalities: list[Literal["text"]] | None = None


# --- replies ---------------------------------------------------------------


class ChoiceLogprobsWire(WireModel):
    content: list[TokenLogprobWire] | None
    refusal: list[TokenLogprobWire] | None
    #: Extensions: entries of reasoning-home and tool-call-home tokens.
    reasoning_content: list[TokenLogprobWire] | None = None
    tool_calls: list[TokenLogprobWire] | None = None


class FunctionWire(WireModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDeltaWire(WireModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionWire | None = None


class DeltaWire(WireModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    refusal: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDeltaWire] | None = None


class ChunkChoiceWire(WireModel):
    index: int
    delta: DeltaWire
    logprobs: ChoiceLogprobsWire | None
    finish_reason: str | None
    #: Extension: the stop string or stop token id that ended the choice.
    matched_stop: str | int | None = None
    #: Extension (``return_token_ids``): the generated ids this chunk carries.
    token_ids: list[int] | None = None


class ChatChunk(WireModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: StrictStr
    system_fingerprint: str | None = None
    choices: list[ChunkChoiceWire]
    usage: UsageWire | None = None
    #: Extension (``prompt_logprobs``): the prompt tokens' entries, the first null.
    prompt_logprobs: list[TokenLogprobWire | None] | None = None
    #: Extension (``return_token_ids``): the prompt's ids, on each choice's first chunk.
    prompt_token_ids: list[int] | None = None
    #: Extension (issue K): how many leading prompt ids were the client's own
    #: (an assistant message's ids), on each choice's first chunk.
    reused_prompt_tokens: int | None = None


class ToolCallMessageWire(WireModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionWire


class AssistantMessageWire(WireModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallMessageWire] | None = None


class ChatChoiceWire(WireModel):
    index: int
    message: AssistantMessageWire
    logprobs: ChoiceLogprobsWire | None
    finish_reason: str
    matched_stop: str | int | None = None
    #: Extension (``return_token_ids``): every generated id, markup included.
    token_ids: list[int] | None = None


class ChatCompletion(WireModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: StrictStr
    system_fingerprint: str | None = None
    choices: list[ChatChoiceWire]
    usage: UsageWire
    #: Extension (``prompt_logprobs``): the prompt tokens' entries, the first null.
    prompt_logprobs: list[TokenLogprobWire | None] | None = None
    #: Extension (``return_token_ids``): the ids of the prompt the model saw.
    prompt_token_ids: list[int] | None = None
    #: Extension (issue K): how many leading prompt ids were the client's own.
    reused_prompt_tokens: int | None = None
