"""JSON schemas of the OpenAI replies we emit, written from OpenAI's published
OpenAPI description (required-but-nullable fields are required here too)."""

from __future__ import annotations

import json
from typing import Any

import httpx
from jsonschema.exceptions import best_match
from jsonschema.protocols import Validator
from jsonschema.validators import validator_for

from tests.e2e.harness import sse_lines

NULLABLE_STRING = {"type": ["string", "null"]}

TOP_LOGPROB = {
    "type": "object",
    "required": ["token", "logprob", "bytes"],
    "properties": {
        "token": {"type": "string"},
        "logprob": {"type": "number"},
        "bytes": {
            "type": ["array", "null"],
            "items": {"type": "integer", "minimum": 0, "maximum": 255},
        },
    },
}

TOKEN_LOGPROB = {
    "type": "object",
    "required": ["token", "logprob", "bytes", "top_logprobs"],
    "properties": {
        **TOP_LOGPROB["properties"],  # type: ignore[dict-item]
        "top_logprobs": {"type": "array", "items": TOP_LOGPROB},
    },
}

CHOICE_LOGPROBS = {
    "type": ["object", "null"],
    "required": ["content", "refusal"],
    "properties": {
        "content": {"type": ["array", "null"], "items": TOKEN_LOGPROB},
        "refusal": {"type": ["array", "null"], "items": TOKEN_LOGPROB},
        "reasoning_content": {"type": "array", "items": TOKEN_LOGPROB},
        "tool_calls": {"type": "array", "items": TOKEN_LOGPROB},
    },
}

USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer", "minimum": 0},
        "completion_tokens": {"type": "integer", "minimum": 0},
        "total_tokens": {"type": "integer", "minimum": 0},
    },
}

FINISH_REASONS = ["stop", "length", "tool_calls", "content_filter", "function_call"]

TOOL_CALL = {
    "type": "object",
    "required": ["id", "type", "function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
        },
    },
}

CHAT_COMPLETION = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "chat.completion"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "usage": USAGE,
        "choices": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["index", "message", "finish_reason", "logprobs"],
                "properties": {
                    "index": {"type": "integer"},
                    "finish_reason": {"enum": FINISH_REASONS},
                    "logprobs": CHOICE_LOGPROBS,
                    "message": {
                        "type": "object",
                        "required": ["role", "content", "refusal"],
                        "properties": {
                            "role": {"const": "assistant"},
                            "content": NULLABLE_STRING,
                            "refusal": NULLABLE_STRING,
                            "tool_calls": {"type": "array", "items": TOOL_CALL},
                        },
                    },
                },
            },
        },
    },
}

CHAT_CHUNK = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "chat.completion.chunk"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "usage": {"anyOf": [{"type": "null"}, USAGE]},
        "choices": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["index", "delta", "finish_reason"],
                "properties": {
                    "index": {"type": "integer"},
                    "finish_reason": {"enum": [*FINISH_REASONS, None]},
                    "logprobs": CHOICE_LOGPROBS,
                    "delta": {
                        "type": "object",
                        "properties": {
                            "role": {"enum": ["assistant"]},
                            "content": NULLABLE_STRING,
                            "refusal": NULLABLE_STRING,
                            "tool_calls": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "required": ["index"],
                                    "properties": {
                                        "index": {"type": "integer"},
                                        "id": {"type": "string"},
                                        "type": {"const": "function"},
                                        "function": {
                                            "type": "object",
                                            "properties": {
                                                "name": {"type": "string"},
                                                "arguments": {"type": "string"},
                                            },
                                        },
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": NULLABLE_STRING,
                "code": NULLABLE_STRING,
            },
        }
    },
}

MODEL_LIST = {
    "type": "object",
    "required": ["object", "data"],
    "properties": {
        "object": {"const": "list"},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "object", "created", "owned_by"],
                "properties": {"object": {"const": "model"}},
            },
        },
    },
}


#: Each schema's validator, built (and the schema itself checked) once:
#: ``jsonschema.validate`` checks the schema against its metaschema on every
#: call, ~35 ms, which for a check per streamed chunk was most of a stream's
#: time. Keyed by identity, since the schemas are module constants.
_validators: dict[int, tuple[dict[str, Any], Validator]] = {}


def check(instance: Any, schema: dict[str, Any]) -> None:
    """What ``jsonschema.validate`` does (the best-matching error raised),
    with the validator built once per schema."""
    known = _validators.get(id(schema))
    if known is None or known[0] is not schema:
        kind = validator_for(schema)
        kind.check_schema(schema)
        known = _validators[id(schema)] = (schema, kind(schema))
    error = best_match(known[1].iter_errors(instance))
    if error is not None:
        raise error


def streamed_chat(api_url: str, payload: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """The chunks of a streamed chat completion, each checked against
    :data:`CHAT_CHUNK`, the stream ended by ``[DONE]``."""
    response = httpx.post(api_url + "/chat/completions", json=payload, timeout=timeout)
    assert response.status_code == 200, response.text
    lines = [line[6:] for line in sse_lines(response.text) if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    for chunk in chunks:
        check(chunk, CHAT_CHUNK)
    return chunks
