"""Turning a validated wire request into the internal request, with every
check that needs the model (vocabulary, context) or the server's limits."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from sluiceway.protocol.chat import SamplingFields
from sluiceway.protocol.errors import InvalidRequest, NotFound
from sluiceway.protocol.messages import Limits, LogprobParams, SamplingParams

M = TypeVar("M", bound=BaseModel)

_FIELD = re.compile(r"^[a-z_][a-z0-9_]*$")
# Names pydantic puts in an error location for the member of a union it tried.
_UNION_TAGS = {"str", "int", "float", "bool", "none", "list", "dict", "literal"}

#: OpenAI's limit on stop sequences is 4; we accept up to this many.
MAX_STOP_SEQUENCES = 16
MAX_LOGPROB_TOKEN_IDS = 128


def _param(location: Iterable[Any]) -> str | None:
    parts: list[str] = []
    for item in location:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif isinstance(item, str) and _FIELD.match(item) and item not in _UNION_TAGS:
            parts.append(("." if parts else "") + item)
    return "".join(parts) or None


def parse_request(model: type[M], payload: Any) -> M:
    """Validate ``payload``; the first problem becomes a 400 naming its param."""
    if not isinstance(payload, dict):
        raise InvalidRequest("the request body must be a JSON object")
    try:
        return model.model_validate(payload)
    except ValidationError as error:
        first = error.errors()[0]
        param = _param(first["loc"])
        if first["type"] == "extra_forbidden":
            message = f"Unrecognized request argument supplied: {param}"
        elif first["type"] == "missing":
            message = f"Missing required parameter: '{param}'."
        else:
            message = f"Invalid value for '{param}': {first['msg']}"
        raise InvalidRequest(message, param=param) from error


def check_model(requested: str, served: str) -> None:
    if requested != served:
        raise NotFound(
            f"The model '{requested}' does not exist; this server serves '{served}'.",
            param="model",
            code="model_not_found",
        )


def _token_ids(values: Iterable[int], vocab_size: int, param: str) -> tuple[int, ...]:
    ids = tuple(values)
    for token in ids:
        if not 0 <= token < vocab_size:
            raise InvalidRequest(
                f"token id {token} is outside the vocabulary (0..{vocab_size - 1})", param=param
            )
    return ids


def logit_bias(bias: Mapping[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    pairs = []
    for key, value in bias.items():
        if not re.fullmatch(r"-?\d+", key.strip()):
            raise InvalidRequest(f"logit_bias key {key!r} is not a token id", param="logit_bias")
        (token,) = _token_ids([int(key)], vocab_size, "logit_bias")
        pairs.append((token, float(value)))
    return tuple(sorted(pairs))


def sampling_params(request: SamplingFields, vocab_size: int) -> SamplingParams:
    top_k = request.top_k or 0
    return SamplingParams(
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=max(top_k, 0),
        min_p=request.min_p or 0.0,
        seed=request.seed,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=request.repetition_penalty or 1.0,
        logit_bias=logit_bias(request.logit_bias, vocab_size),
    )


def common_checks(request: SamplingFields, *, max_num_seqs: int) -> None:
    if request.stream_options is not None and not request.stream:
        raise InvalidRequest(
            "stream_options is only allowed when stream is true", param="stream_options"
        )
    if request.n > max_num_seqs:
        raise InvalidRequest(
            f"n is {request.n}; this server runs at most {max_num_seqs} sequences", param="n"
        )


def logprob_params(
    *,
    top: int | None,
    token_ids: Iterable[int] | None,
    prompt_top: int | None,
    vocab_size: int,
    max_top: int,
    top_param: str,
) -> LogprobParams:
    if top is not None and top > max_top:
        raise InvalidRequest(
            f"{top_param} is {top}; this server allows at most {max_top}", param=top_param
        )
    if prompt_top is not None and prompt_top > max_top:
        raise InvalidRequest(
            f"prompt_logprobs is {prompt_top}; this server allows at most {max_top}",
            param="prompt_logprobs",
        )
    ids = tuple(token_ids or ())
    if len(ids) > MAX_LOGPROB_TOKEN_IDS:
        raise InvalidRequest(
            f"logprob_token_ids names {len(ids)} ids; at most {MAX_LOGPROB_TOKEN_IDS} are allowed",
            param="logprob_token_ids",
        )
    return LogprobParams(
        top=top,
        token_ids=_token_ids(ids, vocab_size, "logprob_token_ids"),
        prompt_top=prompt_top,
    )


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOP_SEQUENCES:
        raise InvalidRequest(
            f"stop has {len(stops)} sequences; at most {MAX_STOP_SEQUENCES} are allowed",
            param="stop",
        )
    if any(not s for s in stops):
        raise InvalidRequest("stop sequences must not be empty", param="stop")
    return tuple(dict.fromkeys(stops))


def limits(
    request: SamplingFields,
    *,
    requested_max: int | None,
    max_param: str,
    prompt_tokens: int,
    max_context: int,
    vocab_size: int,
) -> Limits:
    room = max_context - prompt_tokens
    if room <= 0:
        raise InvalidRequest(
            f"the prompt is {prompt_tokens} tokens, which leaves no room in this model's "
            f"context of {max_context} tokens",
            param="messages" if max_param == "max_completion_tokens" else "prompt",
            code="context_length_exceeded",
        )
    max_tokens = room if requested_max is None else min(requested_max, room)
    if request.min_tokens > max_tokens:
        raise InvalidRequest(
            f"min_tokens ({request.min_tokens}) is more than the {max_tokens} tokens "
            "this request may generate",
            param="min_tokens",
        )
    return Limits(
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        stop_token_ids=frozenset(
            _token_ids(request.stop_token_ids or (), vocab_size, "stop_token_ids")
        ),
        ignore_eos=request.ignore_eos,
    )
