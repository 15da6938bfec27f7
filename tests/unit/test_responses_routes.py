"""The Responses surface's routes through the real ASGI app: its key is read
the OpenAI way, its errors have the OpenAI body, and the stored-response
routes of a stateless server answer 404 saying why."""

from __future__ import annotations

import pytest

from sluiceway.server.app import Live, SluicewayApp, surface_routes, surfaces
from sluiceway.server.config import ServerConfig
from sluiceway.server.routing import Router, merge_routes
from sluiceway.surfaces.responses import ResponsesSurface
from tests.unit.test_surface_seam import KEY, call

pytestmark = pytest.mark.anyio

BEARER = [(b"authorization", f"Bearer {KEY}".encode())]


def app() -> SluicewayApp:
    speaks = surfaces(ServerConfig(api_key=KEY))
    assert any(isinstance(surface, ResponsesSurface) for surface in speaks)
    server = SluicewayApp(ServerConfig(api_key=KEY), speaks)
    router = Router(merge_routes(*(surface_routes(surface) for surface in speaks)))
    # No model: these routes never touch the serving context or the scheduler.
    server.live = Live(router, None, None)  # type: ignore[arg-type]
    return server


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/responses/resp_1"),
        ("DELETE", "/v1/responses/resp_1"),
        ("GET", "/v1/responses/resp_1/input_items"),
        ("POST", "/v1/responses/resp_1/cancel"),
    ],
)
async def test_stored_responses_are_not_found(method: str, path: str) -> None:
    status, _, body = await call(app(), method, path, BEARER)
    assert status == 404
    assert body["error"]["type"] == "not_found_error"
    assert body["error"]["code"] == "response_not_found"
    assert "'resp_1'" in body["error"]["message"]
    assert "stateless" in body["error"]["message"]


async def test_the_key_is_a_bearer_token() -> None:
    status, _, body = await call(
        app(), "GET", "/v1/responses/resp_1", [(b"x-api-key", KEY.encode())]
    )
    assert (status, body["error"]["type"]) == (401, "authentication_error")


async def test_a_body_that_is_not_json_is_a_400_in_the_openai_shape() -> None:
    status, _, body = await call(app(), "POST", "/v1/responses", BEARER, b"{nope")
    assert status == 400
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
