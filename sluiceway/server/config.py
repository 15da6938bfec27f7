"""The server's configuration: one frozen dataclass, from flags or environment."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

from sluiceway.engines.device import check_device
from sluiceway.engines.vllm_engine import VllmOptions, parse_extra_args
from sluiceway.parsers.registry import REASONING_NAMES, TOOL_NAMES

WorkerClass = Literal["asyncio", "trio"]

ENV_PREFIX = "SLUICEWAY_"

#: The largest stream interval: half of a request's mailbox
#: (``sluiceway.server.exchange.MAILBOX_LIMIT``), which must hold a batch and
#: the steps that arrive while it is written.
MAX_STREAM_INTERVAL = 32

#: The log line of the server (and of its engine process).
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: Fields whose value is one of a few words (checked, since the environment
#: can hold anything).
CHOICES: dict[str, tuple[str, ...]] = {
    "engine": ("auto", "mlx", "transformers", "vllm"),
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "compile": ("off", "on", "auto"),
    "worker_class": ("asyncio", "trio"),
    "logprobs_mode": ("raw", "processed"),
    "reasoning_field": ("reasoning_content", "reasoning", "both"),
    "reasoning_parser": ("auto", "none", *REASONING_NAMES),
    "tool_call_parser": ("auto", "none", *TOOL_NAMES),
    "log_level": ("debug", "info", "warning", "error"),
    "distributed_executor_backend": ("auto", "mp", "ray", "uni", "external_launcher"),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    """Everything that shapes the server. Each field has a flag
    (``--max-body-bytes``) and an environment variable
    (``SLUICEWAY_MAX_BODY_BYTES``) for the app factory."""

    model: str | None = None
    served_model_name: str | None = None
    engine: Literal["auto", "mlx", "transformers", "vllm"] = "auto"
    #: auto, cpu, cuda or cuda:N (``engines.device.DEVICES``).
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    #: The transformers engine's decode step through ``torch.compile`` (CPU).
    compile: Literal["off", "on", "auto"] = "auto"
    #: The largest batch the compiled step pads to; larger ones decode eagerly.
    compile_max_batch: int = 32
    #: The transformers engine's bfloat16 linear layers, reordered once for
    #: oneDNN at load (CPU); False keeps them as loaded.
    prepack: bool = True
    #: The compiled decode step's weights frozen into its graphs, with
    #: Inductor's own matrix products (transformers, bfloat16, CPU).
    frozen_weights: Literal["auto", "on", "off"] = "auto"
    #: None: a child process on the CPU, the engine thread on a GPU (and in
    #: a daemonic worker process, which may not start one).
    engine_process: bool | None = None
    #: The transformers engine's CPU threads (0: ``OMP_NUM_THREADS``, else
    #: every core this process may run on, tuned in a child process); for
    #: mlx, OpenBLAS's count where its CPU backend runs on OpenBLAS.
    engine_threads: int = 0
    host: str = "127.0.0.1"
    port: int = 8000
    worker_class: WorkerClass = "asyncio"
    #: The API key every route but the public ones requires (also
    #: ``SLUICEWAY_API_KEY``, or ``api_key_file``: a flag's value shows in ``ps``).
    api_key: str | None = None
    #: A file whose first line is the API key.
    api_key_file: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    max_num_seqs: int = 32
    max_queued_requests: int = 256
    prefill_chunk_tokens: int = 2048
    #: Reuse the KV of prompt prefixes that earlier requests computed.
    prefix_cache: bool = True
    #: None: derived from the model's KV size and the free memory
    #: (``sluiceway.actors.prefix_cache.default_budget``).
    prefix_cache_bytes: int | None = None
    keepalive_seconds: float = 5.0
    #: Steps between a stream's writes after its first token (1: every
    #: step); fewer writes cost the event loop less per token.
    stream_interval: int = 1
    #: Seconds running requests get to finish after SIGTERM/SIGINT.
    shutdown_timeout: float = 30.0
    #: A request whose client reads nothing for this long ends (0: never).
    stall_timeout: float = 60.0
    #: A request still running after this many seconds ends (0: no limit).
    request_timeout: float = 0.0
    #: Seconds idle after a burst before memory is given back (0: never).
    release_memory_after: float = 2.0
    #: Origins allowed to call the API from a browser (CORS): ``*`` or a
    #: comma-separated list; none by default.
    allowed_origins: str | None = None
    max_top_logprobs: int = 20
    logprobs_mode: Literal["raw", "processed"] = "raw"
    return_tokens_as_token_ids: bool = False
    reasoning_field: Literal["reasoning_content", "reasoning", "both"] = "reasoning_content"
    reasoning_parser: str = "auto"
    tool_call_parser: str = "auto"
    stop_in_reasoning: bool = False
    #: A JSON object of chat template variables every request starts from
    #: (``{"enable_thinking": false}``); a request's own
    #: ``chat_template_kwargs`` override them key by key.
    default_chat_template_kwargs: str | None = None
    #: A structured-output schema or grammar that takes longer to compile
    #: is refused (400).
    grammar_compile_timeout: float = 5.0
    cache_dir: str | None = None
    playground: bool = True
    log_level: str = "info"
    # vLLM's engine arguments (``--engine vllm`` only; engines.vllm_engine).
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str = "auto"
    #: 0: vLLM's default.
    gpu_memory_utilization: float = 0.0
    #: 0: the model's context length.
    max_model_len: int = 0
    enforce_eager: bool = False
    quantization: str | None = None
    #: A JSON object of any other engine arguments, by vLLM's names.
    vllm_engine_args: str | None = None

    def __post_init__(self) -> None:
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}")
        check_device(self.device)
        self.template_defaults()  # refuses what is not a JSON object
        if self.compile_max_batch < 1:
            raise ValueError("compile_max_batch must be at least 1")
        if self.keepalive_seconds <= 0:
            raise ValueError("keepalive_seconds must be positive")
        for name in (
            "shutdown_timeout",
            "stall_timeout",
            "request_timeout",
            "release_memory_after",
            "engine_threads",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")
        if self.grammar_compile_timeout <= 0:
            raise ValueError("grammar_compile_timeout must be positive")
        for name in (
            "port",
            "max_body_bytes",
            "max_num_seqs",
            "max_queued_requests",
            "prefill_chunk_tokens",
            "stream_interval",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.stream_interval > MAX_STREAM_INTERVAL:
            raise ValueError(f"stream_interval must be at most {MAX_STREAM_INTERVAL}")
        if self.prefix_cache_bytes is not None and self.prefix_cache_bytes < 0:
            raise ValueError("prefix_cache_bytes must not be negative")
        if not 0 <= self.max_top_logprobs <= 1000:
            raise ValueError("max_top_logprobs must be between 0 and 1000")
        self._check_vllm()

    def _check_vllm(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.gpu_memory_utilization < 0 or self.max_model_len < 0:
            raise ValueError("gpu_memory_utilization and max_model_len must not be negative")
        if self.engine == "vllm" and self.worker_class == "trio":
            raise ValueError(
                "--engine vllm needs --worker-class asyncio: vLLM's AsyncLLM is asyncio code"
            )

    def vllm_options(self) -> VllmOptions:
        """The vLLM engine arguments these flags pass through (raises ValueError
        for a ``vllm_engine_args`` that is not a JSON object, or that sets
        what the server sets itself)."""
        return VllmOptions(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            data_parallel_size=self.data_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
            gpu_memory_utilization=self.gpu_memory_utilization or None,
            max_model_len=self.max_model_len or None,
            enforce_eager=self.enforce_eager,
            quantization=self.quantization,
            extra=parse_extra_args(self.vllm_engine_args),
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ServerConfig:
        """Read ``SLUICEWAY_*`` variables (used by the ``create_app()`` factory)."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for spec in fields(cls):
            raw = env.get(ENV_PREFIX + spec.name.upper())
            if raw is None or raw == "":
                continue
            values[spec.name] = _coerce(spec.name, raw, cls.__dataclass_fields__[spec.name].type)
        return cls(**values)

    def template_defaults(self) -> dict[str, Any]:
        """``default_chat_template_kwargs``, parsed."""
        if not self.default_chat_template_kwargs:
            return {}
        try:
            value = json.loads(self.default_chat_template_kwargs)
        except json.JSONDecodeError as error:
            raise ValueError(f"default_chat_template_kwargs is not JSON: {error}") from error
        if not isinstance(value, dict):
            raise ValueError("default_chat_template_kwargs must be a JSON object")
        return value

    def key(self) -> str | None:
        """The API key: ``api_key``, else the first line of ``api_key_file``."""
        if self.api_key:
            return self.api_key
        if self.api_key_file:
            with open(self.api_key_file, encoding="utf-8") as file:
                key = file.readline().strip()
            if not key:
                raise ValueError(f"the API key file {self.api_key_file} is empty")
            return key
        return None

    def origins(self) -> frozenset[str]:
        """``allowed_origins`` as a set (``*`` allows every origin)."""
        if not self.allowed_origins:
            return frozenset()
        return frozenset(o.strip() for o in self.allowed_origins.split(",") if o.strip())

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return self.model or "sluiceway-default"


def _coerce(name: str, raw: str, annotation: object) -> object:
    text = str(annotation)
    if text.startswith("int"):
        return int(raw)
    if text.startswith("float"):
        return float(raw)
    if text.startswith("bool"):
        if raw.lower() in {"1", "true", "yes", "on"}:
            return True
        if raw.lower() in {"0", "false", "no", "off"}:
            return False
        raise ValueError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a boolean")
    return raw
