"""``sluiceway serve``: run the app under Hypercorn (asyncio or trio worker).

Shutdown: the first SIGTERM or SIGINT drains the app (it stops admitting
and gives running requests ``--shutdown-timeout`` to finish, while Hypercorn
keeps listening so that late requests get a 503 rather than a refused
connection); then Hypercorn's own graceful shutdown closes the listener and
the connections, which are idle by then. A second signal ends the grace
period at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio

if TYPE_CHECKING:
    from sluiceway.server.app import SluicewayApp

from sluiceway import __version__
from sluiceway.engines.device import DEVICES
from sluiceway.server.config import CHOICES, LOG_FORMAT, ServerConfig

#: Model loading (and building the default model) happens during start-up.
STARTUP_TIMEOUT_SECONDS = 900
#: Hypercorn's grace period, after the app's drain: the last frames of the
#: streams cut off at the end of the drain, and idle keep-alive connections.
GRACEFUL_TIMEOUT_SECONDS = 5.0


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
        "engine": "model runner (auto: mlx on a Metal GPU, else transformers if torch imports, "
        "else mlx on the CPU; vllm: vLLM's engine, from the sluiceway[vllm] extra)",
        "device": f"device of the transformers engine, one of {', '.join(DEVICES)} "
        "(auto: cuda if available)",
        "dtype": "weights dtype of the transformers and vllm engines (auto, as vLLM's: "
        "bfloat16 on a CPU with AVX512-BF16 or AMX and on GPUs, else float32; float32 keeps "
        "logprobs exact)",
        "compile": "transformers on the CPU: the decode step through torch.compile, one graph "
        "per batch size bucket (1, 2, 4, ... up to --compile-max-batch); auto (default): at "
        "start-up, time each bucket's compiled step against the eager one and keep the "
        "buckets up to the first that is not at least 1.1x faster, compiled before serving "
        "(the verdicts are stored per model and machine; docs/engines.md); on: always, "
        "each bucket on the first step of its size (seconds to a minute); off: eager. "
        "Where the one-row step is compiled, new prompts prefill through one compiled graph "
        "too. Eager wherever compiling fails",
        "compile_max_batch": "with --compile auto or on, the largest batch bucket compiled; "
        "larger batches decode eagerly",
        "prepack": "transformers on the CPU with bfloat16 weights: reorder each linear layer's "
        "weights once, at load, into oneDNN's blocked layout, instead of on every matrix "
        "product (default; faster steps, the same outputs; docs/engines.md)",
        "frozen_weights": "transformers on the CPU with bfloat16 weights and a compiled "
        "decode step: freeze the weights into the step's graphs, whose matrix products "
        "are then Inductor's own C++ loops over a copy it packs (1.4-1.56x faster steps at "
        "1-16 rows on the 42M benchmark model; three more copies of the linear layers' "
        "matrices; compiled at every start). auto (default): where the copies take at most "
        "an eighth of the memory free at start-up; on; off (docs/engines.md)",
        "engine_process": "run the engine in a child process with an interpreter (and GIL) "
        "of its own, instead of on a thread of the server's process (default: a child "
        "process on the CPU, the thread on a GPU)",
        "engine_threads": "CPU threads of the transformers engine (0: $OMP_NUM_THREADS, else "
        "every core, and in a child process each batch size runs on every core or one "
        "fewer, whichever its steps measure faster; docs/architecture.md); for mlx, "
        "OpenBLAS's thread count where its CPU backend runs on OpenBLAS (0: OpenBLAS's own); "
        "for vllm on the CPU with VLLM_CPU_OMP_THREADS_BIND=nobind, each worker's threads "
        "(0: $OMP_NUM_THREADS, else the cores left after one per worker, as vLLM's own "
        "binding keeps free)",
        "host": "address to bind",
        "port": "port to bind",
        "worker_class": "Hypercorn worker class",
        "api_key": "require 'Authorization: Bearer KEY' on every route but the public ones "
        "(/health, /ready, /metrics, /version, /openapi.json, the playground page); "
        "default: $SLUICEWAY_API_KEY (a flag's value shows in ps)",
        "api_key_file": "read the API key from the first line of this file",
        "max_body_bytes": "largest request body accepted (413 beyond)",
        "max_num_seqs": "most sequences decoded together in one batch",
        "max_queued_requests": "most requests waiting for a slot (429 beyond)",
        "prefill_chunk_tokens": "prompt tokens prefilled per step, so running streams keep flowing",
        "prefix_cache": "reuse the KV of prompt prefixes earlier requests computed "
        "(--no-prefix-cache: prefill every prompt whole)",
        "prefix_cache_bytes": "most bytes the prefix cache holds, least recently used "
        "evicted first (default: min(free memory after loading / 4, 2^20 tokens of KV))",
        "keepalive_seconds": "SSE ': keepalive' comment interval while a streamed request waits",
        "stream_interval": "after a stream's first token, write its frames once every N "
        "steps (and at its end) instead of every step: the same frames, fewer writes, "
        "less server CPU per token, burstier arrival (1 to 32)",
        "shutdown_timeout": "seconds running requests get to finish after SIGTERM/SIGINT; "
        "then their streams end with an error event",
        "stall_timeout": "a request whose client reads nothing for this many seconds is "
        "cancelled and its slot freed (0: never)",
        "request_timeout": "a request still running after this many seconds ends with an "
        "error (0: no limit)",
        "release_memory_after": "once no request has run for this many seconds, the engine "
        "drops buffers it keeps for reuse and the heap's free pages go back to the system "
        "(0: never)",
        "allowed_origins": "origins allowed to call the API from a browser (CORS): '*' or a "
        "comma-separated list (default: none)",
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
        "grammar_compile_timeout": "seconds a structured-output schema or grammar may take "
        "to compile; a slower one is refused with a 400",
        "cache_dir": "where the default model is built (default: $XDG_CACHE_HOME/sluiceway)",
        "playground": "serve the playground page at / and /playground (no API key needed)",
        "log_level": "logging level",
        "tensor_parallel_size": "vllm: GPUs each model replica is split across (tensor parallel)",
        "pipeline_parallel_size": "vllm: pipeline stages (GPUs or nodes) per replica",
        "data_parallel_size": "vllm: model replicas behind one engine (data parallel)",
        "distributed_executor_backend": "vllm: how its workers run (auto: vLLM's choice; "
        "ray: across a Ray cluster's nodes)",
        "gpu_memory_utilization": "vllm: share of GPU memory for weights and KV cache "
        "(0: vLLM's default)",
        "max_model_len": "vllm: context length (0: the model's)",
        "enforce_eager": "vllm: no CUDA graphs / torch.compile (starts sooner, runs slower)",
        "quantization": "vllm: quantization method of the weights (default: from the checkpoint)",
        "vllm_engine_args": "vllm: a JSON object of any other engine arguments, by vLLM's "
        'field names, e.g. \'{"kv_cache_dtype": "fp8"}\'',
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
    hyper.graceful_timeout = GRACEFUL_TIMEOUT_SECONDS
    # The app logs one line per request itself (with its tokens and timing).
    hyper.accesslog = None
    hyper.errorlog = "-"
    hyper.loglevel = config.log_level.upper()
    return hyper


async def _next_signal() -> None:
    """Return at the next SIGTERM or SIGINT."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            logging.getLogger(__name__).info("%s received", signal.Signals(signum).name)
            return


async def _either(first: Any, second: Any) -> None:
    """Run both; return as soon as either returns."""
    async with anyio.create_task_group() as group:

        async def run(call: Any) -> None:
            await call()
            group.cancel_scope.cancel()

        group.start_soon(run, first)
        group.start_soon(run, second)


async def _until_stopped(app: SluicewayApp) -> None:
    """Hypercorn's shutdown trigger: wait for a signal (or a model that
    failed to load), then drain the app; a second signal cuts the drain short."""
    fatal = app.lifecycle.fatal
    await _either(_next_signal, fatal.wait if fatal is not None else anyio.sleep_forever)
    interrupted = False

    async def interrupt() -> None:
        nonlocal interrupted
        await _next_signal()
        interrupted = True

    await _either(app.drain, interrupt)
    if interrupted:
        await app.lifecycle.cut_short()


def serve(config: ServerConfig) -> int:
    """Serve until stopped; the exit code (1: the model failed to load)."""
    import functools

    from sluiceway.server.app import create_app
    from sluiceway.server.lifecycle import Phase

    app = create_app(config)
    hyper = hypercorn_config(config)
    served: Any = app
    trigger = functools.partial(_until_stopped, app)
    if config.worker_class == "trio":
        import trio
        from hypercorn.trio import serve as trio_serve

        trio.run(functools.partial(trio_serve, served, hyper, shutdown_trigger=trigger))
    else:
        import asyncio

        from hypercorn.asyncio import serve as asyncio_serve

        asyncio.run(asyncio_serve(served, hyper, shutdown_trigger=trigger))
    return 1 if app.lifecycle.phase is Phase.FAILED else 0


def config_from_args(
    args: argparse.Namespace, environ: dict[str, str] | None = None
) -> ServerConfig:
    """The configuration that ``serve``'s parsed flags describe; the API key
    may come from ``SLUICEWAY_API_KEY`` instead of the flag."""
    values = {spec.name: getattr(args, spec.name) for spec in dataclasses.fields(ServerConfig)}
    env = os.environ if environ is None else environ
    if values["api_key"] is None and env.get("SLUICEWAY_API_KEY"):
        values["api_key"] = env["SLUICEWAY_API_KEY"]
    return ServerConfig(**values)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
        config.key()  # an unreadable key file stops us here
        config.vllm_options()  # and so do malformed vLLM engine arguments
    except (ValueError, OSError) as error:
        print(f"sluiceway: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), format=LOG_FORMAT)
    return serve(config)
