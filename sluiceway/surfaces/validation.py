"""Checks every surface makes, on plain values: the body as JSON and its
pydantic validation, and a request's sampling, limits and logprob settings
against the model (vocabulary, context) and the server's limits.

Each surface maps its own field names onto these and passes the names its
errors should carry (``param``); nothing here knows which surface called.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from sluiceway.protocol.errors import InvalidRequest, NotFound
from sluiceway.protocol.messages import Limits, LogprobParams, SamplingParams

M = TypeVar("M", bound=BaseModel)

_FIELD = re.compile(r"^[a-z_][a-z0-9_]*$")
_TOKEN_KEY = re.compile(r"-?[0-9]+")
# Names pydantic puts in an error location for the member of a union it tried.
_UNION_TAGS = {"str", "int", "float", "bool", "none", "list", "dict", "literal"}

#: JSON nested deeper than this is refused: nothing a surface accepts nests
#: so far, and everything after parsing (validation, templates, grammars)
#: recurses over it.
MAX_JSON_DEPTH = 64

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


def parse_json(body: bytes) -> Any:
    """The body as JSON; a 400 for anything that is not (invalid UTF-8, a
    number too long to convert, nesting past :data:`MAX_JSON_DEPTH`)."""
    try:
        value = json.loads(body)
    except RecursionError as error:
        raise InvalidRequest(_TOO_DEEP) from error
    except (UnicodeDecodeError, ValueError) as error:  # JSONDecodeError is a ValueError
        raise InvalidRequest(f"the request body is not valid JSON: {error}") from error
    if _deeper_than(value, MAX_JSON_DEPTH):
        raise InvalidRequest(_TOO_DEEP)
    return value


_TOO_DEEP = f"the request body is nested more than {MAX_JSON_DEPTH} levels deep"


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` nests more than ``limit`` containers deep (without recursing)."""
    stack: list[tuple[Any, int]] = [(value, 1)] if isinstance(value, dict | list) else []
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        for child in children:
            if isinstance(child, dict | list):
                if depth >= limit:
                    return True
                stack.append((child, depth + 1))
    return False


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


def check_model(requested: str, served: str, *, param: str = "model") -> None:
    if requested != served:
        raise NotFound(
            f"The model '{requested}' does not exist; this server serves '{served}'.",
            param=param,
            code="model_not_found",
        )


def check_choices(n: int, max_num_seqs: int, *, param: str = "n") -> None:
    if n > max_num_seqs:
        raise InvalidRequest(
            f"{param} is {n}; this server runs at most {max_num_seqs} sequences", param=param
        )


def checked_ids(values: Iterable[int], vocab_size: int, param: str) -> tuple[int, ...]:
    """The ids, each checked to lie in the vocabulary."""
    ids = tuple(values)
    for token in ids:
        if not 0 <= token < vocab_size:
            raise InvalidRequest(
                f"token id {token} is outside the vocabulary (0..{vocab_size - 1})", param=param
            )
    return ids


def logit_bias(
    bias: Mapping[str, float] | None, *, param: str = "logit_bias"
) -> tuple[tuple[int, float], ...]:
    """A JSON logit bias (token ids as the keys' text) as (id, bias) pairs;
    the ids are checked against the vocabulary by :func:`sampling_params`."""
    pairs = []
    for key, value in (bias or {}).items():
        if not _TOKEN_KEY.fullmatch(key.strip()):
            raise InvalidRequest(f"logit_bias key {key!r} is not a token id", param=param)
        pairs.append((int(key), float(value)))
    return tuple(pairs)


@dataclass(frozen=True, slots=True, kw_only=True)
class Sampling:
    """A request's sampling settings as plain values (None: the default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    #: (token id, bias) pairs; ids are checked against the vocabulary.
    logit_bias: tuple[tuple[int, float], ...] = ()


def sampling_params(
    sampling: Sampling, vocab_size: int, *, logit_bias_param: str = "logit_bias"
) -> SamplingParams:
    top_k = sampling.top_k or 0
    bias = checked_ids((token for token, _ in sampling.logit_bias), vocab_size, logit_bias_param)
    return SamplingParams(
        temperature=1.0 if sampling.temperature is None else sampling.temperature,
        top_p=1.0 if sampling.top_p is None else sampling.top_p,
        top_k=max(top_k, 0),
        min_p=sampling.min_p or 0.0,
        seed=sampling.seed,
        presence_penalty=sampling.presence_penalty or 0.0,
        frequency_penalty=sampling.frequency_penalty or 0.0,
        repetition_penalty=sampling.repetition_penalty or 1.0,
        logit_bias=tuple(
            sorted(zip(bias, (value for _, value in sampling.logit_bias), strict=True))
        ),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class LogprobParamNames:
    """The names a surface gives the logprob settings, for its errors."""

    top: str
    prompt_top: str = "prompt_logprobs"
    token_ids: str = "logprob_token_ids"


def logprob_params(
    *,
    top: int | None,
    token_ids: Iterable[int] | None,
    prompt_top: int | None,
    vocab_size: int,
    max_top: int,
    names: LogprobParamNames,
) -> LogprobParams:
    if top is not None and top > max_top:
        raise InvalidRequest(
            f"{names.top} is {top}; this server allows at most {max_top}", param=names.top
        )
    if prompt_top is not None and prompt_top > max_top:
        raise InvalidRequest(
            f"{names.prompt_top} is {prompt_top}; this server allows at most {max_top}",
            param=names.prompt_top,
        )
    ids = tuple(token_ids or ())
    if len(ids) > MAX_LOGPROB_TOKEN_IDS:
        raise InvalidRequest(
            f"{names.token_ids} names {len(ids)} ids; at most {MAX_LOGPROB_TOKEN_IDS} are allowed",
            param=names.token_ids,
        )
    return LogprobParams(
        top=top,
        token_ids=checked_ids(ids, vocab_size, names.token_ids),
        prompt_top=prompt_top,
    )


def stop_strings(stops: Iterable[str], *, param: str = "stop") -> tuple[str, ...]:
    """The distinct stop strings, in order; none empty, not too many."""
    listed = list(stops)
    if len(listed) > MAX_STOP_SEQUENCES:
        raise InvalidRequest(
            f"{param} has {len(listed)} sequences; at most {MAX_STOP_SEQUENCES} are allowed",
            param=param,
        )
    if any(not s for s in listed):
        raise InvalidRequest("stop sequences must not be empty", param=param)
    return tuple(dict.fromkeys(listed))


@dataclass(frozen=True, slots=True, kw_only=True)
class LimitParamNames:
    """The names a surface gives the limits, for its errors."""

    prompt: str
    max_tokens: str
    min_tokens: str = "min_tokens"
    stop_token_ids: str = "stop_token_ids"


def limits(
    *,
    requested_max: int | None,
    min_tokens: int = 0,
    stop_token_ids: Iterable[int] = (),
    ignore_eos: bool = False,
    prompt_tokens: int,
    max_context: int,
    vocab_size: int,
    names: LimitParamNames,
) -> Limits:
    """The token limits of a request whose prompt is ``prompt_tokens`` long;
    ``requested_max`` None: as many as the context leaves."""
    room = max_context - prompt_tokens
    if room <= 0:
        raise InvalidRequest(
            f"the prompt is {prompt_tokens} tokens, which leaves no room in this model's "
            f"context of {max_context} tokens",
            param=names.prompt,
            code="context_length_exceeded",
        )
    max_tokens = room if requested_max is None else min(requested_max, room)
    if min_tokens > max_tokens:
        raise InvalidRequest(
            f"{names.min_tokens} ({min_tokens}) is more than the {max_tokens} tokens "
            "this request may generate",
            param=names.min_tokens,
        )
    return Limits(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop_token_ids=frozenset(checked_ids(stop_token_ids, vocab_size, names.stop_token_ids)),
        ignore_eos=ignore_eos,
    )
