"""``POST /v1/chat/completions``."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import anyio

from sluiceway.actors.emitters.chat import ChatAccumulator, ChatReplyConfig, ChatStreamEncoder
from sluiceway.parsers.registry import (
    TextPathOptions,
    ToolSchema,
    build_pipeline,
    forced_tool_prefix,
)
from sluiceway.protocol.chat import ChatRequest, NamedToolChoice
from sluiceway.protocol.errors import InvalidRequest
from sluiceway.protocol.messages import GenerationRequest
from sluiceway.server import validation
from sluiceway.server.exchange import Job, collect_reply, stream_reply
from sluiceway.server.handlers.common import output_config
from sluiceway.server.http import Receive, Scope, Send, parse_json, read_body, send_json_text
from sluiceway.server.parsing import reasoning_left_open
from sluiceway.server.state import ServerState, new_id


@dataclass(frozen=True, slots=True)
class _Prompt:
    ids: list[int]
    options: TextPathOptions


def _template_messages(request: ChatRequest) -> list[dict[str, Any]]:
    messages = []
    for message in request.messages:
        item: dict[str, Any] = {
            "role": "system" if message.role == "developer" else message.role,
            "content": message.text(),
        }
        if message.name:
            item["name"] = message.name
        if message.tool_calls:
            item["tool_calls"] = [call.model_dump() for call in message.tool_calls]
        if message.tool_call_id:
            item["tool_call_id"] = message.tool_call_id
        reasoning = message.reasoning_content or message.reasoning
        if reasoning:
            item["reasoning_content"] = reasoning
        messages.append(item)
    return messages


def _tool_mode(state: ServerState, request: ChatRequest) -> tuple[bool, str | None]:
    """Whether tool calls are parsed, and the function a call is forced to
    (``""`` for ``required``: any function)."""
    choice = request.tool_choice
    if not request.tools:
        if choice is not None and choice != "none":
            raise InvalidRequest("tool_choice needs tools", param="tool_choice")
        return False, None
    if choice == "none":
        return False, None
    if state.parsers.tools is None:
        raise InvalidRequest(
            "this server has no tool-call parser for this model (start it with --tool-call-parser)",
            param="tools",
        )
    if isinstance(choice, NamedToolChoice):
        names = {tool.function.name for tool in request.tools}
        if choice.function.name not in names:
            raise InvalidRequest(
                f"tool_choice names {choice.function.name!r}, which is not among the tools",
                param="tool_choice",
            )
        return True, choice.function.name
    return True, "" if choice == "required" else None


def _render(state: ServerState, request: ChatRequest, stops: tuple[str, ...]) -> _Prompt:
    tokenizer = state.model.tokenizer
    parse_tools, forced = _tool_mode(state, request)
    offered = request.tools if request.tool_choice != "none" else None
    try:
        rendered = tokenizer.render_chat(
            _template_messages(request),
            tools=[tool.model_dump(exclude_none=True) for tool in offered or ()],
            template_kwargs=request.chat_template_kwargs,
        )
    except Exception as error:  # template errors are the conversation's fault
        raise InvalidRequest(
            f"the chat template could not render these messages: {error}", param="messages"
        ) from error
    reasoning = state.parsers.reasoning
    forced_prefix = ""
    if forced is not None and state.parsers.tools is not None:
        # A forced call cannot start inside reasoning: close it first.
        if reasoning_left_open(reasoning, rendered.assistant_prefix):
            forced_prefix = "</think>\n\n"
        forced_prefix += forced_tool_prefix(state.parsers.tools, forced or None)
    options = TextPathOptions(
        reasoning_parser=reasoning,
        tool_parser=state.parsers.tools if parse_tools else None,
        tools=tuple(
            ToolSchema(name=tool.function.name, parameters=tool.function.parameters or {})
            for tool in request.tools or ()
        ),
        parallel_tool_calls=request.parallel_tool_calls,
        stop=stops,
        include_stop_str_in_output=request.include_stop_str_in_output,
        min_tokens=request.min_tokens,
        stop_in_reasoning=state.config.stop_in_reasoning,
        assistant_prefix=rendered.assistant_prefix,
        forced_prefix=forced_prefix,
    )
    return _Prompt(tokenizer.encode(rendered.text + forced_prefix), options)


def _check(state: ServerState, request: ChatRequest) -> None:
    validation.check_model(request.model, state.model_name)
    validation.common_checks(request, max_num_seqs=state.config.max_num_seqs)
    if request.top_logprobs is not None and not request.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
    if request.response_format is not None and request.response_format.type != "text":
        raise InvalidRequest(
            f"response_format {request.response_format.type!r} is not supported yet",
            param="response_format",
        )


async def handle(state: ServerState, scope: Scope, receive: Receive, send: Send) -> None:
    body = await read_body(scope, receive, state.config.max_body_bytes)
    request = validation.parse_request(ChatRequest, parse_json(body))
    _check(state, request)
    stops = validation.stop_strings(request.stop)
    prompt = await anyio.to_thread.run_sync(_render, state, request, stops)
    per_token = request.logprobs or bool(request.logprob_token_ids)
    logprobs = validation.logprob_params(
        top=(request.top_logprobs or 0) if per_token else None,
        token_ids=request.logprob_token_ids,
        prompt_top=request.prompt_logprobs,
        vocab_size=state.vocab_size,
        max_top=state.config.max_top_logprobs,
        top_param="top_logprobs",
    )
    generation = GenerationRequest(
        request_id=new_id("chatcmpl"),
        prompt_ids=tuple(prompt.ids),
        n=request.n,
        sampling=validation.sampling_params(request, state.vocab_size),
        logprobs=logprobs,
        limits=validation.limits(
            request,
            requested_max=request.max_completion_tokens or request.max_tokens,
            max_param="max_completion_tokens",
            prompt_tokens=len(prompt.ids),
            max_context=state.max_context,
            vocab_size=state.vocab_size,
        ),
    )
    table = state.model.tokenizer.table
    options = prompt.options
    config = output_config(
        state, generation, request, make_pipeline=lambda: build_pipeline(table, options)
    )
    reply = ChatReplyConfig(
        completion_id=generation.request_id,
        created=int(time.time()),
        model=state.model_name,
        n=request.n,
        logprobs=per_token,
        prompt_logprobs=request.prompt_logprobs,
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        reasoning_field=state.config.reasoning_field,
    )
    jobs = [Job(generation, config)]
    if request.stream:
        encoder = ChatStreamEncoder(reply)
        keepalive = state.config.keepalive_seconds
        await stream_reply(receive, send, state.scheduler, jobs, encoder, keepalive)
        return
    accumulator = ChatAccumulator(reply)
    if not await collect_reply(receive, state.scheduler, jobs, accumulator.add):
        return  # the client is gone; nobody to answer
    if accumulator.failure is not None:
        raise RuntimeError(accumulator.failure)
    await send_json_text(send, accumulator.build().to_json())
