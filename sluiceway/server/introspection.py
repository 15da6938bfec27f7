"""The server's own routes about itself, in no API's dialect: liveness and
readiness, Prometheus metrics, and the discovery and load routes that
gateways query.

``/version``, ``/server_info``, ``/model_info`` and ``/v1/loads`` have the
shapes Shepherd Model Gateway (smg) reads: it identifies an HTTP worker by
``/version`` (and reads its model's path, name and context length from
``/v1/models``), and prefers ``/v1/loads`` (SGLang's load report) to
scraping ``/metrics`` for the load its cache-aware policy balances on.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

from sluiceway import __version__
from sluiceway.server.lifecycle import Lifecycle
from sluiceway.server.metrics import CONTENT_TYPE, LoadSnapshot
from sluiceway.surfaces.base import Call, Serving


async def _send(call: Call, body: dict[str, Any], status: int = 200) -> None:
    await call.send_json(json.dumps(body), status)


def _scheduler_body(load: LoadSnapshot | None) -> dict[str, int]:
    if load is None:
        return {}
    return {
        "running_requests": load.running_requests,
        "running_sequences": load.running_sequences,
        "queued_requests": load.waiting_requests,
        "paused_requests": load.paused_requests,
    }


async def health(lifecycle: Lifecycle, serving: Serving, call: Call) -> None:
    """Liveness: 200 while the process can serve."""
    alive, state = lifecycle.liveness()
    body: dict[str, Any] = {"status": state, "model": lifecycle.config.model_name}
    if lifecycle.model is not None:
        info = lifecycle.model.engine.info
        body["engine"] = {"name": info.name, "device": info.device, "dtype": info.dtype}
        body["scheduler"] = _scheduler_body(lifecycle.load())
    await _send(call, body, 200 if alive else 503)


async def ready(lifecycle: Lifecycle, serving: Serving, call: Call) -> None:
    """Readiness: 200 while new requests are welcome here."""
    is_ready, state = lifecycle.readiness()
    await _send(call, {"status": state}, 200 if is_ready else 503)


async def metrics(lifecycle: Lifecycle, serving: Serving, call: Call) -> None:
    body = lifecycle.metrics.exposition()
    await call.send_bytes(200, body, [(b"content-type", CONTENT_TYPE.encode())])


async def version(lifecycle: Lifecycle, serving: Serving, call: Call) -> None:
    await _send(call, {"version": __version__, "server": "sluiceway"})


async def server_info(lifecycle: Lifecycle, serving: Serving, call: Call) -> None:
    """The server's configuration, in SGLang's field names where it has one."""
    config = lifecycle.config
    body: dict[str, Any] = {
        "server": "sluiceway",
        "version": __version__,
        "served_model_name": config.model_name,
        "model_path": str(lifecycle.model.source.path) if lifecycle.model else config.model,
        "tp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "is_embedding": False,
        "max_running_requests": config.max_num_seqs,
        "max_queued_requests": config.max_queued_requests,
        "chunked_prefill_size": config.prefill_chunk_tokens,
        "stream_interval": config.stream_interval,
    }
    if lifecycle.model is not None:
        info = lifecycle.model.engine.info
        body |= {
            "context_length": info.max_context,
            "max_total_tokens": info.max_context * config.max_num_seqs,
            "engine": info.name,
            "device": info.device,
            "dtype": info.dtype,
        }
        if info.threads:
            body["engine_threads"] = info.threads
            body["engine_threads_tuned"] = info.threads_tuned
    await _send(call, body)


async def model_info(lifecycle: Lifecycle, serving: Serving, call: Call) -> None:
    model = lifecycle.model
    if model is None:
        await _send(call, {"model_path": lifecycle.config.model, "is_generation": True})
        return
    path = str(model.source.path)
    await _send(
        call,
        {
            "model_path": path,
            "tokenizer_path": path,
            "served_model_name": lifecycle.config.model_name,
            "is_generation": True,
            "model_type": model.source.config.get("model_type"),
            "architectures": model.source.config.get("architectures"),
            "context_length": model.engine.info.max_context,
        },
    )


async def loads(lifecycle: Lifecycle, serving: Serving, call: Call) -> None:
    """The scheduler's load as one data-parallel rank (SGLang's ``/v1/loads``)."""
    load = lifecycle.load()
    ranks = []
    if load is not None:
        ranks.append(
            {
                "dp_rank": 0,
                "num_running_reqs": load.running_requests,
                "num_waiting_reqs": load.waiting_requests,
                "num_total_reqs": load.running_requests + load.waiting_requests,
                "num_used_tokens": load.cached_tokens,
                "max_total_num_tokens": load.capacity_tokens,
                "token_usage": load.kv_usage,
                "utilization": load.running_sequences / max(load.max_num_seqs, 1),
                "max_running_requests": load.max_num_seqs,
            }
        )
    now = datetime.datetime.now(datetime.UTC).isoformat()
    await _send(call, {"timestamp": now, "dp_rank_count": len(ranks), "loads": ranks})
