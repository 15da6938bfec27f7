"""``POST /v1/responses``: the request onto the neutral conversation and
generation request, the reply through the Responses encoders; and the
stored-response routes, which a stateless server answers with 404."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from sluiceway.actors.output import OutputConfig
from sluiceway.parsers.registry import build_pipeline
from sluiceway.protocol.errors import NotFound
from sluiceway.protocol.messages import GenerationRequest
from sluiceway.surfaces import structured, validation
from sluiceway.surfaces.base import Call, Job, Serving, send_whole
from sluiceway.surfaces.conversation import StopOptions
from sluiceway.surfaces.responses.encoder import (
    ReplyConfig,
    ResponsesAccumulator,
    ResponsesStreamEncoder,
)
from sluiceway.surfaces.responses.items import new_id
from sluiceway.surfaces.responses.text_format import format_echo, output_format
from sluiceway.surfaces.responses.tools import tool_table
from sluiceway.surfaces.responses.translate import (
    STATELESS,
    check_settings,
    check_stateless,
    conversation_of,
)
from sluiceway.surfaces.responses.wire import ResponsesRequest

_LIMIT_NAMES = validation.LimitParamNames(prompt="input", max_tokens="max_output_tokens")
_LOGPROB_NAMES = validation.LogprobParamNames(top="top_logprobs")


def _echo(request: ResponsesRequest, payload: dict[str, Any]) -> dict[str, Any]:
    """The request's settings as the ``response`` object repeats them.

    ``store`` is always false: whatever the request asked, nothing is kept.
    """
    reasoning = request.reasoning
    text: dict[str, Any] = {"format": format_echo(request)}
    if request.text is not None and request.text.verbosity is not None:
        text["verbosity"] = request.text.verbosity
    echo: dict[str, Any] = {
        "instructions": request.instructions,
        "tools": payload.get("tools") or [],
        "tool_choice": payload.get("tool_choice") or "auto",
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "max_output_tokens": request.max_output_tokens,
        "previous_response_id": None,
        "reasoning": {
            "effort": reasoning.effort if reasoning is not None else None,
            "summary": reasoning.summary if reasoning is not None else None,
        },
        "text": text,
        "metadata": request.metadata or {},
        "store": False,
    }
    optional = {
        "top_logprobs": request.top_logprobs,
        "user": request.user,
        "prompt_cache_key": request.prompt_cache_key,
        "safety_identifier": request.safety_identifier,
        "max_tool_calls": request.max_tool_calls,
    }
    return echo | {key: value for key, value in optional.items() if value is not None}


def _check(serving: Serving, request: ResponsesRequest) -> None:
    validation.check_model(request.model, serving.model_name)
    check_stateless(request)
    check_settings(request)


async def create(serving: Serving, call: Call) -> None:
    payload = validation.parse_json(await call.body())
    request = validation.parse_request(ResponsesRequest, payload)
    _check(serving, request)
    conversation, tools, params = conversation_of(request, tool_table(request.tools or []))
    # A strict tool's schema that does not compile is named where the request holds it.
    where = {name: ref.parameters for name, ref in tools.refs.items() if ref.parameters}
    params = replace(params, tool_parameter_names=where)
    prompt = await structured.constrained_prompt(
        serving, conversation, StopOptions(), output_format(request), params
    )
    logprobs = validation.logprob_params(
        top=(request.top_logprobs or 0) if request.wants_logprobs else None,
        token_ids=None,
        prompt_top=None,
        vocab_size=serving.vocab_size,
        max_top=serving.max_top_logprobs,
        names=_LOGPROB_NAMES,
    )
    sampling = validation.Sampling(temperature=request.temperature, top_p=request.top_p)
    generation = GenerationRequest(
        request_id=new_id("resp"),
        prompt_ids=prompt.ids,
        sampling=validation.sampling_params(sampling, serving.vocab_size),
        logprobs=logprobs,
        limits=validation.limits(
            requested_max=request.max_output_tokens,
            prompt_tokens=len(prompt.ids),
            max_context=serving.max_context,
            vocab_size=serving.vocab_size,
            names=_LIMIT_NAMES,
        ),
        constraint=prompt.constraint,
    )
    table, text_path = serving.tokenizer.table, prompt.options
    output = OutputConfig(
        request_id=generation.request_id,
        n=1,
        prompt_ids=generation.prompt_ids,
        table=table,
        make_pipeline=lambda: build_pipeline(table, text_path),
        logprobs=logprobs.per_token,
        token_ids=request.return_token_ids,
    )
    reply = ReplyConfig(
        response_id=generation.request_id,
        created_at=int(time.time()),
        model=serving.model_name,
        tools=tools,
        logprobs=logprobs.per_token,
        echo=_echo(request, payload),
        prompt_token_ids=prompt.ids if request.return_token_ids else None,
        reused_prompt_tokens=prompt.reused,
    )
    jobs = [Job(generation, output)]
    if request.stream:
        await call.stream(jobs, ResponsesStreamEncoder(reply))
    else:
        await send_whole(call, jobs, ResponsesAccumulator(reply))


async def stored(serving: Serving, call: Call) -> None:
    """``GET``/``DELETE /v1/responses/{response_id}`` (and its input items):
    nothing is stored, so no response can be found."""
    response_id = call.params.get("response_id", "")
    raise NotFound(
        f"No response with id {response_id!r} is stored: {STATELESS}",
        param="response_id",
        code="response_not_found",
    )
