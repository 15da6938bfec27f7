"""Running generation requests through the real pipeline (scheduler,
sampler, reducer) on a real engine, in process or in a child process."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from sluiceway.actors.engine_process import EngineSpec, ProcessEngine
from sluiceway.actors.engine_work import EngineThread
from sluiceway.actors.scheduler import SchedulerConfig, SchedulerHandle
from sluiceway.engines.base import Engine
from sluiceway.engines.grammar import GrammarEngine
from sluiceway.engines.loader import resolve_model
from sluiceway.engines.select import make_engine
from sluiceway.engines.tokenizer import ModelTokenizer
from sluiceway.protocol.constraints import Constraint
from sluiceway.protocol.messages import (
    FinishCause,
    GenerationRequest,
    Limits,
    RequestFailed,
    RequestOutput,
    SamplingParams,
    StepOutput,
)
from sluiceway.server.runtime import LoadedModel, PipelineOptions, run_pipeline
from tests.engines.helpers import exact_dtype

MAX_TOKENS = 400
PROMPT = "Answer in JSON: what is the weather like?"


@dataclass
class Outcome:
    """One choice's generated tokens and how it ended (None: failed)."""

    tokens: list[int]
    finish: FinishCause | None
    failure: str | None = None


@dataclass
class Rig:
    """A loaded default model and a way to run requests through a fresh pipeline."""

    model: LoadedModel
    tokenizer: ModelTokenizer

    def run(
        self, requests: Sequence[GenerationRequest], backend: str = "asyncio"
    ) -> dict[str, list[Outcome]]:
        return anyio.run(functools.partial(self.generate, requests), backend=backend)

    async def generate(self, requests: Sequence[GenerationRequest]) -> dict[str, list[Outcome]]:
        """Submit every request at once (they share the batch); collect each choice."""
        results: dict[str, list[Outcome]] = {}

        async def body(handle: SchedulerHandle) -> None:
            async with anyio.create_task_group() as group:
                for request in requests:
                    send, receive = anyio.create_memory_object_stream[RequestOutput](
                        request.limits.max_tokens + 2
                    )
                    handle.submit(request, send)
                    group.start_soon(_collect, receive, request, results)

        await with_pipeline(self.model, body)
        return results

    def text(self, outcome: Outcome) -> str:
        eos = self.tokenizer.eos_ids
        return self.tokenizer.decode([t for t in outcome.tokens if t not in eos])


async def with_pipeline(
    model: LoadedModel, body: Callable[[SchedulerHandle], Awaitable[None]]
) -> None:
    config = SchedulerConfig(eos_ids=model.tokenizer.eos_ids)
    async with anyio.create_task_group() as group:
        handle = await group.start(
            functools.partial(run_pipeline, model, config, PipelineOptions())
        )
        await body(handle)
        group.cancel_scope.cancel()


async def _collect(
    receive: Any, request: GenerationRequest, results: dict[str, list[Outcome]]
) -> None:
    outcomes = [Outcome([], None) for _ in range(request.n)]
    async with receive:
        async for message in receive:
            if isinstance(message, RequestFailed):
                for outcome in outcomes:
                    outcome.failure = message.message
            elif isinstance(message, StepOutput):
                for sample in message.samples:
                    outcomes[sample.choice].tokens.append(sample.token_id)
                    outcomes[sample.choice].finish = sample.finish
    results[request.request_id] = outcomes


def open_rig(model: Path, name: str, *, in_child: bool) -> Iterator[Rig]:
    """A rig over the model directory ``model`` on engine ``name`` (a generator: a fixture's body)."""
    source = resolve_model(str(model))
    thread = EngineThread()
    engine: Engine
    if in_child:
        engine = ProcessEngine(
            EngineSpec(choice=name, source=source, device="auto", dtype=exact_dtype(name))
        )
    else:
        made = functools.partial(make_engine, name, source, device="auto", dtype=exact_dtype(name))
        engine = anyio.run(thread.run, made)
    tokenizer = ModelTokenizer(source.path, engine.info.vocab_size)
    grammars = GrammarEngine(tokenizer.hf, engine.info.vocab_size, tokenizer.eos_ids)
    try:
        yield Rig(LoadedModel(source, tokenizer, engine, 0, thread, grammars), tokenizer)
    finally:
        engine.close()
        thread.close()


def generation(
    rig: Rig,
    name: str,
    constraint: Constraint | None,
    *,
    n: int = 1,
    max_tokens: int = MAX_TOKENS,
    prompt: str = PROMPT,
    prompt_ids: Sequence[int] | None = None,
    **sampling: Any,
) -> GenerationRequest:
    if prompt_ids is None:
        prompt_ids = rig.tokenizer.encode_prompt(prompt)
    return GenerationRequest(
        request_id=name,
        prompt_ids=tuple(prompt_ids),
        n=n,
        sampling=SamplingParams(**sampling),
        limits=Limits(max_tokens=max_tokens),
        constraint=constraint,
    )
