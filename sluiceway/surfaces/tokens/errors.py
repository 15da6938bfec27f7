"""The tokens surface's errors: OpenAI's body, ``{"error": {message, type,
param, code}}`` (vLLM's OpenAI-compatible server answers its tokens endpoint
in the same shape), before a reply starts and as a frame inside a stream."""

from __future__ import annotations

import json
from types import MappingProxyType

from sluiceway.protocol.errors import ApiError, ErrorKind
from sluiceway.surfaces.base import ErrorResponse
from sluiceway.surfaces.sse import sse

TYPES = MappingProxyType(
    {
        ErrorKind.INVALID_REQUEST: "invalid_request_error",
        ErrorKind.AUTHENTICATION: "authentication_error",
        ErrorKind.NOT_FOUND: "not_found_error",
        ErrorKind.REQUEST_TOO_LARGE: "invalid_request_error",
        ErrorKind.RATE_LIMITED: "rate_limit_error",
        ErrorKind.OVERLOADED: "rate_limit_error",
        ErrorKind.SERVER: "server_error",
    }
)


def _body(message: str, kind: ErrorKind, param: str | None, code: str | None) -> str:
    detail = {"message": message, "type": TYPES[kind], "param": param, "code": code}
    return json.dumps({"error": detail}, ensure_ascii=False, separators=(",", ":"))


def render_error(error: ApiError) -> ErrorResponse:
    body = _body(error.message, error.kind, error.param, error.code)
    return ErrorResponse(status=error.status, body=body.encode("utf-8"))


def error_frame(message: str) -> bytes:
    """A failure in the middle of a stream (the status line is long gone)."""
    return sse(_body(message, ErrorKind.SERVER, None, None))
