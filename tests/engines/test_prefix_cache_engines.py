"""The prefix cache on both real engines: restored prefixes decode exactly as
prefilled ones, and the scheduler's outputs with the cache equal those
without it, whatever is shared, evicted, chunked or batched."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import anyio
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluiceway.actors.scheduler import SchedulerConfig, SchedulerHandle
from sluiceway.engines.base import DropKV, Engine, KeepKV, SplitKV
from sluiceway.engines.loader import ModelSource
from sluiceway.engines.select import make_engine
from sluiceway.protocol.messages import (
    GenerationRequest,
    Limits,
    LogprobParams,
    PromptCached,
    PromptScores,
    RequestOutput,
    SamplingParams,
    StepOutput,
)
from tests.engines.conftest import ENGINES
from tests.engines.helpers import LOGPROB_TOLERANCE, exact_dtype, greedy_alone, log_softmax
from tests.engines.test_parity import PROMPTS, prompt
from tests.unit.test_scheduler import collect, run_with, submit

EOS = 0  # the tiny model's vocabulary; greedy rarely lands on it, max_tokens ends rows


@pytest.fixture(scope="module", params=ENGINES)
def shared(request: pytest.FixtureRequest, tiny_model: ModelSource) -> Iterator[Engine]:
    """One engine per module (hypothesis tests take no function-scoped fixtures)."""
    built = make_engine(
        str(request.param), tiny_model, device="auto", dtype=exact_dtype(str(request.param))
    )
    yield built
    built.close()


def test_the_engine_reports_its_kv_size(shared: Engine) -> None:
    # 3 layers x (keys + values) x 2 heads x 16 dims x 4 bytes.
    assert shared.info.kv_bytes_per_token == 3 * 2 * 2 * 16 * 4
    assert shared.info.free_memory_bytes > 0


def test_a_restored_prefix_continues_as_the_prompt_prefilled_whole(shared: Engine) -> None:
    whole = PROMPTS["long"]  # 700 tokens: several prefill steps, several time blocks
    expected = greedy_alone(shared, whole, 6)
    shared.prefill(1, whole[:650])
    shared.cache_op(KeepKV(entry=10, slot=1, start=0, end=300))
    shared.cache_op(KeepKV(entry=11, slot=1, start=300, end=650))
    shared.cache_op(SplitKV(entry=11, at=100, head=12))  # 300..400 and 400..650
    shared.free(1)
    shared.restore(2, [10, 12, 11], 640)  # the last entry in part
    logits = shared.prefill(2, whole[640:])
    np.testing.assert_allclose(
        log_softmax(logits[-1]), expected.logprobs[0], atol=LOGPROB_TOLERANCE
    )
    tokens = [int(logits[-1].argmax())]
    for _ in range(5):
        tokens.append(int(shared.decode({2: tokens[-1]}).logits[0].argmax()))
    assert tokens == expected.tokens
    shared.free(2)
    for entry in (10, 11, 12):
        shared.cache_op(DropKV(entry=entry))


def test_a_running_row_is_kept_with_its_generated_tokens(shared: Engine) -> None:
    """Kept from the batch (beside another row, and alone), a row's
    positions restore into a slot that then decodes as the row did."""
    first, second = PROMPTS["medium"], PROMPTS["short"]
    tokens = {1: int(shared.prefill(1, first)[-1].argmax())}
    tokens[2] = int(shared.prefill(2, second)[-1].argmax())
    fed = {1: list(first), 2: list(second)}
    for _ in range(3):
        step = shared.decode(tokens)
        for slot, row in zip(step.slots, step.logits, strict=True):
            fed[slot].append(tokens[slot])
            tokens[slot] = int(row.argmax())
    shared.cache_op(KeepKV(entry=20, slot=1, start=0, end=len(fed[1])))  # batched
    shared.free(2)
    shared.cache_op(KeepKV(entry=21, slot=1, start=10, end=len(fed[1])))  # alone
    following = shared.decode({1: tokens[1]}).logits[0]
    for entries, slot in (([20], 3), ([22, 21], 4)):
        if slot == 4:
            shared.cache_op(KeepKV(entry=22, slot=3, start=0, end=10))
        shared.restore(slot, entries, len(fed[1]))
        again = shared.prefill(slot, [tokens[1]])[-1]
        np.testing.assert_allclose(
            log_softmax(again), log_softmax(following), atol=LOGPROB_TOLERANCE
        )
    for slot in (1, 3, 4):
        shared.free(slot)
    for entry in (20, 21, 22):
        shared.cache_op(DropKV(entry=entry))


def test_restoring_into_a_slot_in_use_or_from_nothing_is_refused(shared: Engine) -> None:
    shared.prefill(1, PROMPTS["short"])
    with pytest.raises(ValueError, match="in use"):
        shared.restore(1, [], 0)
    with pytest.raises(ValueError, match="no prefix-cache entry"):
        shared.restore(2, [99], 5)
    with pytest.raises(ValueError, match="no positions"):
        shared.cache_op(KeepKV(entry=30, slot=1, start=0, end=len(PROMPTS["short"]) + 1))
    shared.free(1)


# --- the scheduler over the engine, with and without the cache ---------------------------


@dataclass(frozen=True)
class Job:
    prompt: tuple[int, ...]
    n: int
    max_tokens: int
    top: int | None
    prompt_top: int | None
    delay: float


BASES = (tuple(prompt(11, 60)), tuple(prompt(12, 40)) + tuple(prompt(13, 30)))


@st.composite
def jobs(draw: st.DrawFn) -> Job:
    base = draw(st.sampled_from(BASES))
    head = base[: draw(st.integers(0, len(base)))]
    tail = tuple(draw(st.lists(st.integers(1, 500), min_size=1, max_size=12)))
    return Job(
        prompt=head + tail,
        n=draw(st.sampled_from([1, 1, 2])),
        max_tokens=draw(st.integers(1, 6)),
        top=draw(st.sampled_from([None, None, 2])),
        prompt_top=draw(st.sampled_from([None, None, None, 1])),
        delay=draw(st.sampled_from([0.0, 0.002, 0.01])),
    )


@dataclass(frozen=True)
class Reply:
    tokens: tuple[tuple[int, ...], ...]
    logprobs: tuple[tuple[float, ...], ...]
    prompt_logprobs: tuple[float, ...] | None
    cached: int


def reply(messages: list[RequestOutput], n: int) -> Reply:
    samples = [s for m in messages if isinstance(m, StepOutput) for s in m.samples]
    scores = [m for m in messages if isinstance(m, PromptScores)]
    cached = [m.tokens for m in messages if isinstance(m, PromptCached)]
    return Reply(
        tokens=tuple(tuple(s.token_id for s in samples if s.choice == c) for c in range(n)),
        logprobs=tuple(
            tuple(s.logprob.logprob for s in samples if s.choice == c and s.logprob)
            for c in range(n)
        ),
        prompt_logprobs=tuple(e.logprob for e in scores[0].entries[1:] if e) if scores else None,
        cached=cached[0] if cached else 0,
    )


async def run_jobs(engine: Engine, config: SchedulerConfig, batch: list[Job]) -> list[Reply]:
    replies: list[Reply] = []

    async def body(handle: SchedulerHandle) -> None:
        found: dict[int, Reply] = {}

        async def one(index: int, job: Job) -> None:
            await anyio.sleep(job.delay * index)
            spec = GenerationRequest(
                request_id=f"r{index}",
                prompt_ids=job.prompt,
                n=job.n,
                sampling=SamplingParams(temperature=0.0),
                logprobs=LogprobParams(top=job.top, prompt_top=job.prompt_top),
                limits=Limits(max_tokens=job.max_tokens, ignore_eos=True),
            )
            found[index] = reply(await collect(submit(handle, spec)), job.n)

        async with anyio.create_task_group() as group:
            for index, job in enumerate(batch):
                group.start_soon(one, index, job)
        replies.extend(found[i] for i in range(len(batch)))

    await run_with(engine, config, body)  # type: ignore[arg-type]
    return replies


def _close(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return len(a) == len(b) and all(
        abs(x - y) < LOGPROB_TOLERANCE for x, y in zip(a, b, strict=True)
    )


@settings(max_examples=12, deadline=None)
@given(
    batch=st.lists(jobs(), min_size=2, max_size=6),
    budget=st.integers(0, 250),
    chunk=st.integers(8, 64),
    rows=st.integers(1, 4),
    backend=st.sampled_from(["asyncio", "trio"]),
)
def test_outputs_with_the_cache_are_those_without(
    shared: Engine, batch: list[Job], budget: int, chunk: int, rows: int, backend: str
) -> None:
    """Random prompts sharing random prefixes, a tiny budget (evicting all
    the time), chunked prefill, rows joining and leaving, n > 1, greedy
    steps decoded ahead and steps with logprobs."""

    def config(tokens: int) -> SchedulerConfig:
        return SchedulerConfig(
            eos_ids=frozenset({EOS}),
            prefill_chunk_tokens=chunk,
            max_num_seqs=max(rows, 2),
            prefix_cache_bytes=tokens * shared.info.kv_bytes_per_token,
        )

    try:
        cached = anyio.run(run_jobs, shared, config(budget), batch, backend=backend)
    finally:
        shared.close()  # entries left by the run go with it
    plain = anyio.run(run_jobs, shared, config(0), batch, backend=backend)
    for job, got, want in zip(batch, cached, plain, strict=True):
        assert got.tokens == want.tokens
        assert all(_close(a, b) for a, b in zip(got.logprobs, want.logprobs, strict=True))
        if job.prompt_top is not None:
            assert got.cached == 0
            assert got.prompt_logprobs is not None
            assert want.prompt_logprobs is not None
            assert _close(got.prompt_logprobs, want.prompt_logprobs)
        assert got.cached <= min(budget, len(job.prompt) - 1)
