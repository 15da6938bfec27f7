"""``POST /v1/chat/completions``."""

from __future__ import annotations

import time
from typing import Any

import anyio

from sluiceway.actors.emitters.chat import ChatAccumulator, ChatReplyConfig, ChatStreamEncoder
from sluiceway.engines.tokenizer import ChatRender
from sluiceway.parsers.pipeline import ChoicePipeline
from sluiceway.protocol.chat import ChatRequest
from sluiceway.protocol.errors import InvalidRequest
from sluiceway.protocol.messages import GenerationRequest
from sluiceway.server import validation
from sluiceway.server.exchange import Job, collect_reply, stream_reply
from sluiceway.server.handlers.common import output_config
from sluiceway.server.http import Receive, Scope, Send, parse_json, read_body, send_json_text
from sluiceway.server.state import ServerState, new_id


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


def _render(state: ServerState, request: ChatRequest) -> tuple[ChatRender, list[int]]:
    tokenizer = state.model.tokenizer
    try:
        rendered = tokenizer.render_chat(
            _template_messages(request),
            tools=[tool.model_dump(exclude_none=True) for tool in request.tools or ()],
            template_kwargs=request.chat_template_kwargs,
        )
    except Exception as error:  # template errors are the conversation's fault
        raise InvalidRequest(
            f"the chat template could not render these messages: {error}", param="messages"
        ) from error
    return rendered, tokenizer.encode(rendered.text)


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
    _, prompt_ids = await anyio.to_thread.run_sync(_render, state, request)
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
        prompt_ids=tuple(prompt_ids),
        n=request.n,
        sampling=validation.sampling_params(request, state.vocab_size),
        logprobs=logprobs,
        limits=validation.limits(
            request,
            requested_max=request.max_completion_tokens or request.max_tokens,
            max_param="max_completion_tokens",
            prompt_tokens=len(prompt_ids),
            max_context=state.max_context,
            vocab_size=state.vocab_size,
        ),
    )
    table = state.model.tokenizer.table
    config = output_config(state, generation, request, make_pipeline=lambda: ChoicePipeline(table))
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
        await stream_reply(
            receive,
            send,
            state.scheduler,
            jobs,
            ChatStreamEncoder(reply),
            state.config.keepalive_seconds,
        )
        return
    accumulator = ChatAccumulator(reply)
    if not await collect_reply(receive, state.scheduler, jobs, accumulator.add):
        return  # the client is gone; nobody to answer
    if accumulator.failure is not None:
        raise RuntimeError(accumulator.failure)
    await send_json_text(send, accumulator.build().to_json())
