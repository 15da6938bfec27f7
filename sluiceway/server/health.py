"""``GET /health``: the server's own route, in no API's dialect."""

from __future__ import annotations

import json

from sluiceway.server.state import ServerState
from sluiceway.surfaces.base import Call, Serving


async def health(state: ServerState, serving: Serving, call: Call) -> None:
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
    await call.send_json(json.dumps(body))
