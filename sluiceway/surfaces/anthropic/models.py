"""``GET /v1/models`` and ``GET /v1/models/{model}`` in Anthropic's shape,
for requests that carry ``anthropic-version`` (the Anthropic SDKs send it
with every request; OpenAI's do not)."""

from __future__ import annotations

from datetime import UTC, datetime

from sluiceway.protocol.errors import NotFound
from sluiceway.surfaces.anthropic.wire import ModelInfo, ModelListWire
from sluiceway.surfaces.base import Call, Headers, Serving

VERSION_HEADER = b"anthropic-version"


def speaks_anthropic(headers: Headers) -> bool:
    """Whether a request comes from an Anthropic client."""
    return any(name == VERSION_HEADER for name, _ in headers)


def model_info(serving: Serving) -> ModelInfo:
    loaded = datetime.fromtimestamp(serving.created, UTC)
    return ModelInfo(
        id=serving.model_name,
        display_name=serving.model_name,
        created_at=loaded.isoformat().replace("+00:00", "Z"),
        max_input_tokens=serving.max_context,
        max_tokens=serving.max_context,
    )


async def models(serving: Serving, call: Call) -> None:
    name = serving.model_name
    listing = ModelListWire(data=[model_info(serving)], first_id=name, last_id=name)
    await call.send_json(listing.to_json())


async def model(serving: Serving, call: Call) -> None:
    name = call.params["model"]
    if name != serving.model_name:
        raise NotFound(f"model: {name} (this server serves {serving.model_name})")
    await call.send_json(model_info(serving).to_json())
