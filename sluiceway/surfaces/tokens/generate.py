"""``POST /inference/v1/generate``: token ids in, token ids out.

The prompt is used as given (no template, no BOS). The choices take the
output actor's token path (``sluiceway.actors.token_output``): each id goes
out in the step that produced it, with its logprob entry; text exists only to
match ``stop`` strings, when the request has some. ``structured_outputs``
holds the ids to a format as on completions: the prompt has no reasoning
section to wait out, so the format starts at the first generated id.
"""

from __future__ import annotations

import time
from dataclasses import replace

from sluiceway.actors.output import OutputConfig
from sluiceway.parsers.registry import TextPathOptions, build_pipeline
from sluiceway.protocol.errors import InvalidRequest
from sluiceway.protocol.messages import GenerationRequest, LogprobParams
from sluiceway.surfaces import structured, validation
from sluiceway.surfaces.base import Call, Job, Serving, new_id, send_whole
from sluiceway.surfaces.tokens.encoder import (
    GenerateAccumulator,
    GenerateReplyConfig,
    GenerateStreamEncoder,
)
from sluiceway.surfaces.tokens.wire import GenerateRequest, SamplingParamsWire

_PARAMS = "sampling_params."
_STRUCTURED = _PARAMS + "structured_outputs"
_LIMIT_NAMES = validation.LimitParamNames(
    prompt="token_ids",
    max_tokens=_PARAMS + "max_tokens",
    min_tokens=_PARAMS + "min_tokens",
    stop_token_ids=_PARAMS + "stop_token_ids",
)
_LOGPROB_NAMES = validation.LogprobParamNames(
    top=_PARAMS + "logprobs",
    prompt_top=_PARAMS + "prompt_logprobs",
    token_ids=_PARAMS + "logprob_token_ids",
)


def _unsupported(request: GenerateRequest) -> str | None:
    """The first field set to something this server has nothing behind."""
    if request.priority != 0:
        return "priority"
    for name in ("cache_salt", "kv_transfer_params", "features"):
        if getattr(request, name) is not None:
            return name
    if request.stream_options is not None and request.stream_options.continuous_usage_stats:
        return "stream_options.continuous_usage_stats"
    return None


def _check(serving: Serving, request: GenerateRequest) -> None:
    if request.model is not None:
        validation.check_model(request.model, serving.model_name)
    if request.stream_options is not None and not request.stream:
        raise InvalidRequest(
            "stream_options is only allowed when stream is true", param="stream_options"
        )
    unsupported = _unsupported(request)
    if unsupported is not None:
        raise InvalidRequest(f"{unsupported} is not supported by this server", param=unsupported)
    validation.check_choices(request.sampling_params.n, serving.max_num_seqs, param=_PARAMS + "n")
    if not request.token_ids:
        raise InvalidRequest("token_ids must not be empty", param="token_ids")


def _logprobs(serving: Serving, params: SamplingParamsWire) -> LogprobParams:
    top = params.logprobs
    if top is None and params.logprob_token_ids:
        top = 0  # the named ids' logprobs travel in the sampled token's entry
    return validation.logprob_params(
        top=top,
        token_ids=params.logprob_token_ids,
        prompt_top=params.prompt_logprobs,
        vocab_size=serving.vocab_size,
        max_top=serving.max_top_logprobs,
        names=_LOGPROB_NAMES,
    )


def _generation(serving: Serving, request: GenerateRequest) -> GenerationRequest:
    params = request.sampling_params
    prompt = validation.checked_ids(request.token_ids, serving.vocab_size, "token_ids")
    sampling = validation.Sampling(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        seed=params.seed,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias=validation.logit_bias(params.logit_bias, param=_PARAMS + "logit_bias"),
    )
    return GenerationRequest(
        request_id=new_id("gen"),
        prompt_ids=prompt,
        n=params.n,
        sampling=validation.sampling_params(
            sampling, serving.vocab_size, logit_bias_param=_PARAMS + "logit_bias"
        ),
        logprobs=_logprobs(serving, params),
        limits=validation.limits(
            requested_max=params.max_tokens,
            min_tokens=params.min_tokens,
            stop_token_ids=params.stop_token_ids or (),
            ignore_eos=params.ignore_eos,
            prompt_tokens=len(prompt),
            max_context=serving.max_context,
            vocab_size=serving.vocab_size,
            names=_LIMIT_NAMES,
        ),
    )


def _output(
    serving: Serving, generation: GenerationRequest, params: SamplingParamsWire
) -> OutputConfig:
    stop = params.stop
    stops = validation.stop_strings(
        () if stop is None else [stop] if isinstance(stop, str) else stop, param=_PARAMS + "stop"
    )
    table = serving.tokenizer.table
    text_path = TextPathOptions(
        stop=stops,
        include_stop_str_in_output=params.include_stop_str_in_output,
        min_tokens=params.min_tokens,
    )
    return OutputConfig(
        request_id=generation.request_id,
        n=generation.n,
        prompt_ids=generation.prompt_ids,
        table=table,
        make_pipeline=lambda: build_pipeline(table, text_path),
        logprobs=generation.logprobs.per_token,
        include_stop_token_text=params.include_stop_str_in_output,
        ids_only=True,
    )


async def handle(serving: Serving, call: Call) -> None:
    request = validation.parse_request(GenerateRequest, validation.parse_json(await call.body()))
    _check(serving, request)
    generation = _generation(serving, request)
    params = request.sampling_params
    # After the cheap checks: a request that fails them spends no compile.
    output = structured.structured_outputs(params.structured_outputs, param=_STRUCTURED)
    generation = replace(generation, constraint=await structured.text_constraint(serving, output))
    reply = GenerateReplyConfig(
        reply_id=request.request_id or generation.request_id,
        created=int(time.time()),
        model=serving.model_name,
        n=generation.n,
        logprobs=generation.logprobs.per_token,
        prompt_logprobs=params.prompt_logprobs is not None,
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
    )
    jobs = [Job(generation, _output(serving, generation, params))]
    if request.stream:
        await call.stream(jobs, GenerateStreamEncoder(reply))
    else:
        await send_whole(call, jobs, GenerateAccumulator(reply))
