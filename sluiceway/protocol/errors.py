"""Errors a request can end in, as a typed hierarchy.

Each carries the HTTP status, a neutral :class:`ErrorKind`, the parameter it
is about and a machine-readable code. No API's spelling lives here: each
surface's error renderer (``sluiceway.surfaces.<name>``) turns the kind into
its own ``type`` and body (OpenAI's ``{"error": {...}}``, Anthropic's
``{"type": "error", "error": {...}}``).
"""

from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    """What went wrong, in neutral terms; each surface spells it."""

    INVALID_REQUEST = "invalid_request"
    AUTHENTICATION = "authentication"
    NOT_FOUND = "not_found"
    REQUEST_TOO_LARGE = "request_too_large"
    RATE_LIMITED = "rate_limited"
    OVERLOADED = "overloaded"
    SERVER = "server"


class ApiError(Exception):
    """An error that ends a request with a status and an error body."""

    status: int = 500
    kind: ErrorKind = ErrorKind.SERVER

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ClientError(ApiError):
    """A request the server refuses because of something the client sent
    (or, for the 429/503 kinds, because of the moment it sent it)."""

    status = 400
    kind = ErrorKind.INVALID_REQUEST


class InvalidRequest(ClientError):
    """Malformed JSON, a missing or mistyped field, or an out-of-range value."""


class InvalidConstraint(InvalidRequest):
    """A schema, regex or grammar the grammar engine cannot compile (or not
    within the time limit); the message is the engine's."""


class AuthenticationFailed(ClientError):
    status = 401
    kind = ErrorKind.AUTHENTICATION


class NotFound(ClientError):
    status = 404
    kind = ErrorKind.NOT_FOUND


class MethodNotAllowed(ClientError):
    status = 405
    kind = ErrorKind.INVALID_REQUEST

    def __init__(self, message: str, *, allowed: tuple[str, ...]) -> None:
        super().__init__(message, code="method_not_allowed")
        self.allowed = allowed


class PayloadTooLarge(ClientError):
    status = 413
    kind = ErrorKind.REQUEST_TOO_LARGE


class Overloaded(ClientError):
    """The waiting queue is full; the client should retry later."""

    status = 429
    kind = ErrorKind.OVERLOADED

    def __init__(self, message: str, *, retry_after_seconds: int = 1) -> None:
        super().__init__(message, code="queue_full")
        self.retry_after_seconds = retry_after_seconds


class ServiceUnavailable(ClientError):
    """The server cannot take the request now (loading, draining, its engine
    restarting); the client should retry, here or elsewhere."""

    status = 503
    kind = ErrorKind.SERVER

    def __init__(self, message: str, *, retry_after_seconds: int = 1) -> None:
        super().__init__(message, code="unavailable")
        self.retry_after_seconds = retry_after_seconds


class DeadlineExceeded(ApiError):
    """The request ran past the server's time limit (``--request-timeout``)."""

    status = 504
    kind = ErrorKind.SERVER


class InternalError(ApiError):
    """The server failed on its own (an unhandled exception): 500."""
