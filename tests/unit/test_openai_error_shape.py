"""The three OpenAI-shaped surfaces (chat and completions, Responses, tokens)
render every error the same way: OpenAI's body, the type for each kind, and
a 401 that names the Bearer scheme."""

from __future__ import annotations

import json

import pytest

from sluiceway.protocol.errors import (
    ApiError,
    AuthenticationFailed,
    InternalError,
    InvalidRequest,
    Overloaded,
    PayloadTooLarge,
)
from sluiceway.surfaces.base import Surface
from sluiceway.surfaces.openai import OpenAISurface
from sluiceway.surfaces.responses import ResponsesSurface
from sluiceway.surfaces.tokens import TokensSurface

SURFACES: tuple[Surface, ...] = (OpenAISurface(), ResponsesSurface(), TokensSurface())

CASES: tuple[tuple[ApiError, int, str], ...] = (
    (InvalidRequest("bad", param="messages[0]", code="x"), 400, "invalid_request_error"),
    (AuthenticationFailed("no key"), 401, "authentication_error"),
    (PayloadTooLarge("big"), 413, "invalid_request_error"),
    (Overloaded("full"), 429, "rate_limit_error"),
    (InternalError("boom"), 500, "server_error"),
)


@pytest.mark.parametrize("surface", SURFACES, ids=lambda s: s.name)
@pytest.mark.parametrize(("error", "status", "kind"), CASES, ids=lambda c: str(c))
def test_each_openai_shaped_surface_renders_the_same_body(
    surface: Surface, error: ApiError, status: int, kind: str
) -> None:
    rendered = surface.render_error(error)
    assert rendered.status == status
    body = json.loads(rendered.body)
    assert body == {
        "error": {"message": error.message, "type": kind, "param": error.param, "code": error.code}
    }
    headers = dict(rendered.headers)
    assert headers[b"content-type"].startswith(b"application/json")
    assert (headers.get(b"www-authenticate") == b"Bearer") is (status == 401)
