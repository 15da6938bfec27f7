"""The Responses API's error body: OpenAI's ``{"error": {message, type,
param, code}}``, from the neutral typed errors.

The same body as the OpenAI surface renders: a surface folder never imports
another, so the two OpenAI surfaces each spell it.
"""

from __future__ import annotations

from types import MappingProxyType

from sluiceway.protocol.errors import ApiError, ErrorKind
from sluiceway.surfaces.base import ErrorResponse
from sluiceway.surfaces.wire import WireModel

#: OpenAI's ``type`` for each kind (a full queue is a 429 ``rate_limit_error``).
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


def render_error(error: ApiError) -> ErrorResponse:
    body = ErrorBody(
        error=ErrorDetail(
            message=error.message,
            type=ERROR_TYPES[error.kind],
            param=error.param,
            code=error.code,
        )
    )
    return ErrorResponse(status=error.status, body=body.to_json().encode("utf-8"))
