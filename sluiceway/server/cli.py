"""``sluiceway serve``: run the app under Hypercorn (asyncio or trio worker)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence
from typing import Any

from sluiceway import __version__
from sluiceway.engines.select import DEVICES
from sluiceway.server.config import CHOICES, LOG_FORMAT, ServerConfig

#: Model loading (and building the default model) happens during start-up.
STARTUP_TIMEOUT_SECONDS = 900


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluiceway", description=__doc__)
    parser.add_argument("--version", action="version", version=f"sluiceway {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="start the OpenAI-compatible server")
    defaults = ServerConfig()
    helps = {
        "model": "local model directory or Hugging Face id (from the local cache); "
        "default: the embedded default model",
        "served_model_name": "the model name clients use (default: --model)",
        "engine": "model runner (auto: mlx on a Metal GPU, else transformers if torch imports, else mlx on the CPU)",
        "device": f"device of the transformers engine, one of {', '.join(DEVICES)} "
        "(auto: cuda if available)",
        "dtype": "weights dtype of the transformers engine (auto: the checkpoint's)",
        "engine_process": "run the engine in a child process with an interpreter (and GIL) "
        "of its own, instead of on a thread of the server's process (default: a child "
        "process for mlx on the CPU, the thread otherwise)",
        "host": "address to bind",
        "port": "port to bind",
        "worker_class": "Hypercorn worker class",
        "api_key": "require 'Authorization: Bearer KEY' on every route but /health and the "
        "playground page",
        "max_body_bytes": "largest request body accepted (413 beyond)",
        "max_num_seqs": "most sequences decoded together in one batch",
        "max_queued_requests": "most requests waiting for a slot (429 beyond)",
        "prefill_chunk_tokens": "prompt tokens prefilled per step, so running streams keep flowing",
        "prefix_cache": "reuse the KV of prompt prefixes earlier requests computed "
        "(--no-prefix-cache: prefill every prompt whole)",
        "prefix_cache_bytes": "most bytes the prefix cache holds, least recently used "
        "evicted first (default: min(free memory after loading / 4, 2^20 tokens of KV))",
        "keepalive_seconds": "SSE ': keepalive' comment interval while a streamed request waits",
        "max_top_logprobs": "largest top_logprobs / logprobs / prompt_logprobs accepted",
        "logprobs_mode": "raw: the model's distribution; processed: the one sampled from",
        "return_tokens_as_token_ids": "logprob tokens as 'token_id:N' for every request",
        "reasoning_field": "delta/message field(s) that carry reasoning text",
        "reasoning_parser": "how reasoning is told from content (auto: from the chat template)",
        "tool_call_parser": "how tool calls are parsed (auto: from the chat template)",
        "stop_in_reasoning": "match stop strings inside reasoning too",
        "default_chat_template_kwargs": "JSON object of chat template variables every request "
        "starts from, e.g. '{\"enable_thinking\": false}'; a request's chat_template_kwargs "
        "override them key by key",
        "cache_dir": "where the default model is built (default: $XDG_CACHE_HOME/sluiceway)",
        "playground": "serve the playground page at / and /playground (no API key needed)",
        "log_level": "logging level",
    }
    for spec in dataclasses.fields(ServerConfig):
        default = getattr(defaults, spec.name)
        options: dict[str, Any] = {"help": helps.get(spec.name, ""), "default": default}
        if spec.name in CHOICES:
            options["choices"] = CHOICES[spec.name]
        if isinstance(default, bool) or str(spec.type).startswith("bool"):
            options["action"] = argparse.BooleanOptionalAction
        elif isinstance(default, int) or str(spec.type).startswith("int"):
            options["type"] = int
        elif isinstance(default, float):
            options["type"] = float
        serve.add_argument(_flag(spec.name), **options)
    return parser


def hypercorn_config(config: ServerConfig) -> Any:
    from hypercorn.config import Config

    hyper = Config()
    hyper.bind = [f"{config.host}:{config.port}"]
    hyper.worker_class = config.worker_class
    hyper.startup_timeout = STARTUP_TIMEOUT_SECONDS
    hyper.accesslog = "-"
    hyper.errorlog = "-"
    hyper.loglevel = config.log_level.upper()
    return hyper


def serve(config: ServerConfig) -> None:
    from sluiceway.server.app import create_app

    app: Any = create_app(config)
    hyper = hypercorn_config(config)
    if config.worker_class == "trio":
        import trio
        from hypercorn.trio import serve as trio_serve

        trio.run(trio_serve, app, hyper)
    else:
        import asyncio

        from hypercorn.asyncio import serve as asyncio_serve

        asyncio.run(asyncio_serve(app, hyper))


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The configuration that ``serve``'s parsed flags describe."""
    return ServerConfig(
        **{spec.name: getattr(args, spec.name) for spec in dataclasses.fields(ServerConfig)}
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as error:
        print(f"sluiceway: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), format=LOG_FORMAT)
    serve(config)
    return 0
