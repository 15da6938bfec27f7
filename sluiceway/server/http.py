"""Small ASGI helpers: reading a bounded body, sending bytes, JSON and errors."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from sluiceway.protocol.errors import (
    ApiError,
    MethodNotAllowed,
    Overloaded,
    PayloadTooLarge,
    ServiceUnavailable,
)
from sluiceway.surfaces.base import JSON_HEADERS, ErrorResponse, Headers

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

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


async def send_bytes(
    send: Send, status: int, body: bytes, headers: Headers, *, head: bool = False
) -> None:
    """A whole response; for a ``HEAD`` request (``head``) the headers only,
    with the length the body would have."""
    all_headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": b"" if head else body, "more_body": False})


async def send_json_text(send: Send, text: str, status: int = 200) -> None:
    await send_bytes(send, status, text.encode("utf-8"), JSON_HEADERS)


def error_headers(error: ApiError) -> Headers:
    """The HTTP headers an error calls for, whatever the surface."""
    if isinstance(error, MethodNotAllowed):
        return [(b"allow", ", ".join(error.allowed).encode())]
    if isinstance(error, Overloaded | ServiceUnavailable):
        return [(b"retry-after", str(error.retry_after_seconds).encode())]
    return []


async def send_error(send: Send, error: ApiError, rendered: ErrorResponse) -> None:
    headers = [*rendered.headers, *error_headers(error)]
    await send_bytes(send, rendered.status, rendered.body, headers)
