"""``POST /v1/completions`` (the legacy text completions API)."""

from __future__ import annotations

import time
from dataclasses import replace

import anyio

from sluiceway.parsers.detokenizer import IncrementalDetokenizer
from sluiceway.parsers.registry import TextPathOptions, build_pipeline
from sluiceway.protocol.constraints import Constraint
from sluiceway.protocol.errors import InvalidRequest
from sluiceway.protocol.messages import GenerationRequest
from sluiceway.protocol.tokens import TokenTable
from sluiceway.surfaces import structured, validation
from sluiceway.surfaces.base import Call, Job, Serving, new_id, send_whole
from sluiceway.surfaces.openai import fields
from sluiceway.surfaces.openai.completions_encoder import (
    CompletionAccumulator,
    CompletionReplyConfig,
    CompletionStreamEncoder,
    Echo,
)
from sluiceway.surfaces.openai.completions_wire import CompletionRequest
from sluiceway.surfaces.openai.encoding import token_text
from sluiceway.surfaces.openai.fields import OpenAIOptions

#: OpenAI's default for this endpoint.
DEFAULT_MAX_TOKENS = 16

_LIMIT_NAMES = validation.LimitParamNames(prompt="prompt", max_tokens="max_tokens")
_LOGPROB_NAMES = validation.LogprobParamNames(top="logprobs")


def _check(serving: Serving, request: CompletionRequest) -> None:
    fields.check(request, serving)
    if request.suffix:
        raise InvalidRequest("suffix is not supported by this model", param="suffix")
    if request.best_of is not None and request.best_of != request.n:
        raise InvalidRequest("best_of other than n is not supported", param="best_of")
    if isinstance(request.prompt, list) and not request.prompt:
        raise InvalidRequest("prompt must not be empty", param="prompt")


def prompt_ids(serving: Serving, request: CompletionRequest) -> list[tuple[int, ...]]:
    """Each prompt of the request as token ids (strings are tokenized)."""
    prompt = request.prompt
    tokenizer = serving.tokenizer
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
        prompts.append(validation.checked_ids(ids, serving.vocab_size, "prompt"))
    return prompts


def _generation(
    serving: Serving,
    request: CompletionRequest,
    ids: tuple[int, ...],
    constraint: Constraint | None,
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
        vocab_size=serving.vocab_size,
        max_top=serving.max_top_logprobs,
        names=_LOGPROB_NAMES,
    )
    return GenerationRequest(
        request_id=new_id("cmpl"),
        prompt_ids=ids,
        n=request.n,
        sampling=fields.sampling_params(request, serving.vocab_size),
        logprobs=logprobs,
        limits=fields.limits(
            request,
            serving,
            requested_max=request.max_tokens or DEFAULT_MAX_TOKENS,
            names=_LIMIT_NAMES,
            prompt_tokens=len(ids),
        ),
        constraint=constraint,
    )


async def handle(options: OpenAIOptions, serving: Serving, call: Call) -> None:
    request = validation.parse_request(CompletionRequest, validation.parse_json(await call.body()))
    _check(serving, request)
    prompts = await anyio.to_thread.run_sync(prompt_ids, serving, request)
    output = structured.structured_outputs(request.structured_outputs)
    constraint = await structured.text_constraint(serving, output)
    table = serving.tokenizer.table
    text_path = TextPathOptions(
        stop=fields.stop_strings(request.stop),
        include_stop_str_in_output=request.include_stop_str_in_output,
        min_tokens=request.min_tokens,
    )
    jobs = []
    for index, ids in enumerate(prompts):
        generation = _generation(serving, request, ids, constraint)
        config = fields.output_config(
            serving,
            generation,
            request,
            make_pipeline=lambda: build_pipeline(table, text_path),
            index_offset=index * request.n,
        )
        jobs.append(Job(generation, config))
    as_ids = fields.tokens_as_ids(options, request)
    reply = CompletionReplyConfig(
        completion_id=jobs[0].request.request_id,
        created=int(time.time()),
        model=serving.model_name,
        n=request.n,
        jobs=len(jobs),
        logprobs=request.logprobs,
        prompt_logprobs=request.prompt_logprobs,
        echoes=tuple(echo_of(table, ids, as_ids) for ids in prompts) if request.echo else None,
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        tokens_as_ids=as_ids,
        prompt_token_ids=tuple(prompts) if request.return_token_ids else None,
    )
    if request.stream:
        await call.stream(jobs, CompletionStreamEncoder(reply))
    else:
        await send_whole(call, jobs, CompletionAccumulator(reply))


def echo_of(table: TokenTable, prompt_ids: tuple[int, ...], tokens_as_ids: bool) -> Echo:
    """The prompt as ``echo`` repeats it: special tokens included, every
    token's offset where its first character lands (or the next one's)."""
    detokenizer = IncrementalDetokenizer(replace(table, hidden=frozenset()))
    pieces: list[str] = []
    offsets: list[int] = []
    length = 0
    waiting: list[int] = []
    for token_id in prompt_ids:
        text = detokenizer.feed(token_id)
        waiting.append(len(offsets))
        offsets.append(length)
        if text:
            for position in waiting:
                offsets[position] = length
            waiting.clear()
            pieces.append(text)
            length += len(text)
    tail = detokenizer.finish()
    if tail:
        pieces.append(tail)
        length += len(tail)
    for position in waiting:
        offsets[position] = length - len(tail)
    strings = tuple(token_text(table.display(t), t, tokens_as_ids) for t in prompt_ids)
    return Echo(text="".join(pieces), tokens=strings, offsets=tuple(offsets))
