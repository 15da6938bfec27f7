"""What logprobs cost: decode throughput with logprobs off and on.

Runs the real pipeline in process (scheduler, sampler, logprob reducer, the
per-request output actor and the chat SSE encoder; no HTTP) on a Qwen3-shaped
random model with a real-sized vocabulary (151,936 ids, as Qwen3's), and
prints, at concurrency 1 and 8, tokens/s for:

* ``no reducer``: logprobs off, the reducer actor removed from the pipeline;
* ``off``: logprobs off (the reducer wired, passing steps through);
* ``top 0`` / ``top 5`` / ``top 20``: ``logprobs: true`` with that many
  alternatives;
* ``8 ids``: ``logprob_token_ids`` with 8 ids;

each as a ratio to ``off``. Configurations are interleaved over several rounds
and the median is reported, so that drift of the machine hits all alike.

    .venv/bin/python bench/logprobs.py [--tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import anyio
from models import logprobs_model

from sluiceway.actors import output
from sluiceway.actors.engine_work import EngineThread
from sluiceway.actors.output import OutputConfig
from sluiceway.actors.scheduler import SchedulerConfig, SchedulerHandle
from sluiceway.engines.loader import resolve_model
from sluiceway.engines.select import make_engine
from sluiceway.engines.tokenizer import ModelTokenizer
from sluiceway.parsers.pipeline import ChoicePipeline
from sluiceway.protocol.messages import (
    EmitterEvent,
    GenerationRequest,
    Limits,
    LogprobParams,
    RequestOutput,
    SamplingParams,
)
from sluiceway.server.runtime import LoadedModel, PipelineOptions, run_pipeline
from sluiceway.surfaces.openai.chat_encoder import ChatReplyConfig, ChatStreamEncoder

PROMPT = tuple(range(10, 74))

CONFIGS: dict[str, tuple[bool, LogprobParams]] = {
    "no reducer": (False, LogprobParams()),
    "off": (True, LogprobParams()),
    "top 0": (True, LogprobParams(top=0)),
    "top 5": (True, LogprobParams(top=5)),
    "top 20": (True, LogprobParams(top=20)),
    "8 ids": (True, LogprobParams(token_ids=(1, 2, 3, 5, 8, 13, 21, 34))),
}


async def one_request(
    handle: SchedulerHandle, model: LoadedModel, index: int, params: LogprobParams, tokens: int
) -> None:
    request = GenerationRequest(
        request_id=f"bench-{index}-{time.perf_counter_ns()}",
        prompt_ids=PROMPT,
        sampling=SamplingParams(temperature=0.0),
        logprobs=params,
        limits=Limits(max_tokens=tokens, ignore_eos=True),
    )
    table = model.tokenizer.table
    config = OutputConfig(
        request_id=request.request_id,
        n=1,
        prompt_ids=PROMPT,
        table=table,
        make_pipeline=lambda: ChoicePipeline(table),
        logprobs=params.per_token,
    )
    encoder = ChatStreamEncoder(
        ChatReplyConfig(
            completion_id=request.request_id,
            created=0,
            model="bench",
            n=1,
            logprobs=params.per_token,
        )
    )
    tokens_send, tokens_receive = anyio.create_memory_object_stream[RequestOutput](tokens + 2)
    events_send, events_receive = anyio.create_memory_object_stream[EmitterEvent](4)
    handle.submit(request, tokens_send)
    async with anyio.create_task_group() as group:
        group.start_soon(output.run, tokens_receive, events_send, handle, config)
        async with events_receive:
            encoder.start()
            async for event in events_receive:
                encoder.encode(event)


async def throughput(
    model: LoadedModel, with_reducer: bool, params: LogprobParams, concurrency: int, tokens: int
) -> float:
    config = SchedulerConfig(eos_ids=model.tokenizer.eos_ids, max_num_seqs=32)
    async with anyio.create_task_group() as pipeline:
        handle = await pipeline.start(
            functools.partial(
                run_pipeline, model, config, PipelineOptions(with_reducer=with_reducer)
            )
        )
        started = time.perf_counter()
        async with anyio.create_task_group() as clients:
            for index in range(concurrency):
                clients.start_soon(one_request, handle, model, index, params, tokens)
        elapsed = time.perf_counter() - started
        pipeline.cancel_scope.cancel()
    return concurrency * tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engine", default="auto")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    source = resolve_model(str(logprobs_model()))
    thread = EngineThread()
    engine = anyio.run(
        functools.partial(thread.run, make_engine, args.engine, source, device="auto", dtype="auto")
    )
    tokenizer = ModelTokenizer(source.path, engine.info.vocab_size)
    model = LoadedModel(source, tokenizer, engine, 0, thread)
    print(f"engine {engine.info.name}/{engine.info.device}, vocab {engine.info.vocab_size}")
    run: Callable[..., float] = lambda *a: anyio.run(throughput, model, *a)  # noqa: E731
    run(True, LogprobParams(), 1, 8)  # warm-up
    for concurrency in args.concurrency:
        samples: dict[str, list[float]] = {name: [] for name in CONFIGS}
        for _ in range(args.rounds):
            for name, (with_reducer, params) in CONFIGS.items():
                samples[name].append(run(with_reducer, params, concurrency, args.tokens))
        base = statistics.median(samples["off"])
        print(f"\nconcurrency {concurrency}, {args.tokens} tokens per request")
        print(f"{'logprobs':>12} {'tokens/s':>10} {'ratio to off':>13}")
        for name, values in samples.items():
            rate = statistics.median(values)
            print(f"{name:>12} {rate:10.1f} {rate / base:13.3f}")


if __name__ == "__main__":
    main()
