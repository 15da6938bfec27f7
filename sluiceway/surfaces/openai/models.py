"""``GET /v1/models`` and ``GET /v1/models/{model}``."""

from __future__ import annotations

from sluiceway.protocol.errors import NotFound
from sluiceway.surfaces.base import Call, Serving
from sluiceway.surfaces.openai.wire import ModelCard, ModelList


def model_card(serving: Serving) -> ModelCard:
    return ModelCard(
        id=serving.model_name,
        created=serving.created,
        owned_by="sluiceway",
        engine=serving.engine.name,
        max_model_len=serving.max_context,
    )


async def models(serving: Serving, call: Call) -> None:
    await call.send_json(ModelList(data=[model_card(serving)]).to_json())


async def model(serving: Serving, call: Call) -> None:
    name = call.params["model"]
    if name != serving.model_name:
        raise NotFound(f"The model '{name}' does not exist", param="model", code="model_not_found")
    await call.send_json(model_card(serving).to_json())
