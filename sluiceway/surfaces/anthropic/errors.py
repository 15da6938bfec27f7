"""Anthropic's error body, ``{"type": "error", "error": {"type", "message"}}``,
with its status codes, from the neutral typed errors."""

from __future__ import annotations

from types import MappingProxyType

from sluiceway.protocol.errors import ApiError, ErrorKind, ServiceUnavailable
from sluiceway.surfaces.anthropic.wire import ErrorBody, ErrorDetail
from sluiceway.surfaces.base import ErrorResponse

#: Anthropic's ``type`` for each kind. A full queue is a 429, which Anthropic
#: calls ``rate_limit_error``; ``overloaded_error`` is a server that takes no
#: work now (503, while draining), which Anthropic answers with 529.
ERROR_TYPES = MappingProxyType(
    {
        ErrorKind.INVALID_REQUEST: "invalid_request_error",
        ErrorKind.AUTHENTICATION: "authentication_error",
        ErrorKind.NOT_FOUND: "not_found_error",
        ErrorKind.REQUEST_TOO_LARGE: "request_too_large",
        ErrorKind.RATE_LIMITED: "rate_limit_error",
        ErrorKind.OVERLOADED: "rate_limit_error",
        ErrorKind.SERVER: "api_error",
    }
)


def error_type(error: ApiError) -> str:
    if isinstance(error, ServiceUnavailable):
        return "overloaded_error"
    return ERROR_TYPES[error.kind]


def error_body(kind: str, message: str) -> str:
    return ErrorBody(error=ErrorDetail(type=kind, message=message)).to_json()


def render_error(error: ApiError) -> ErrorResponse:
    body = error_body(error_type(error), error.message)
    return ErrorResponse(status=error.status, body=body.encode("utf-8"))
