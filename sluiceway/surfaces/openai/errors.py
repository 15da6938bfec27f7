"""OpenAI's error body, ``{"error": {message, type, param, code}}``, from
the neutral typed errors."""

from __future__ import annotations

from types import MappingProxyType

from sluiceway.protocol.errors import ApiError, ErrorKind
from sluiceway.surfaces.base import JSON_HEADERS, ErrorResponse
from sluiceway.surfaces.openai.wire import ErrorBody, ErrorDetail

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


def error_body(error: ApiError) -> str:
    return ErrorBody(
        error=ErrorDetail(
            message=error.message,
            type=ERROR_TYPES[error.kind],
            param=error.param,
            code=error.code,
        )
    ).to_json()


def render_error(error: ApiError) -> ErrorResponse:
    headers = JSON_HEADERS
    if error.kind is ErrorKind.AUTHENTICATION:
        # RFC 9110: a 401 names the scheme the client should use.
        headers = (*JSON_HEADERS, (b"www-authenticate", b"Bearer"))
    return ErrorResponse(
        status=error.status, body=error_body(error).encode("utf-8"), headers=headers
    )
