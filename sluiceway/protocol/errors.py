"""Errors a client can cause, as a typed hierarchy.

Each carries the HTTP status and the OpenAI error ``type``/``param``/``code``;
only ``sluiceway.server`` turns them into response bodies.
"""

from __future__ import annotations


class ClientError(Exception):
    """A request the server refuses because of something the client sent."""

    status: int = 400
    error_type: str = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequest(ClientError):
    """Malformed JSON, a missing or mistyped field, or an out-of-range value."""


class InvalidConstraint(InvalidRequest):
    """A schema, regex or grammar the grammar engine cannot compile (or not
    within the time limit); the message is the engine's."""


class AuthenticationFailed(ClientError):
    status = 401
    error_type = "authentication_error"


class NotFound(ClientError):
    status = 404
    error_type = "not_found_error"


class MethodNotAllowed(ClientError):
    status = 405
    error_type = "invalid_request_error"

    def __init__(self, message: str, *, allowed: tuple[str, ...]) -> None:
        super().__init__(message, code="method_not_allowed")
        self.allowed = allowed


class PayloadTooLarge(ClientError):
    status = 413
    error_type = "invalid_request_error"


class Overloaded(ClientError):
    """The waiting queue is full; the client should retry later."""

    status = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after_seconds: int = 1) -> None:
        super().__init__(message, code="queue_full")
        self.retry_after_seconds = retry_after_seconds


class ServiceUnavailable(ClientError):
    status = 503
    error_type = "server_error"
