"""The scheduler with the prefix cache on, against a fake engine whose next
token is a hash of the slot's whole sequence: a prefix restored wrongly, or
a kept entry that holds other tokens, changes the output."""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import anyio
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluiceway.actors.engine_work import PrefillWork, StepPlan, execute
from sluiceway.actors.scheduler import SchedulerConfig, SchedulerHandle
from sluiceway.engines.base import (
    CacheOp,
    DecodeResult,
    DropKV,
    EngineInfo,
    KeepKV,
    Logits,
    SplitKV,
)
from sluiceway.protocol.messages import (
    GenerationRequest,
    Limits,
    LogprobParams,
    PromptCached,
    PromptScores,
    RequestFailed,
    RequestOutput,
    SamplingParams,
    StepOutput,
)
from tests.unit.test_scheduler import collect, run_with, submit

VOCAB = 32
EOS = 0
BYTES_PER_TOKEN = 4


def successor(sequence: Sequence[int]) -> int:
    """Never EOS: generation ends at max_tokens."""
    return zlib.crc32(bytes(sequence)) % (VOCAB - 1) + 1


@dataclass
class SequenceEngine:
    """Keeps every slot's token ids as its "KV"; entries hold token ids too."""

    sequences: dict[int, list[int]] = field(default_factory=dict)
    running: list[int] = field(default_factory=list)
    entries: dict[int, tuple[int, ...]] = field(default_factory=dict)
    prefilled: dict[int, int] = field(default_factory=dict)
    restored: dict[int, int] = field(default_factory=dict)
    last: list[int] = field(default_factory=list)

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(
            name="fake",
            device="cpu",
            dtype="float32",
            vocab_size=VOCAB,
            max_context=4096,
            kv_bytes_per_token=BYTES_PER_TOKEN,
        )

    def _logits(self, sequences: Sequence[Sequence[int]]) -> Logits:
        out = np.zeros((len(sequences), VOCAB), dtype=np.float32)
        for row, sequence in enumerate(sequences):
            out[row, successor(sequence)] = 10.0
        return out

    def prefill(self, slot: int, token_ids: Sequence[int], *, all_logits: bool = False) -> Logits:
        sequence = self.sequences.setdefault(slot, [])
        before = len(sequence)
        sequence += token_ids
        self.prefilled[slot] = self.prefilled.get(slot, 0) + len(token_ids)
        if not all_logits:
            return self._logits([sequence])
        return self._logits([sequence[: before + i + 1] for i in range(len(token_ids))])

    def restore(self, slot: int, entries: Sequence[int], length: int) -> None:
        assert slot not in self.sequences
        laid = [token for entry in entries for token in self.entries[entry]]
        assert len(laid) >= length
        self.sequences[slot] = laid[:length]
        self.restored[slot] = length

    def cache_op(self, op: CacheOp) -> None:
        if isinstance(op, KeepKV):
            sequence = self.sequences[op.slot]
            assert 0 <= op.start < op.end <= len(sequence)
            self.entries[op.entry] = tuple(sequence[op.start : op.end])
        elif isinstance(op, SplitKV):
            whole = self.entries[op.entry]
            if op.head is not None:
                self.entries[op.head] = whole[: op.at]
            self.entries[op.entry] = whole[op.at :]
        elif isinstance(op, DropKV):
            self.entries.pop(op.entry, None)

    def fork(self, source: int, target: int) -> None:
        self.sequences[target] = list(self.sequences[source])

    def decode(self, tokens: Mapping[int, int]) -> DecodeResult:
        for slot in tokens:
            if slot not in self.running:
                self.running.append(slot)
        assert set(self.running) == set(tokens)
        for slot in self.running:
            self.sequences[slot].append(tokens[slot])
        return DecodeResult(
            tuple(self.running), self._logits([self.sequences[s] for s in self.running])
        )

    def start_decode(self, tokens: Mapping[int, int]) -> Callable[[], DecodeResult]:
        return functools.partial(self.decode, dict(tokens))

    def undo_decode(self) -> None:
        for slot in self.running:
            self.sequences[slot].pop()

    def free(self, slot: int) -> None:
        self.sequences.pop(slot, None)
        if slot in self.running:
            self.running.remove(slot)

    def close(self) -> None:
        pass


@dataclass
class FaultyEngine(SequenceEngine):
    """Fails every ``every``-th copy or split (after making half of the
    split); a drop never fails (it only lets go of memory)."""

    every: int = 3
    edits: int = 0

    def cache_op(self, op: CacheOp) -> None:
        self.edits += not isinstance(op, DropKV)
        if self.edits % self.every or isinstance(op, DropKV):
            super().cache_op(op)
            return
        if isinstance(op, SplitKV) and op.head is not None:
            self.entries[op.head] = self.entries[op.entry][: op.at]
        raise RuntimeError("the engine ran out of memory")


def spec(name: str, prompt: Sequence[int], **options: object) -> GenerationRequest:
    return GenerationRequest(
        request_id=name,
        prompt_ids=tuple(prompt),
        n=int(options.get("n", 1)),  # type: ignore[call-overload]
        sampling=SamplingParams(temperature=0.0),
        logprobs=LogprobParams(prompt_top=options.get("prompt_top")),  # type: ignore[arg-type]
        limits=Limits(max_tokens=int(options.get("max_tokens", 4))),  # type: ignore[call-overload]
    )


def config(budget_tokens: int, **fields: int) -> SchedulerConfig:
    """Reusing any cached prefix (``min_prefix_reuse`` 1) unless told: the
    prompts here are a few tokens long."""
    fields.setdefault("min_prefix_reuse", 1)
    return SchedulerConfig(
        eos_ids=frozenset({EOS}), prefix_cache_bytes=budget_tokens * BYTES_PER_TOKEN, **fields
    )


@dataclass(frozen=True)
class Reply:
    tokens: tuple[tuple[int, ...], ...]
    cached: int
    prompt_scores: int | None
    failed: bool = False


def reply(messages: list[RequestOutput], n: int) -> Reply:
    steps = [s for m in messages if isinstance(m, StepOutput) for s in m.samples]
    cached = [m.tokens for m in messages if isinstance(m, PromptCached)]
    scores = [len(m.entries) for m in messages if isinstance(m, PromptScores)]
    return Reply(
        tokens=tuple(tuple(s.token_id for s in steps if s.choice == c) for c in range(n)),
        cached=cached[0] if cached else 0,
        prompt_scores=scores[0] if scores else None,
        failed=any(isinstance(m, RequestFailed) for m in messages),
    )


def expected_tokens(prompt: Sequence[int], count: int) -> tuple[int, ...]:
    sequence, out = list(prompt), []
    for _ in range(count):
        out.append(successor(sequence))
        sequence.append(out[-1])
    return tuple(out)


@pytest.mark.anyio
async def test_a_request_reuses_what_an_earlier_one_prefilled() -> None:
    engine = SequenceEngine()
    system = list(range(1, 21))

    async def body(handle: SchedulerHandle) -> None:
        first = reply(await collect(submit(handle, spec("a", [*system, 7, 8]))), 1)
        second = reply(await collect(submit(handle, spec("b", [*system, 9]))), 1)
        again = reply(await collect(submit(handle, spec("c", [*system, 7, 8]))), 1)
        assert first == Reply((expected_tokens([*system, 7, 8], 4),), 0, None)
        assert second == Reply((expected_tokens([*system, 9], 4),), 20, None)
        assert again == Reply((expected_tokens([*system, 7, 8], 4),), 21, None)
        assert handle.prefix_cache is not None
        assert handle.prefix_cache.hits == 2

    await run_with(engine, config(1000), body)  # type: ignore[arg-type]
    assert engine.restored == {2: 20, 3: 21}
    assert engine.prefilled == {1: 22, 2: 1, 3: 1}


@pytest.mark.anyio
async def test_a_short_cached_prefix_is_prefilled_again_but_anchors_the_keep() -> None:
    """At the default (16), a prompt that shares 15 tokens with a cached one
    is prefilled whole, reports nothing cached and counts as a miss; it is
    still kept, so a third prompt sharing it all reuses it."""
    engine = SequenceEngine()
    head = list(range(1, 16))

    async def body(handle: SchedulerHandle) -> None:
        first = reply(await collect(submit(handle, spec("a", [*head, 30]))), 1)
        second = reply(await collect(submit(handle, spec("b", [*head, 31, 32, 33]))), 1)
        third = reply(await collect(submit(handle, spec("c", [*head, 31, 32, 33, 34]))), 1)
        assert (first.cached, second.cached, third.cached) == (0, 0, 18)
        assert second.tokens == (expected_tokens([*head, 31, 32, 33], 4),)
        assert third.tokens == (expected_tokens([*head, 31, 32, 33, 34], 4),)
        assert handle.prefix_cache is not None
        stats = handle.prefix_cache
        assert (stats.lookups, stats.hits, stats.hit_tokens) == (3, 1, 18)

    await run_with(
        engine,
        SchedulerConfig(eos_ids=frozenset({EOS}), prefix_cache_bytes=1000 * BYTES_PER_TOKEN),
        body,
    )  # type: ignore[arg-type]
    assert engine.restored == {3: 18}
    assert engine.prefilled == {1: 16, 2: 18, 3: 1}


@pytest.mark.anyio
async def test_a_cached_prefix_of_a_block_is_reused() -> None:
    engine = SequenceEngine()
    head = list(range(1, 17))

    async def body(handle: SchedulerHandle) -> None:
        await collect(submit(handle, spec("a", [*head, 30])))
        assert reply(await collect(submit(handle, spec("b", [*head, 31]))), 1).cached == 16

    await run_with(engine, config(1000, min_prefix_reuse=16), body)  # type: ignore[arg-type]
    assert engine.restored == {2: 16}


@pytest.mark.anyio
async def test_a_finished_reply_is_reused_by_the_next_turn() -> None:
    engine = SequenceEngine()
    prompt = [5, 6, 7, 8]

    async def body(handle: SchedulerHandle) -> None:
        first = reply(await collect(submit(handle, spec("a", prompt, max_tokens=6))), 1)
        turn = [*prompt, *first.tokens[0], 3, 3]
        second = reply(await collect(submit(handle, spec("b", turn))), 1)
        # The reply's last token was never fed back, so it is not cached.
        assert second.cached == len(prompt) + 5
        assert second.tokens[0] == expected_tokens(turn, 4)

    await run_with(engine, config(1000), body)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_a_request_for_prompt_logprobs_reuses_nothing_but_is_kept() -> None:
    engine = SequenceEngine()
    prompt = list(range(1, 15))

    async def body(handle: SchedulerHandle) -> None:
        await collect(submit(handle, spec("a", prompt)))
        scored = reply(await collect(submit(handle, spec("b", prompt, prompt_top=1))), 1)
        assert scored.cached == 0
        assert scored.prompt_scores == len(prompt)
        plain = reply(await collect(submit(handle, spec("c", [*prompt, 1]))), 1)
        assert plain.cached == len(prompt)

    await run_with(engine, config(1000), body)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_without_a_budget_nothing_is_cached() -> None:
    engine = SequenceEngine()

    async def body(handle: SchedulerHandle) -> None:
        for name in "abc":
            assert reply(await collect(submit(handle, spec(name, [1, 2, 3, 4]))), 1).cached == 0
        assert handle.prefix_cache is None

    await run_with(engine, config(0), body)  # type: ignore[arg-type]
    assert engine.entries == {}


@dataclass(frozen=True)
class Job:
    prompt: tuple[int, ...]
    n: int
    max_tokens: int
    prompt_top: int | None
    delay: float


BASES = (tuple(range(1, 30)), tuple(range(1, 12)) + (5,) * 20, (7, 7, 7, 7, 7, 7))


@st.composite
def jobs(draw: st.DrawFn) -> Job:
    base = draw(st.sampled_from(BASES))
    head = base[: draw(st.integers(0, len(base)))]
    tail = tuple(draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=8)))
    return Job(
        prompt=head + tail,
        n=draw(st.sampled_from([1, 1, 2])),
        max_tokens=draw(st.integers(1, 6)),
        prompt_top=draw(st.sampled_from([None, None, None, 1])),
        delay=draw(st.sampled_from([0.0, 0.0, 0.001, 0.004])),
    )


async def run_jobs(engine: SequenceEngine, cfg: SchedulerConfig, batch: list[Job]) -> list[Reply]:
    replies: list[Reply | None] = [None] * len(batch)

    async def body(handle: SchedulerHandle) -> None:
        async def one(index: int, job: Job) -> None:
            await anyio.sleep(job.delay * index)
            request = spec(
                f"r{index}",
                job.prompt,
                n=job.n,
                max_tokens=job.max_tokens,
                prompt_top=job.prompt_top,
            )
            replies[index] = reply(await collect(submit(handle, request)), job.n)

        async with anyio.create_task_group() as group:
            for index, job in enumerate(batch):
                group.start_soon(one, index, job)
        await anyio.sleep(0.02)  # the last edits (drops) reach the engine

    await run_with(engine, cfg, body)  # type: ignore[arg-type]
    return [r for r in replies if r is not None]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@settings(max_examples=40, deadline=None)
@given(
    batch=st.lists(jobs(), min_size=1, max_size=8),
    budget=st.integers(0, 80),
    chunk=st.integers(1, 16),
    rows=st.integers(1, 4),
    faults=st.sampled_from([0, 0, 0, 2, 5]),
    least=st.sampled_from([1, 6, 16]),
)
def test_outputs_are_those_of_no_cache_under_any_schedule(
    backend: str, batch: list[Job], budget: int, chunk: int, rows: int, faults: int, least: int
) -> None:
    """Also when the engine fails cache edits: the cache starts afresh, and
    requests whose restore failed fail (never a wrong output). And whatever
    the shortest prefix reused (``least``), none shorter is."""
    fields = {
        "prefill_chunk_tokens": chunk,
        "max_num_seqs": max(rows, max(j.n for j in batch)),
        "min_prefix_reuse": least,
    }
    engine = FaultyEngine(every=faults) if faults else SequenceEngine()
    cached = anyio.run(run_jobs, engine, config(budget, **fields), batch, backend=backend)
    plain = anyio.run(run_jobs, SequenceEngine(), config(0, **fields), batch, backend=backend)
    for job, got, want in zip(batch, cached, plain, strict=True):
        if got.failed and faults:
            continue  # its restore came after a failed edit
        assert (got.tokens, got.prompt_scores) == (want.tokens, want.prompt_scores)
        assert got.tokens == (expected_tokens(job.prompt, job.max_tokens),) * job.n
        assert got.cached < len(job.prompt)
        assert got.cached == 0 or got.cached >= least
        if job.prompt_top is not None:
            assert got.cached == 0
            assert got.prompt_scores == len(job.prompt)
    # Everything the engine still holds is an entry of the tree, within the budget.
    assert sum(len(entry) for entry in engine.entries.values()) <= budget


def test_no_restore_runs_in_a_step_whose_edits_failed() -> None:
    """A split that failed half-way leaves entries that do not hold what the
    index says: a restore planned against them fails its request instead."""
    engine = FaultyEngine(every=1)
    engine.entries[1] = (1, 2, 3, 4)
    plan = StepPlan(
        cache_ops=(SplitKV(entry=1, at=2, head=2),),
        prefills=(
            PrefillWork(
                request_id="r", slot=5, tokens=(9,), final=True, restore=(2, 1), restore_length=4
            ),
            PrefillWork(request_id="s", slot=6, tokens=(1, 2, 9), final=True),
        ),
    )
    outcome = execute(engine, plan)
    assert outcome.cache_error is not None
    assert outcome.prefills[0].error == outcome.cache_error
    assert 5 not in engine.sequences
    assert outcome.prefills[1].error is None  # a prompt that restores nothing runs
