"""``/openapi.json`` as the server builds it: every surface's models, each
reference resolving to its own model."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from sluiceway.server.app import surfaces
from sluiceway.server.config import ServerConfig
from sluiceway.server.openapi import document


@pytest.fixture(scope="module")
def raw() -> str:
    return document(surfaces(ServerConfig())).decode()


def body_ref(operation: dict[str, Any], status: str = "200") -> str:
    if status == "request":
        schema = operation["requestBody"]["content"]["application/json"]["schema"]
    else:
        schema = operation["responses"][status]["content"]["application/json"]["schema"]
    ref: str = schema["$ref"]
    return ref.rpartition("/")[2]


def test_every_reference_resolves(raw: str) -> None:
    schemas = json.loads(raw)["components"]["schemas"]
    refs = set(re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', raw))
    assert refs
    assert refs <= set(schemas)


@pytest.mark.parametrize(
    ("path", "request_model", "reply", "event"),
    [
        ("/v1/chat/completions", "ChatRequest", "ChatCompletion", "ChatChunk"),
        ("/v1/messages", "MessagesRequest", "anthropic__wire__MessageWire", "MessageStreamEvent"),
        ("/v1/responses", "ResponsesRequest", "ResponseWire", "ResponseStreamEvent"),
    ],
)
def test_each_surface_describes_its_request_reply_and_events(
    raw: str, path: str, request_model: str, reply: str, event: str
) -> None:
    operation = json.loads(raw)["paths"][path]["post"]
    assert body_ref(operation, "request") == request_model
    assert body_ref(operation).endswith(reply)
    stream = operation["responses"]["200"]["content"]["text/event-stream"]
    assert stream["x-event-schema"]["$ref"].endswith("/" + event)


def test_same_named_models_of_two_surfaces_stay_apart(raw: str) -> None:
    paths = json.loads(raw)["paths"]
    chat, messages, responses = (
        body_ref(paths[path]["post"], "4XX")
        for path in ("/v1/chat/completions", "/v1/messages", "/v1/responses")
    )
    # The OpenAI-shaped surfaces share one error body; Anthropic's, of the
    # same class name, must not be mistaken for it.
    assert chat == responses != messages
    assert all(name.endswith("ErrorBody") for name in (chat, messages))
    assert body_ref(paths["/v1/messages/count_tokens"]["post"]) == "TokenCount"
