"""``GET /v1/models``, ``GET /v1/models/{id}`` and ``GET /health``."""

from __future__ import annotations

import json

from sluiceway.protocol.errors import NotFound
from sluiceway.protocol.wire import ModelCard, ModelList
from sluiceway.server.http import Receive, Scope, Send, send_json_text
from sluiceway.server.state import ServerState


def model_card(state: ServerState) -> ModelCard:
    return ModelCard(
        id=state.model_name,
        created=state.model.created,
        owned_by="sluiceway",
        engine=state.model.engine.info.name,
        max_model_len=state.max_context,
    )


async def models(state: ServerState, scope: Scope, receive: Receive, send: Send) -> None:
    await send_json_text(send, ModelList(data=[model_card(state)]).to_json())


async def model(state: ServerState, scope: Scope, receive: Receive, send: Send) -> None:
    name = scope["path"].rstrip("/").removeprefix("/v1/models/")
    if name != state.model_name:
        raise NotFound(f"The model '{name}' does not exist", param="model", code="model_not_found")
    await send_json_text(send, model_card(state).to_json())


async def health(state: ServerState, scope: Scope, receive: Receive, send: Send) -> None:
    info = state.model.engine.info
    scheduler = state.scheduler
    body = {
        "status": "ok",
        "model": state.model_name,
        "engine": {"name": info.name, "device": info.device, "dtype": info.dtype},
        "scheduler": {
            "running_requests": scheduler.running_requests,
            "running_sequences": scheduler.running_rows,
            "queued_requests": scheduler.queued,
        },
    }
    await send_json_text(send, json.dumps(body))
