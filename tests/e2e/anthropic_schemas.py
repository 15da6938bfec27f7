"""JSON schemas of the Messages API replies and stream events we emit,
written from Anthropic's published API reference (the Message object, the
streaming events, the error shapes, count_tokens, the model list)."""

from __future__ import annotations

from typing import Any

from tests.e2e.schemas import check

STOP_REASONS = [
    "end_turn",
    "max_tokens",
    "stop_sequence",
    "tool_use",
    "pause_turn",
    "refusal",
    "model_context_window_exceeded",
]
ERROR_TYPES = [
    "invalid_request_error",
    "authentication_error",
    "billing_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "rate_limit_error",
    "api_error",
    "timeout_error",
    "overloaded_error",
]

NULLABLE_INT = {"type": ["integer", "null"], "minimum": 0}

USAGE = {
    "type": "object",
    "required": ["input_tokens", "output_tokens"],
    "properties": {
        "input_tokens": {"type": "integer", "minimum": 0},
        "output_tokens": {"type": "integer", "minimum": 0},
        "cache_creation_input_tokens": NULLABLE_INT,
        "cache_read_input_tokens": NULLABLE_INT,
    },
}

TEXT_BLOCK = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}
THINKING_BLOCK = {
    "type": "object",
    "required": ["type", "thinking", "signature"],
    "properties": {
        "type": {"const": "thinking"},
        "thinking": {"type": "string"},
        "signature": {"type": "string"},
    },
}
TOOL_USE_BLOCK = {
    "type": "object",
    "required": ["type", "id", "name", "input"],
    "properties": {
        "type": {"const": "tool_use"},
        "id": {"type": "string", "pattern": "^toolu_[A-Za-z0-9_]+$"},
        "name": {"type": "string"},
        "input": {"type": "object"},
    },
}
CONTENT_BLOCK = {"oneOf": [TEXT_BLOCK, THINKING_BLOCK, TOOL_USE_BLOCK]}

MESSAGE = {
    "type": "object",
    "required": [
        "id",
        "type",
        "role",
        "content",
        "model",
        "stop_reason",
        "stop_sequence",
        "usage",
    ],
    "properties": {
        "id": {"type": "string", "pattern": "^msg_"},
        "type": {"const": "message"},
        "role": {"const": "assistant"},
        "content": {"type": "array", "items": CONTENT_BLOCK},
        "model": {"type": "string"},
        "stop_reason": {"enum": [*STOP_REASONS, None]},
        "stop_sequence": {"type": ["string", "null"]},
        "usage": USAGE,
    },
}


def _event(name: str, required: list[str], **properties: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["type", *required],
        "properties": {"type": {"const": name}, **properties},
    }


def _delta(name: str, field: str) -> dict[str, Any]:
    return _event(name, [field], **{field: {"type": "string"}})


INDEX = {"type": "integer", "minimum": 0}

EVENTS = {
    "message_start": _event("message_start", ["message"], message=MESSAGE),
    "content_block_start": _event(
        "content_block_start", ["index", "content_block"], index=INDEX, content_block=CONTENT_BLOCK
    ),
    "content_block_delta": _event(
        "content_block_delta",
        ["index", "delta"],
        index=INDEX,
        delta={
            "oneOf": [
                _delta("text_delta", "text"),
                _delta("thinking_delta", "thinking"),
                _delta("input_json_delta", "partial_json"),
                _delta("signature_delta", "signature"),
            ]
        },
    ),
    "content_block_stop": _event("content_block_stop", ["index"], index=INDEX),
    "message_delta": _event(
        "message_delta",
        ["delta", "usage"],
        delta={
            "type": "object",
            "required": ["stop_reason", "stop_sequence"],
            "properties": {
                "stop_reason": {"enum": STOP_REASONS},
                "stop_sequence": {"type": ["string", "null"]},
            },
        },
        usage={
            "type": "object",
            "required": ["output_tokens"],
            "properties": {**USAGE["properties"], "input_tokens": NULLABLE_INT},  # type: ignore[dict-item]
        },
    ),
    "message_stop": _event("message_stop", []),
    "ping": _event("ping", []),
}

ERROR = _event(
    "error",
    ["error"],
    error={
        "type": "object",
        "required": ["type", "message"],
        "properties": {"type": {"enum": ERROR_TYPES}, "message": {"type": "string"}},
    },
)
EVENTS["error"] = ERROR

TOKEN_COUNT = {
    "type": "object",
    "required": ["input_tokens"],
    "properties": {"input_tokens": {"type": "integer", "minimum": 0}},
}

MODEL_INFO = _event(
    "model",
    ["id", "display_name", "created_at"],
    id={"type": "string"},
    display_name={"type": "string"},
    created_at={"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}"},
)
MODEL_LIST = {
    "type": "object",
    "required": ["data", "first_id", "last_id", "has_more"],
    "properties": {
        "data": {"type": "array", "items": MODEL_INFO},
        "first_id": {"type": ["string", "null"]},
        "last_id": {"type": ["string", "null"]},
        "has_more": {"type": "boolean"},
    },
}


def check_event(name: str, data: dict[str, Any]) -> None:
    """An event's ``event:`` line names its JSON type, and it has its shape."""
    assert data["type"] == name, (name, data)
    check(data, EVENTS[name])
