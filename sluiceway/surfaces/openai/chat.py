"""``POST /v1/chat/completions``: the request onto the neutral conversation
and generation request, the reply through the chat encoder."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Literal, Protocol

from sluiceway.parsers.registry import build_pipeline
from sluiceway.protocol.errors import InvalidRequest
from sluiceway.protocol.messages import GenerationRequest
from sluiceway.surfaces import structured, validation
from sluiceway.surfaces.base import Call, Job, Serving, new_id, send_whole
from sluiceway.surfaces.conversation import (
    Conversation,
    Message,
    Role,
    StopOptions,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
    ToolSpec,
    TurnIds,
    turn_ids,
)
from sluiceway.surfaces.openai import fields
from sluiceway.surfaces.openai.chat_encoder import (
    ChatAccumulator,
    ChatReplyConfig,
    ChatStreamEncoder,
)
from sluiceway.surfaces.openai.chat_wire import (
    ChatMessage,
    ChatRequest,
    NamedToolChoice,
    ResponseFormat,
)
from sluiceway.surfaces.openai.chat_wire import ToolSpec as ToolSpecWire
from sluiceway.surfaces.openai.fields import OpenAIOptions
from sluiceway.surfaces.reasoning import reasoning_level

_ROLES = {
    "system": Role.SYSTEM,
    "developer": Role.SYSTEM,
    "user": Role.USER,
    "assistant": Role.ASSISTANT,
    "tool": Role.TOOL,
}

_TOOL_CHOICES = {
    "none": ToolChoiceMode.NONE,
    "auto": ToolChoiceMode.AUTO,
    "required": ToolChoiceMode.REQUIRED,
}

_LIMIT_NAMES = validation.LimitParamNames(prompt="messages", max_tokens="max_completion_tokens")
_LOGPROB_NAMES = validation.LogprobParamNames(top="top_logprobs")


def _message(message: ChatMessage) -> Message:
    return Message(
        role=_ROLES[message.role],
        text=message.text(),
        reasoning=message.reasoning_content or message.reasoning or "",
        tool_calls=tuple(
            ToolCall(id=call.id, name=call.function.name, arguments=call.function.arguments)
            for call in message.tool_calls or ()
        ),
        tool_call_id=message.tool_call_id,
        name=message.name,
        ids=_ids(message),
    )


def _ids(message: ChatMessage) -> TurnIds | None:
    generation = message.generation_token_ids
    if generation is None:
        generation = message.token_ids
    return turn_ids(message.prompt_token_ids, generation)


class ConversationFields(Protocol):
    """The fields of a request that make a conversation (a chat request's,
    and the messages form of ``/tokenize``)."""

    @property
    def messages(self) -> list[ChatMessage]: ...

    @property
    def tools(self) -> list[ToolSpecWire] | None: ...

    @property
    def tool_choice(self) -> Literal["none", "auto", "required"] | NamedToolChoice | None: ...

    @property
    def parallel_tool_calls(self) -> bool: ...

    @property
    def chat_template_kwargs(self) -> dict[str, Any] | None: ...


def conversation_of(request: ConversationFields) -> Conversation:
    """The request's messages, tools and tool choice in neutral terms."""
    choice = request.tool_choice
    tool_choice = None
    if isinstance(choice, NamedToolChoice):
        tool_choice = ToolChoice(mode=ToolChoiceMode.NAMED, name=choice.function.name)
    elif choice is not None:
        tool_choice = ToolChoice(mode=_TOOL_CHOICES[choice])
    return Conversation(
        messages=tuple(_message(message) for message in request.messages),
        tools=tuple(
            ToolSpec(
                name=tool.function.name,
                description=tool.function.description,
                parameters=tool.function.parameters,
                strict=tool.function.strict,
            )
            for tool in request.tools or ()
        ),
        tool_choice=tool_choice,
        parallel_tool_calls=request.parallel_tool_calls,
        template_kwargs=request.chat_template_kwargs,
    )


def _check(serving: Serving, request: ChatRequest) -> None:
    fields.check(request, serving)
    if request.top_logprobs is not None and not request.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")


def response_format(response: ResponseFormat | None) -> structured.OutputFormat | None:
    """``response_format`` as a format (None: free text)."""
    if response is None or response.type == "text":
        return None
    if response.json_schema is None:
        return structured.json_object_format(param="response_format")
    schema = response.json_schema.schema_
    return structured.json_schema_format(
        {} if schema is None else schema, param="response_format.json_schema.schema"
    )


def output_format(request: ChatRequest) -> structured.OutputFormat | None:
    return structured.single_format(
        response_format(request.response_format),
        structured.structured_outputs(request.structured_outputs),
    )


async def handle(options: OpenAIOptions, serving: Serving, call: Call) -> None:
    request = validation.parse_request(ChatRequest, validation.parse_json(await call.body()))
    _check(serving, request)
    stops = StopOptions(
        stop=fields.stop_strings(request.stop),
        include_stop_str_in_output=request.include_stop_str_in_output,
        min_tokens=request.min_tokens,
    )
    prompt = await structured.constrained_prompt(
        serving,
        replace(conversation_of(request), effort=reasoning_level(request.reasoning_effort)),
        stops,
        output_format(request),
    )
    per_token = request.logprobs or bool(request.logprob_token_ids)
    logprobs = validation.logprob_params(
        top=(request.top_logprobs or 0) if per_token else None,
        token_ids=request.logprob_token_ids,
        prompt_top=request.prompt_logprobs,
        vocab_size=serving.vocab_size,
        max_top=serving.max_top_logprobs,
        names=_LOGPROB_NAMES,
    )
    generation = GenerationRequest(
        request_id=new_id("chatcmpl"),
        prompt_ids=prompt.ids,
        n=request.n,
        sampling=fields.sampling_params(request, serving.vocab_size),
        logprobs=logprobs,
        limits=fields.limits(
            request,
            serving,
            requested_max=request.max_completion_tokens or request.max_tokens,
            names=_LIMIT_NAMES,
            prompt_tokens=len(prompt.ids),
        ),
        constraint=prompt.constraint,
    )
    table = serving.tokenizer.table
    text_path = prompt.options
    config = fields.output_config(
        serving, generation, request, make_pipeline=lambda: build_pipeline(table, text_path)
    )
    reply = ChatReplyConfig(
        completion_id=generation.request_id,
        created=int(time.time()),
        model=serving.model_name,
        n=request.n,
        logprobs=per_token,
        prompt_logprobs=request.prompt_logprobs,
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        reasoning_field=options.reasoning_field,
        tokens_as_ids=fields.tokens_as_ids(options, request),
        prompt_token_ids=prompt.ids if request.return_token_ids else None,
        reused_prompt_tokens=prompt.reused,
    )
    jobs = [Job(generation, config)]
    if request.stream:
        await call.stream(jobs, ChatStreamEncoder(reply))
    else:
        await send_whole(call, jobs, ChatAccumulator(reply))
