"""``POST /v1/completions`` (the legacy text completions API)."""

from __future__ import annotations

import time

import anyio

from sluiceway.actors.emitters.completions import (
    CompletionAccumulator,
    CompletionReplyConfig,
    CompletionStreamEncoder,
)
from sluiceway.parsers.registry import TextPathOptions, build_pipeline
from sluiceway.protocol.completions import CompletionRequest
from sluiceway.protocol.errors import InvalidRequest
from sluiceway.protocol.messages import GenerationRequest
from sluiceway.server import validation
from sluiceway.server.exchange import Job, collect_reply, stream_reply
from sluiceway.server.handlers.common import echo_of, output_config
from sluiceway.server.http import Receive, Scope, Send, parse_json, read_body, send_json_text
from sluiceway.server.state import ServerState, new_id

#: OpenAI's default for this endpoint.
DEFAULT_MAX_TOKENS = 16


def _check(state: ServerState, request: CompletionRequest) -> None:
    validation.check_model(request.model, state.model_name)
    validation.common_checks(request, max_num_seqs=state.config.max_num_seqs)
    if request.suffix:
        raise InvalidRequest("suffix is not supported by this model", param="suffix")
    if request.best_of is not None and request.best_of != request.n:
        raise InvalidRequest("best_of other than n is not supported", param="best_of")
    if isinstance(request.prompt, list) and not request.prompt:
        raise InvalidRequest("prompt must not be empty", param="prompt")


def prompt_ids(state: ServerState, request: CompletionRequest) -> list[tuple[int, ...]]:
    """Each prompt of the request as token ids (strings are tokenized)."""
    prompt = request.prompt
    tokenizer = state.model.tokenizer
    if isinstance(prompt, str):
        raw: list[list[int]] = [tokenizer.encode_prompt(prompt)]
    elif all(isinstance(item, str) for item in prompt):
        raw = [tokenizer.encode_prompt(str(item)) for item in prompt]
    elif all(isinstance(item, int) for item in prompt):
        raw = [[int(item) for item in prompt]]  # type: ignore[arg-type]
    else:
        raw = [[int(t) for t in item] for item in prompt]  # type: ignore[union-attr]
    prompts = []
    for index, ids in enumerate(raw):
        if not ids:
            raise InvalidRequest(f"prompt {index} is empty", param="prompt")
        for token in ids:
            if not 0 <= token < state.vocab_size:
                raise InvalidRequest(
                    f"token id {token} is outside the vocabulary (0..{state.vocab_size - 1})",
                    param="prompt",
                )
        prompts.append(tuple(ids))
    return prompts


def _generation(
    state: ServerState, request: CompletionRequest, ids: tuple[int, ...]
) -> GenerationRequest:
    per_token = request.logprobs is not None or bool(request.logprob_token_ids)
    echo_scores = request.logprobs if request.echo else None
    prompt_top = max(
        (k for k in (request.prompt_logprobs, echo_scores) if k is not None), default=None
    )
    logprobs = validation.logprob_params(
        top=(request.logprobs or 0) if per_token else None,
        token_ids=request.logprob_token_ids,
        prompt_top=prompt_top,
        vocab_size=state.vocab_size,
        max_top=state.config.max_top_logprobs,
        top_param="logprobs",
    )
    return GenerationRequest(
        request_id=new_id("cmpl"),
        prompt_ids=ids,
        n=request.n,
        sampling=validation.sampling_params(request, state.vocab_size),
        logprobs=logprobs,
        limits=validation.limits(
            request,
            requested_max=request.max_tokens or DEFAULT_MAX_TOKENS,
            max_param="max_tokens",
            prompt_tokens=len(ids),
            max_context=state.max_context,
            vocab_size=state.vocab_size,
        ),
    )


async def handle(state: ServerState, scope: Scope, receive: Receive, send: Send) -> None:
    body = await read_body(scope, receive, state.config.max_body_bytes)
    request = validation.parse_request(CompletionRequest, parse_json(body))
    _check(state, request)
    prompts = await anyio.to_thread.run_sync(prompt_ids, state, request)
    table = state.model.tokenizer.table
    options = TextPathOptions(
        stop=validation.stop_strings(request.stop),
        include_stop_str_in_output=request.include_stop_str_in_output,
        min_tokens=request.min_tokens,
    )
    jobs = []
    for index, ids in enumerate(prompts):
        generation = _generation(state, request, ids)
        config = output_config(
            state,
            generation,
            request,
            make_pipeline=lambda: build_pipeline(table, options),
            index_offset=index * request.n,
        )
        jobs.append(Job(generation, config))
    tokens_as_ids = jobs[0].output.tokens_as_ids
    reply = CompletionReplyConfig(
        completion_id=jobs[0].request.request_id,
        created=int(time.time()),
        model=state.model_name,
        n=request.n,
        jobs=len(jobs),
        logprobs=request.logprobs,
        prompt_logprobs=request.prompt_logprobs,
        echoes=tuple(echo_of(table, ids, tokens_as_ids) for ids in prompts)
        if request.echo
        else None,
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
    )
    if request.stream:
        await stream_reply(
            receive,
            send,
            state.scheduler,
            jobs,
            CompletionStreamEncoder(reply),
            state.config.keepalive_seconds,
        )
        return
    accumulator = CompletionAccumulator(reply)
    if not await collect_reply(receive, state.scheduler, jobs, accumulator.add):
        return
    if accumulator.failure is not None:
        raise RuntimeError(accumulator.failure)
    await send_json_text(send, accumulator.build().to_json())
