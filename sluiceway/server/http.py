"""Small ASGI helpers: reading a bounded body, sending JSON and SSE, errors."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from sluiceway.protocol.errors import (
    ClientError,
    InvalidRequest,
    MethodNotAllowed,
    Overloaded,
    PayloadTooLarge,
)
from sluiceway.protocol.wire import ErrorBody, ErrorDetail

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class ClientDisconnected(Exception):
    """The client went away while we were reading its request."""


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """Read the whole request body, refusing (413) past ``limit`` bytes."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise PayloadTooLarge(f"the request body is over the {limit}-byte limit")
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"the request body is over the {limit}-byte limit")
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def parse_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InvalidRequest(f"the request body is not valid JSON: {error}") from error


async def send_bytes(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    all_headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_json_text(send: Send, text: str, status: int = 200) -> None:
    await send_bytes(send, status, text.encode("utf-8"), JSON_HEADERS)


def error_body(error: ClientError) -> str:
    return ErrorBody(
        error=ErrorDetail(
            message=error.message, type=error.error_type, param=error.param, code=error.code
        )
    ).to_json()


async def send_error(send: Send, error: ClientError) -> None:
    headers = list(JSON_HEADERS)
    if isinstance(error, MethodNotAllowed):
        headers.append((b"allow", ", ".join(error.allowed).encode()))
    if isinstance(error, Overloaded):
        headers.append((b"retry-after", str(error.retry_after_seconds).encode()))
    await send_bytes(send, error.status, error_body(error).encode("utf-8"), headers)


async def send_server_error(send: Send, message: str) -> None:
    body = ErrorBody(
        error=ErrorDetail(message=message, type="server_error", param=None, code=None)
    ).to_json()
    await send_bytes(send, 500, body.encode("utf-8"), JSON_HEADERS)
