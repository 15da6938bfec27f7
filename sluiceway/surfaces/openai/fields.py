"""The fields chat and legacy completions share (``SamplingFields``), mapped
onto the neutral checks and values (``sluiceway.surfaces.validation``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sluiceway.actors.output import OutputConfig
from sluiceway.parsers.pipeline import ChoicePipeline
from sluiceway.protocol.errors import InvalidRequest
from sluiceway.protocol.messages import GenerationRequest, Limits, SamplingParams
from sluiceway.surfaces import validation
from sluiceway.surfaces.base import Serving
from sluiceway.surfaces.openai.chat_wire import ReasoningField, SamplingFields


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenAIOptions:
    """Server settings that only the OpenAI surface reads."""

    #: The delta/message field(s) that carry reasoning text.
    reasoning_field: ReasoningField = "reasoning_content"
    #: Logprob tokens as ``token_id:N`` for every request.
    return_tokens_as_token_ids: bool = False


def check(request: SamplingFields, serving: Serving) -> None:
    validation.check_model(request.model, serving.model_name)
    if request.stream_options is not None and not request.stream:
        raise InvalidRequest(
            "stream_options is only allowed when stream is true", param="stream_options"
        )
    validation.check_choices(request.n, serving.max_num_seqs)


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return validation.stop_strings([stop] if isinstance(stop, str) else stop)


def sampling_params(request: SamplingFields, vocab_size: int) -> SamplingParams:
    sampling = validation.Sampling(
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        seed=request.seed,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
        logit_bias=validation.logit_bias(request.logit_bias),
    )
    return validation.sampling_params(sampling, vocab_size)


def limits(
    request: SamplingFields,
    serving: Serving,
    *,
    requested_max: int | None,
    names: validation.LimitParamNames,
    prompt_tokens: int,
) -> Limits:
    return validation.limits(
        requested_max=requested_max,
        min_tokens=request.min_tokens,
        stop_token_ids=request.stop_token_ids or (),
        ignore_eos=request.ignore_eos,
        prompt_tokens=prompt_tokens,
        max_context=serving.max_context,
        vocab_size=serving.vocab_size,
        names=names,
    )


def tokens_as_ids(options: OpenAIOptions, request: SamplingFields) -> bool:
    return bool(options.return_tokens_as_token_ids or request.return_tokens_as_token_ids)


def output_config(
    serving: Serving,
    generation: GenerationRequest,
    request: SamplingFields,
    *,
    make_pipeline: Callable[[], ChoicePipeline],
    index_offset: int = 0,
) -> OutputConfig:
    return OutputConfig(
        request_id=generation.request_id,
        n=generation.n,
        prompt_ids=generation.prompt_ids,
        index_offset=index_offset,
        table=serving.tokenizer.table,
        make_pipeline=make_pipeline,
        logprobs=generation.logprobs.per_token,
        include_stop_token_text=request.include_stop_str_in_output,
        token_ids=request.return_token_ids,
    )
