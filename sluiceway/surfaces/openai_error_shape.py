"""OpenAI's error body, ``{"error": {message, type, param, code}}``, shared by
the three surfaces that speak it: chat and completions, Responses, and the
tokens endpoints (vLLM answers those in OpenAI's shape too).

It is shared code, not a surface: it lives beside ``sse.py`` rather than in
``openai/`` because a surface folder never imports another, and its name
says what it holds (the shape of an error, not the OpenAI surface's errors).
Each of the three renders through this one module so that a 401's
``WWW-Authenticate`` or a new error kind cannot be added to one of them and
forgotten in the others.
"""

from __future__ import annotations

from types import MappingProxyType

from sluiceway.protocol.errors import ApiError, ErrorKind
from sluiceway.surfaces.base import JSON_HEADERS, ErrorResponse
from sluiceway.surfaces.sse import sse
from sluiceway.surfaces.wire import WireModel

#: OpenAI's ``type`` for each kind. A full queue has been a 429
#: ``rate_limit_error`` since the first release; OpenAI has no "overloaded".
ERROR_TYPES = MappingProxyType(
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


class ErrorDetail(WireModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(WireModel):
    error: ErrorDetail


def error_body(
    message: str, kind: ErrorKind, param: str | None = None, code: str | None = None
) -> str:
    detail = ErrorDetail(message=message, type=ERROR_TYPES[kind], param=param, code=code)
    return ErrorBody(error=detail).to_json()


def render_error(error: ApiError) -> ErrorResponse:
    headers = JSON_HEADERS
    if error.kind is ErrorKind.AUTHENTICATION:
        # RFC 9110: a 401 names the scheme the client should use.
        headers = (*JSON_HEADERS, (b"www-authenticate", b"Bearer"))
    body = error_body(error.message, error.kind, error.param, error.code)
    return ErrorResponse(status=error.status, body=body.encode("utf-8"), headers=headers)


def error_frame(message: str) -> bytes:
    """A failure in the middle of a stream (the status line is long gone)."""
    return sse(error_body(message, ErrorKind.SERVER))
