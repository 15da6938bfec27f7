"""Routes surfaces share, through the real ASGI app: a header-picked route
beside another surface's (Anthropic's ``/v1/models``), a fallback that
yields to a surface routing its path (``HEAD /`` beside a page at ``/``);
and the Anthropic surface's error shapes and credentials."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from sluiceway.engines.base import EngineInfo
from sluiceway.parsers.registry import ParserChoice
from sluiceway.protocol.errors import (
    ApiError,
    AuthenticationFailed,
    InternalError,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    ServiceUnavailable,
)
from sluiceway.server.app import Live, SluicewayApp, surfaces_table
from sluiceway.server.config import ServerConfig
from sluiceway.server.routing import Router
from sluiceway.surfaces.anthropic import AnthropicSurface
from sluiceway.surfaces.base import Call, Headers, RouteSpec, Serving, Surface
from sluiceway.surfaces.openai import OpenAISurface
from tests.e2e import anthropic_schemas

pytestmark = pytest.mark.anyio

KEY = "sekrit"


async def page(serving: Serving, call: Call) -> None:
    await call.send_json('{"page": true}')


@dataclass(frozen=True, slots=True)
class PageSurface:
    """A surface with a page at ``/`` (as the playground has)."""

    name: str = "page"

    def routes(self) -> Mapping[str, Mapping[str, RouteSpec]]:
        return {"/": {"GET": page}}

    def render_error(self, error: ApiError) -> Any:
        return OpenAISurface().render_error(error)

    def credentials(self, headers: Headers) -> str | None:
        return None


def app_of(*speaks: Surface, api_key: str | None = KEY) -> SluicewayApp:
    # no playground: these tests put their own page at "/" (PageSurface)
    app = SluicewayApp(ServerConfig(api_key=api_key, playground=False), speaks)
    app.live = Live(Router(surfaces_table(speaks)), fake_serving(), None)  # type: ignore[arg-type]
    return app


def fake_serving() -> Serving:
    """What the model routes read; no model is loaded, nothing tokenizes."""
    return Serving(
        model_name="m",
        created=0,
        engine=EngineInfo(
            name="test", device="cpu", dtype="float32", vocab_size=8, max_context=4096
        ),
        tokenizer=None,  # type: ignore[arg-type]
        parsers=ParserChoice(None, None),
        max_num_seqs=1,
        max_top_logprobs=0,
        stop_in_reasoning=False,
    )


async def call(app: SluicewayApp, method: str, path: str, headers: Headers = ()) -> tuple[int, Any]:
    messages: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        messages.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": list(headers)}
    await app(scope, receive, send)
    start, reply = messages
    return start["status"], json.loads(reply["body"]) if reply["body"] else None


ANTHROPIC = [(b"anthropic-version", b"2023-06-01"), (b"x-api-key", KEY.encode())]
OPENAI = [(b"authorization", f"Bearer {KEY}".encode())]


async def test_the_model_list_answers_in_the_shape_of_the_client() -> None:
    app = app_of(OpenAISurface(), AnthropicSurface())
    status, body = await call(app, "GET", "/v1/models", ANTHROPIC)
    assert status == 200
    anthropic_schemas.check(body, anthropic_schemas.MODEL_LIST)
    status, body = await call(app, "GET", "/v1/models/m", ANTHROPIC)
    assert (status, body["type"], body["max_input_tokens"]) == (200, "model", 4096)
    status, body = await call(app, "GET", "/v1/models/other", ANTHROPIC)
    assert (status, body["type"], body["error"]["type"]) == (404, "error", "not_found_error")
    status, body = await call(app, "GET", "/v1/models", OPENAI)
    assert (status, body["object"]) == (200, "list")
    # Each route takes its own surface's key: an Anthropic client's x-api-key.
    status, body = await call(app, "GET", "/v1/models", [ANTHROPIC[0], OPENAI[0]])
    assert status == 200
    status, body = await call(app, "GET", "/v1/models", [ANTHROPIC[0]])
    assert (status, body["error"]["type"]) == (401, "authentication_error")
    assert body["type"] == "error"


async def test_a_header_route_serves_everything_where_no_other_surface_routes_its_path() -> None:
    app = app_of(AnthropicSurface())
    status, body = await call(app, "GET", "/v1/models", [(b"x-api-key", KEY.encode())])
    assert (status, body["data"][0]["id"]) == (200, "m")


async def test_root_answers_without_a_key_unless_another_surface_routes_it() -> None:
    status, _ = await call(app_of(OpenAISurface(), AnthropicSurface()), "HEAD", "/")
    assert status == 200
    # A page at "/" takes the path (HEAD is answered by its GET) and the
    # fallback steps aside instead of clashing.
    with_page = app_of(OpenAISurface(), AnthropicSurface(), PageSurface(), api_key=None)
    status, body = await call(with_page, "GET", "/")
    assert (status, body) == (200, {"page": True})
    status, body = await call(with_page, "HEAD", "/")
    assert (status, body) == (200, None)  # a HEAD reply has no body
    # Without a page, GET / is the fallback's too (HEAD should mirror GET).
    status, body = await call(app_of(OpenAISurface(), AnthropicSurface()), "GET", "/")
    assert (status, body) == (200, {})


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (InvalidRequest("bad"), 400, "invalid_request_error"),
        (AuthenticationFailed("who"), 401, "authentication_error"),
        (NotFound("where"), 404, "not_found_error"),
        (MethodNotAllowed("how", allowed=("POST",)), 405, "invalid_request_error"),
        (PayloadTooLarge("big"), 413, "request_too_large"),
        (Overloaded("queue full"), 429, "rate_limit_error"),
        (InternalError("oops"), 500, "api_error"),
        (ServiceUnavailable("draining"), 503, "overloaded_error"),
    ],
)
async def test_errors_in_anthropics_shape(error: ApiError, status: int, kind: str) -> None:
    rendered = AnthropicSurface().render_error(error)
    body = json.loads(rendered.body)
    anthropic_schemas.check(body, anthropic_schemas.ERROR)
    assert (rendered.status, body) == (
        status,
        {"type": "error", "error": {"type": kind, "message": error.message}},
    )


@pytest.mark.parametrize(
    ("headers", "key"),
    [
        ([(b"x-api-key", b"k")], "k"),
        ([(b"authorization", b"Bearer k")], "k"),
        ([(b"authorization", b"Bearer b"), (b"x-api-key", b"k")], "k"),
        ([(b"authorization", b"Basic k")], None),
        ([], None),
    ],
)
async def test_anthropic_credentials(headers: Headers, key: str | None) -> None:
    assert AnthropicSurface().credentials(headers) == key
