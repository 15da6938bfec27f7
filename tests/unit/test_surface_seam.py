"""The seam a new surface plugs into: the route's surface reads the API key
and renders the errors; requests with no route get the default (OpenAI)
shape. Driven through the real ASGI app, with a second surface beside
OpenAI's as a new folder would add one."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from sluiceway.protocol.errors import ApiError, InvalidRequest
from sluiceway.server.app import Live, SluicewayApp, surface_routes
from sluiceway.server.config import ServerConfig
from sluiceway.server.routing import Router, merge_routes
from sluiceway.surfaces.base import Call, ErrorResponse, Headers, Serving, SurfaceHandler
from sluiceway.surfaces.openai import OpenAISurface
from sluiceway.surfaces.sse import sse

pytestmark = pytest.mark.anyio

KEY = "sekrit"


async def echo(serving: Serving, call: Call) -> None:
    body = await call.body()
    if body == b"fail":
        raise InvalidRequest("told to fail", param="body")
    if body == b"boom":
        raise RuntimeError("a bug")
    await call.send_json(json.dumps({"word": call.params["word"], "body": body.decode()}))


@dataclass(frozen=True, slots=True)
class EchoSurface:
    """A surface with Anthropic's habits: ``x-api-key``, a typed error body."""

    name: str = "echo"

    def routes(self) -> Mapping[str, Mapping[str, SurfaceHandler]]:
        return {"/v2/echo/{word}": {"POST": echo}}

    def render_error(self, error: ApiError) -> ErrorResponse:
        body = {"type": "error", "error": {"type": error.kind.value, "message": error.message}}
        return ErrorResponse(status=error.status, body=json.dumps(body).encode())

    def credentials(self, headers: Headers) -> str | None:
        return next((value.decode() for name, value in headers if name == b"x-api-key"), None)


def app_with_two_surfaces() -> SluicewayApp:
    speaks = (OpenAISurface(), EchoSurface())
    app = SluicewayApp(ServerConfig(api_key=KEY), speaks)
    router = Router(merge_routes(*(surface_routes(surface) for surface in speaks)))
    # No model: these routes never touch the serving context or the scheduler.
    app.live = Live(router, None, None)  # type: ignore[arg-type]
    return app


async def call(
    app: SluicewayApp, method: str, path: str, headers: Headers = (), body: bytes = b""
) -> tuple[int, dict[bytes, bytes], Any]:
    messages: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: Any) -> None:
        messages.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": list(headers)}
    await app(scope, receive, send)
    start, reply = messages
    return start["status"], dict(start["headers"]), json.loads(reply["body"])


async def test_a_route_answers_in_its_surface_and_takes_its_key() -> None:
    app = app_with_two_surfaces()
    status, _, body = await call(app, "POST", "/v2/echo/hi", [(b"x-api-key", KEY.encode())], b"x")
    assert (status, body) == (200, {"word": "hi", "body": "x"})
    # OpenAI's way of presenting the key is not this surface's.
    status, _, body = await call(
        app, "POST", "/v2/echo/hi", [(b"authorization", f"Bearer {KEY}".encode())]
    )
    assert status == 401
    assert body["error"]["type"] == "authentication"
    assert body["type"] == "error"


@pytest.mark.parametrize(
    ("payload", "status", "kind"), [(b"fail", 400, "invalid_request"), (b"boom", 500, "server")]
)
async def test_errors_are_rendered_by_the_routes_surface(
    payload: bytes, status: int, kind: str
) -> None:
    app = app_with_two_surfaces()
    got, _, body = await call(app, "POST", "/v2/echo/x", [(b"x-api-key", KEY.encode())], payload)
    assert got == status
    assert body == {"type": "error", "error": {"type": kind, "message": body["error"]["message"]}}


async def test_requests_without_a_route_get_the_default_surface() -> None:
    app = app_with_two_surfaces()
    bearer = [(b"authorization", f"Bearer {KEY}".encode())]
    status, headers, body = await call(app, "GET", "/v2/echo/x", bearer)
    assert (status, headers[b"allow"]) == (405, b"POST")
    assert body["error"]["code"] == "method_not_allowed"
    status, _, body = await call(app, "GET", "/nowhere", bearer)
    assert (status, body["error"]["type"], body["error"]["code"]) == (
        404,
        "not_found_error",
        "unknown_url",
    )
    # Without the key, a client learns nothing of the routes.
    status, _, body = await call(app, "GET", "/nowhere")
    assert (status, body["error"]["type"]) == (401, "authentication_error")
    status, _, body = await call(app, "GET", "/v1/models", [(b"authorization", b"Bearer no")])
    assert (status, body["error"]["code"]) == (401, "invalid_api_key")


async def test_while_loading_a_route_answers_503_in_its_surfaces_shape() -> None:
    """The model loads after the listener is up: until then a surface's
    route is a 503 with Retry-After, in that surface's shape."""
    app = SluicewayApp(ServerConfig(), (OpenAISurface(), EchoSurface()))
    status, headers, body = await call(app, "POST", "/v2/echo/x")
    assert (status, body["type"], body["error"]["type"]) == (503, "error", "server")
    assert headers[b"retry-after"] == b"1"
    status, _, body = await call(app, "GET", "/nowhere")
    assert (status, body["error"]["type"]) == (404, "not_found_error")


def test_a_route_claimed_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="routed twice"):
        merge_routes(surface_routes(EchoSurface()), surface_routes(EchoSurface()))


def test_sse_frames_can_name_their_event() -> None:
    assert sse('{"a":1}') == b'data: {"a":1}\n\n'
    assert sse("{}", event="message_start") == b"event: message_start\ndata: {}\n\n"
