"""Wire models of a Responses reply: the ``response`` object, its output
items, and the streamed events (each with its ``type`` and a
``sequence_number``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from sluiceway.surfaces.wire import WireModel

ItemStatus = Literal["in_progress", "completed", "incomplete"]
ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]


class TopLogprobWire(WireModel):
    token: str
    logprob: float
    bytes: list[int]


class LogprobWire(WireModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprobWire]


class OutputTextPart(WireModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[LogprobWire] = Field(default_factory=list)


class ReasoningTextPart(WireModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class TurnIdsWire(WireModel):
    """Extension (``return_token_ids``, on a reply's last output item): the
    prompt's ids and the whole turn's generated ids, which the item carries
    back in the next request's ``input`` (issue K)."""

    prompt_token_ids: list[int] | None = None
    generation_token_ids: list[int] | None = None


class MessageWire(TurnIdsWire):
    id: str
    type: Literal["message"] = "message"
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputTextPart]


class ReasoningWire(TurnIdsWire):
    id: str
    type: Literal["reasoning"] = "reasoning"
    status: ItemStatus
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningTextPart] | None = None
    encrypted_content: str | None = None


class FunctionCallWire(TurnIdsWire):
    id: str
    type: Literal["function_call"] = "function_call"
    status: ItemStatus
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None


class CustomToolCallWire(TurnIdsWire):
    id: str
    type: Literal["custom_tool_call"] = "custom_tool_call"
    status: ItemStatus
    call_id: str
    name: str
    input: str
    namespace: str | None = None


OutputItemWire = MessageWire | ReasoningWire | FunctionCallWire | CustomToolCallWire


class InputTokensDetails(WireModel):
    cached_tokens: int = 0
    #: Always 0: the prefix cache keeps what fits its budget and does not say
    #: what it kept of a given prompt.
    cache_write_tokens: int = 0


class OutputTokensDetails(WireModel):
    reasoning_tokens: int = 0


class UsageWire(WireModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseErrorWire(WireModel):
    code: str
    message: str


class IncompleteDetails(WireModel):
    reason: Literal["max_output_tokens"]


class ResponseWire(WireModel):
    """The ``response`` object; the request's settings are echoed as given
    (the effective value where the request left one out)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    completed_at: int | None = None
    error: ResponseErrorWire | None
    incomplete_details: IncompleteDetails | None
    model: str
    output: list[OutputItemWire]
    usage: UsageWire | None
    instructions: str | None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    max_output_tokens: int | None
    top_logprobs: int | None = None
    previous_response_id: None
    reasoning: dict[str, Any]
    text: dict[str, Any]
    truncation: Literal["disabled"] = "disabled"
    metadata: dict[str, str]
    store: bool
    background: bool = False
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: str = "default"
    max_tool_calls: int | None = None
    #: Extension (issue K): how many leading prompt ids were the client's own
    #: (an assistant turn's ``prompt_token_ids`` + ``generation_token_ids``).
    reused_prompt_tokens: int | None = None


# --- streamed events -------------------------------------------------------------


class LifecycleEvent(WireModel):
    """``response.created`` / ``in_progress`` / ``completed`` / ``incomplete`` / ``failed``."""

    type: str
    sequence_number: int
    response: ResponseWire


class OutputItemEvent(WireModel):
    """``response.output_item.added`` / ``done``."""

    type: str
    sequence_number: int
    output_index: int
    item: OutputItemWire


class PartEvent(WireModel):
    """``response.content_part.added`` / ``done``."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputTextPart


class TextDeltaEvent(WireModel):
    """``response.output_text.delta``; ``reasoning_text.delta`` has no logprobs."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[LogprobWire] | None = None


class TextDoneEvent(WireModel):
    """``response.output_text.done`` / ``reasoning_text.done``."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[LogprobWire] | None = None


class CallDeltaEvent(WireModel):
    """``response.function_call_arguments.delta`` / ``custom_tool_call_input.delta``."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(WireModel):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str


class CustomInputDoneEvent(WireModel):
    type: Literal["response.custom_tool_call_input.done"] = "response.custom_tool_call_input.done"
    sequence_number: int
    item_id: str
    output_index: int
    input: str
