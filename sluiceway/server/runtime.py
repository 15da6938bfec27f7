"""The model runtime: loading the model, and running the actor pipeline.

    handlers --Submit/Cancel--> scheduler --LogitsStep--> sampler
                                    ^                       |
                                    +--SampledStep-- reducer <+

(a small step is sampled and reduced by the scheduler itself, on the
sampler's state: ``sluiceway.actors.sampler.StepSampler``).

Per request, the handler runs its own output actor and emitter (see
``sluiceway.server.handlers``).

With ``--engine vllm`` there is no pipeline: vLLM's ``AsyncLLM`` schedules
itself, and ``sluiceway.actors.vllm_runner`` is the handle the server holds
instead of the scheduler's (both are ``sluiceway.actors.seam.EngineHandle``s;
:func:`run_engine` starts whichever the model needs).
"""

from __future__ import annotations

import logging
import multiprocessing
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import anyio
from anyio.abc import TaskStatus

from sluiceway.actors import reducer, sampler, vllm_runner
from sluiceway.actors.engine_process import EngineSpec, ProcessEngine
from sluiceway.actors.engine_work import EngineThread
from sluiceway.actors.prefix_cache import default_budget
from sluiceway.actors.sampler import SamplerConfig, StepSampler
from sluiceway.actors.scheduler import Scheduler, SchedulerConfig, SchedulerHandle, open_inbox
from sluiceway.actors.seam import EngineHandle
from sluiceway.engines.base import Engine
from sluiceway.engines.default_model import default_model_dir
from sluiceway.engines.grammar import GrammarConfig, GrammarEngine
from sluiceway.engines.loader import ModelSource, freeze_heap, resolve_model
from sluiceway.engines.select import (
    choose_engine,
    in_child_process_by_default,
    make_engine,
    process_environment,
)
from sluiceway.engines.tokenizer import ModelTokenizer
from sluiceway.engines.vllm_engine import VllmEngine, engine_args
from sluiceway.protocol.messages import LogitsStep, SampledStep
from sluiceway.server.config import LOG_FORMAT, ServerConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    source: ModelSource
    tokenizer: ModelTokenizer
    #: One of ours (scheduled here), or vLLM's (which schedules itself).
    engine: Engine | VllmEngine
    created: int
    #: The thread the engine was loaded on; all its work runs there.
    thread: EngineThread
    #: Constrained decoding over this model's tokenizer (None: not available).
    grammars: GrammarEngine | None = None


#: The GIL switch interval while serving. The engine thread's Python glue
#: between kernels needs the GIL every few microseconds, and the event loop's
#: per-token work would otherwise hold it for up to CPython's default 5 ms.
SWITCH_INTERVAL_SECONDS = 0.0002


async def load_model(config: ServerConfig) -> LoadedModel:
    """Resolve and load the model on a new engine thread."""
    sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)
    thread = EngineThread()
    try:
        loaded = await thread.run(_load, config, thread)
    except BaseException:
        thread.close()
        raise
    freeze_heap()
    return loaded


def _load(config: ServerConfig, thread: EngineThread) -> LoadedModel:
    spec = config.model
    if spec is None:
        cache_dir = Path(config.cache_dir) if config.cache_dir else None
        spec = str(default_model_dir(cache_dir))
    source = resolve_model(spec)
    started = time.perf_counter()
    engine = _start_engine(config, source)
    tokenizer = ModelTokenizer(source.path, engine.info.vocab_size)
    grammars = _grammar_engine(
        tokenizer,
        engine.info.vocab_size,
        GrammarConfig(compile_seconds=config.grammar_compile_timeout),
    )
    logger.info(
        "loaded %s on %s/%s (%s) in %.1f s",
        source.path,
        engine.info.name,
        engine.info.device,
        engine.info.dtype,
        time.perf_counter() - started,
    )
    return LoadedModel(source, tokenizer, engine, int(time.time()), thread, grammars)


def _grammar_engine(
    tokenizer: ModelTokenizer, vocab_size: int, config: GrammarConfig
) -> GrammarEngine | None:
    started = time.perf_counter()
    try:
        grammars = GrammarEngine(tokenizer.hf, vocab_size, tokenizer.eos_ids, config)
    except Exception:  # a tokenizer llguidance cannot read: serve, without constraints
        logger.exception("the grammar engine cannot use this tokenizer; no structured output")
        return None
    logger.info("grammar engine ready in %.2f s", time.perf_counter() - started)
    return grammars


def _start_engine(config: ServerConfig, source: ModelSource) -> Engine | VllmEngine:
    if config.engine == "vllm":
        return _start_vllm(config, source)
    name = choose_engine(config.engine)
    in_child = config.engine_process
    daemonic = multiprocessing.current_process().daemon
    if in_child and daemonic:
        raise RuntimeError(
            "--engine-process: this server runs in a daemonic worker process (as Hypercorn's "
            "own command starts its workers), which may not start one; serve with "
            "`sluiceway serve`, or run the engine on a thread (--no-engine-process)"
        )
    if in_child is None:
        in_child = in_child_process_by_default(name, config.device)
        if in_child and daemonic:
            logger.warning(
                "the engine runs on a thread: a daemonic worker process (as Hypercorn's own "
                "command starts) may not start the child process it would run in"
            )
            in_child = False
    if not in_child:
        return make_engine(
            name,
            source,
            device=config.device,
            dtype=config.dtype,
            threads=config.engine_threads,
            compile=config.compile,
            compile_max_batch=config.compile_max_batch,
            prepack=config.prepack,
            frozen_weights=config.frozen_weights,
        )
    logger.info("the engine runs in a child process")
    spec = EngineSpec(
        choice=name,
        source=source,
        device=config.device,
        dtype=config.dtype,
        threads=config.engine_threads,
        compile=config.compile,
        compile_max_batch=config.compile_max_batch,
        prepack=config.prepack,
        frozen_weights=config.frozen_weights,
        log_level=config.log_level,
        log_format=LOG_FORMAT,
        environment=process_environment(name, config.compile),
    )
    return ProcessEngine(spec)


def _start_vllm(config: ServerConfig, source: ModelSource) -> VllmEngine:
    if config.device != "auto" or config.engine_process is not None:
        logger.warning("--engine vllm ignores --device and --engine-process: vLLM places its work")
    if config.compile == "on":
        logger.warning("--engine vllm ignores --compile: vLLM compiles unless --enforce-eager")
    args = engine_args(
        str(source.path),
        config.vllm_options(),
        dtype=config.dtype,
        max_num_seqs=config.max_num_seqs,
        max_top_logprobs=config.max_top_logprobs,
        logprobs_mode=config.logprobs_mode,
        prefix_cache=config.prefix_cache,
    )
    return VllmEngine(source, args, device="vllm", threads=config.engine_threads)


def prefix_cache_bytes(config: ServerConfig, engine: Engine | VllmEngine) -> int:
    """The prefix cache's budget (0: off), logged once."""
    info = engine.info
    if not config.prefix_cache:
        logger.info("prefix cache: off (--no-prefix-cache)")
        return 0
    if isinstance(engine, VllmEngine):
        logger.info("prefix cache: vLLM's own")
        return 0
    if info.kv_bytes_per_token <= 0:
        logger.info("prefix cache: off (the %s engine cannot keep this model's KV)", info.name)
        return 0
    budget = (
        default_budget(info) if config.prefix_cache_bytes is None else config.prefix_cache_bytes
    )
    if budget < info.kv_bytes_per_token:
        logger.info("prefix cache: off (%d bytes hold no token)", budget)
        return 0
    logger.info(
        "prefix cache: %.1f MiB, %d tokens of %d bytes",
        budget / 2**20,
        budget // info.kv_bytes_per_token,
        info.kv_bytes_per_token,
    )
    return budget


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineOptions:
    #: Wire the logprob reducer in (benchmarks compare against leaving it out).
    with_reducer: bool = True
    processed_logprobs: bool = False


async def run_engine(
    model: LoadedModel,
    config: SchedulerConfig,
    options: PipelineOptions,
    *,
    task_status: TaskStatus[EngineHandle] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run the engine's scheduling until cancelled: vLLM's own, or our pipeline."""
    if isinstance(model.engine, VllmEngine):
        mode = "processed" if options.processed_logprobs else "raw"
        await vllm_runner.run(model.engine, config, logprobs_mode=mode, task_status=task_status)
    else:
        await run_pipeline(model, config, options, task_status=task_status)


async def run_pipeline(
    model: LoadedModel,
    config: SchedulerConfig,
    options: PipelineOptions,
    *,
    task_status: TaskStatus[SchedulerHandle] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run scheduler, sampler and reducer until cancelled."""
    engine = model.engine
    if isinstance(engine, VllmEngine):
        raise TypeError("vLLM schedules itself: run_engine runs it")
    handle, inbox = open_inbox(config)
    sampling = StepSampler(
        SamplerConfig(
            forward_logits=options.with_reducer,
            processed_logprobs=options.processed_logprobs,
            grammars=model.grammars,
        ),
        reduce=options.with_reducer,
    )
    scheduler = Scheduler(
        engine, model.thread, config, handle, sample_inline=sampling.inline, guides=sampling
    )
    to_sampler_send, to_sampler_receive = anyio.create_memory_object_stream[LogitsStep](1)
    sampled_send, sampled_receive = anyio.create_memory_object_stream[SampledStep](1)
    try:
        async with anyio.create_task_group() as group:
            if options.with_reducer:
                reduced_send, reduced_receive = anyio.create_memory_object_stream[SampledStep](1)
                group.start_soon(reducer.run, sampled_receive, reduced_send)
                back_to_scheduler = reduced_receive
            else:
                back_to_scheduler = sampled_receive
            group.start_soon(sampler.run, to_sampler_receive, sampled_send, sampling)
            group.start_soon(scheduler.run, inbox, to_sampler_send, back_to_scheduler)
            task_status.started(handle)
    finally:
        handle.close()
