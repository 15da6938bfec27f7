"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: the request
onto the neutral conversation and generation request, the reply through the
Messages encoders; the count through the same renderer, without generating."""

from __future__ import annotations

import secrets

import anyio

from sluiceway.actors.output import OutputConfig
from sluiceway.parsers.registry import build_pipeline
from sluiceway.protocol.messages import GenerationRequest
from sluiceway.surfaces import validation
from sluiceway.surfaces.anthropic import translate
from sluiceway.surfaces.anthropic.encoder import (
    MessageAccumulator,
    MessageReplyConfig,
    MessageStreamEncoder,
)
from sluiceway.surfaces.anthropic.wire import (
    ConversationFields,
    CountTokensRequest,
    MessagesRequest,
    TokenCount,
)
from sluiceway.surfaces.base import Call, Job, Serving, send_whole
from sluiceway.surfaces.conversation import (
    RenderedPrompt,
    StopOptions,
    render_conversation,
)

_LIMIT_NAMES = validation.LimitParamNames(prompt="messages", max_tokens="max_tokens")


def message_id() -> str:
    return f"msg_{secrets.token_hex(12)}"


_NO_STOPS = StopOptions()


async def _render(
    serving: Serving, request: ConversationFields, stops: StopOptions = _NO_STOPS
) -> RenderedPrompt:
    validation.check_model(request.model, serving.model_name)
    conversation, params = translate.conversation_and_params(request)
    return await anyio.to_thread.run_sync(render_conversation, serving, conversation, stops, params)


async def handle(serving: Serving, call: Call) -> None:
    request = validation.parse_request(MessagesRequest, validation.parse_json(await call.body()))
    prompt = await _render(serving, request, StopOptions(stop=translate.stop_strings(request)))
    generation = GenerationRequest(
        request_id=message_id(),
        prompt_ids=prompt.ids,
        sampling=validation.sampling_params(translate.sampling(request), serving.vocab_size),
        # max_tokens is a cap: past the room the context leaves, it is clamped.
        limits=validation.limits(
            requested_max=request.max_tokens,
            prompt_tokens=len(prompt.ids),
            max_context=serving.max_context,
            vocab_size=serving.vocab_size,
            names=_LIMIT_NAMES,
        ),
    )
    table = serving.tokenizer.table
    text_path = prompt.options
    output = OutputConfig(
        request_id=generation.request_id,
        n=1,
        prompt_ids=generation.prompt_ids,
        table=table,
        make_pipeline=lambda: build_pipeline(table, text_path),
        logprobs=False,
        token_ids=request.return_token_ids,
    )
    reply = MessageReplyConfig(
        message_id=generation.request_id,
        model=serving.model_name,
        input_tokens=len(prompt.ids),
        prompt_token_ids=prompt.ids if request.return_token_ids else None,
        reused_prompt_tokens=prompt.reused,
    )
    jobs = [Job(generation, output)]
    if request.stream:
        await call.stream(jobs, MessageStreamEncoder(reply))
    else:
        await send_whole(call, jobs, MessageAccumulator(reply))


async def count_tokens(serving: Serving, call: Call) -> None:
    """The prompt's length, as ``usage.input_tokens`` of the same request."""
    body = validation.parse_json(await call.body())
    prompt = await _render(serving, validation.parse_request(CountTokensRequest, body))
    await call.send_json(TokenCount(input_tokens=len(prompt.ids)).to_json())
