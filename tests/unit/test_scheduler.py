"""The scheduler against a fake engine that records every call: admission,
chunked prefill, batched decode, forks, finishing and cancellation."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import anyio
import numpy as np
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream

from sluiceway.actors.engine_work import EngineThread
from sluiceway.actors.scheduler import SchedulerConfig, SchedulerHandle
from sluiceway.engines.base import DecodeResult, EngineInfo, Logits
from sluiceway.engines.loader import ModelSource
from sluiceway.protocol.messages import (
    FinishCause,
    GenerationRequest,
    Limits,
    PromptScores,
    RequestOutput,
    SamplingParams,
    StepOutput,
)
from sluiceway.server.runtime import LoadedModel, PipelineOptions, run_pipeline

VOCAB = 16
EOS = 0


@dataclass
class FakeEngine:
    """Always predicts ``(last token + 1) % VOCAB`` (never EOS unless asked)."""

    calls: list[tuple[str, object]] = field(default_factory=list)
    last: dict[int, int] = field(default_factory=dict)
    running: list[int] = field(default_factory=list)

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(
            name="fake", device="cpu", dtype="float32", vocab_size=VOCAB, max_context=64
        )

    def _logits(self, tokens: Sequence[int]) -> Logits:
        out = np.zeros((len(tokens), VOCAB), dtype=np.float32)
        for row, token in enumerate(tokens):
            successor = (token + 1) % VOCAB
            out[row, successor if successor != EOS else 1] = 10.0
        return out

    def prefill(self, slot: int, token_ids: Sequence[int], *, all_logits: bool = False) -> Logits:
        self.calls.append(("prefill", (slot, tuple(token_ids))))
        self.last[slot] = token_ids[-1]
        logits = self._logits(token_ids)
        return logits if all_logits else logits[-1:]

    def fork(self, source: int, target: int) -> None:
        self.calls.append(("fork", (source, target)))
        self.last[target] = self.last[source]

    def decode(self, tokens: Mapping[int, int]) -> DecodeResult:
        self.calls.append(("decode", dict(tokens)))
        for slot in tokens:
            if slot not in self.running:
                self.running.append(slot)
        assert set(self.running) == set(tokens), "decode names every running slot"
        return DecodeResult(tuple(self.running), self._logits([tokens[s] for s in self.running]))

    def start_decode(self, tokens: Mapping[int, int]) -> Callable[[], DecodeResult]:
        return functools.partial(self.decode, dict(tokens))

    def undo_decode(self) -> None:
        self.calls.append(("undo_decode", None))

    def free(self, slot: int) -> None:
        self.calls.append(("free", slot))
        if slot in self.running:
            self.running.remove(slot)

    def release_memory(self) -> None:
        self.calls.append(("release_memory", tuple(self.running)))

    def close(self) -> None:
        pass


def chain(last: int, count: int) -> list[int]:
    """The ``count`` tokens the fake engine generates after ``last``, greedy."""
    tokens = []
    for _ in range(count):
        last = (last + 1) % VOCAB or 1
        tokens.append(last)
    return tokens


def request(name: str, prompt: Sequence[int], **limits: object) -> GenerationRequest:
    n = int(limits.pop("n", 1))  # type: ignore[call-overload]
    return GenerationRequest(
        request_id=name,
        prompt_ids=tuple(prompt),
        n=n,
        sampling=SamplingParams(temperature=0.0),
        limits=Limits(**{"max_tokens": 4, **limits}),  # type: ignore[arg-type]
    )


async def collect(stream: MemoryObjectReceiveStream[RequestOutput]) -> list[RequestOutput]:
    async with stream:
        return [message async for message in stream]


async def run_with(engine: FakeEngine, config: SchedulerConfig, body: object) -> None:
    thread = EngineThread()
    model = LoadedModel(
        ModelSource(path=__import__("pathlib").Path("."), config={}, name="fake"),
        None,  # type: ignore[arg-type]
        engine,
        0,
        thread,
    )
    try:
        async with anyio.create_task_group() as group:
            handle = await group.start(
                functools.partial(run_pipeline, model, config, PipelineOptions())
            )
            await body(handle)  # type: ignore[operator]
            group.cancel_scope.cancel()
    finally:
        thread.close()


def submit(
    handle: SchedulerHandle, spec: GenerationRequest
) -> MemoryObjectReceiveStream[RequestOutput]:
    send, receive = anyio.create_memory_object_stream[RequestOutput](spec.limits.max_tokens + 2)
    try:
        handle.submit(spec, send)
    except BaseException:
        send.close()
        receive.close()
        raise
    return receive


def tokens_of(messages: list[RequestOutput], choice: int = 0) -> list[int]:
    return [
        s.token_id
        for m in messages
        if isinstance(m, StepOutput)
        for s in m.samples
        if s.choice == choice
    ]


@pytest.mark.anyio
async def test_long_prompts_are_prefilled_in_chunks_between_decode_steps() -> None:
    engine = FakeEngine()
    config = SchedulerConfig(eos_ids=frozenset({EOS}), prefill_chunk_tokens=4)

    async def body(handle: SchedulerHandle) -> None:
        short = submit(handle, request("short", [3], max_tokens=40))
        first = await short.receive()
        long = submit(handle, request("long", list(range(1, 11)), max_tokens=2))
        results = [first, *await collect(short)]
        # Every one of the forty (past the vocabulary's wrap, which skips EOS).
        assert tokens_of(results) == chain(3, 40)
        assert tokens_of(await collect(long)) == [11, 12]

    await run_with(engine, config, body)
    prefills = [args for kind, args in engine.calls if kind == "prefill"]
    assert [len(tokens) for slot, tokens in prefills if slot != prefills[0][0]] == [4, 4, 2]  # type: ignore[misc]
    # The running stream kept decoding while the long prompt went in, chunk by chunk.
    kinds = [
        "long" if kind == "prefill" and len(args[1]) > 1 else kind  # type: ignore[index]
        for kind, args in engine.calls
    ]
    first = kinds.index("long")
    assert kinds[first : first + 6] == ["long", "decode", "long", "decode", "long", "decode"]


@pytest.mark.anyio
async def test_choices_share_one_prefill_and_prompt_scores_come_first() -> None:
    engine = FakeEngine()
    config = SchedulerConfig(eos_ids=frozenset({EOS}))

    async def body(handle: SchedulerHandle) -> None:
        spec = GenerationRequest(
            request_id="n3",
            prompt_ids=(5, 6, 7),
            n=3,
            sampling=SamplingParams(temperature=0.0),
            logprobs=__import__(
                "sluiceway.protocol.messages", fromlist=["LogprobParams"]
            ).LogprobParams(prompt_top=2),
            limits=Limits(max_tokens=2),
        )
        messages = await collect(submit(handle, spec))
        assert isinstance(messages[0], PromptScores)
        assert messages[0].entries[0] is None
        assert len(messages[0].entries) == 3
        for choice in range(3):
            assert tokens_of(messages, choice) == [8, 9]
        last = messages[-1]
        assert isinstance(last, StepOutput)
        assert {s.finish for s in last.samples} == {FinishCause.MAX_TOKENS}

    await run_with(engine, config, body)
    assert [kind for kind, _ in engine.calls].count("prefill") == 1
    assert [kind for kind, _ in engine.calls].count("fork") == 2


@pytest.mark.anyio
async def test_memory_is_given_back_once_idle_after_work_and_only_then() -> None:
    engine = FakeEngine()
    config = SchedulerConfig(eos_ids=frozenset({EOS}), release_memory_after=0.2)

    def releases() -> list[object]:
        return [args for kind, args in engine.calls if kind == "release_memory"]

    async def body(handle: SchedulerHandle) -> None:
        await anyio.sleep(0.4)
        assert releases() == [], "nothing ran yet: nothing to give back"
        stream = submit(handle, request("a", [1], max_tokens=10**6, ignore_eos=True))
        async with stream:
            await stream.receive()
            await anyio.sleep(0.3)
            assert releases() == [], "not while a request runs"
            handle.cancel("a")
        # A busy host may be slow to run the idle timer: wait for it, then
        # check that it fired once.
        for _ in range(600):  # 30 s at most
            if releases():
                break
            await anyio.sleep(0.05)
        assert releases() == [()], "once idle, with no slot in use"
        await anyio.sleep(0.4)
        assert len(releases()) == 1, "not again without more work"

    await run_with(engine, config, body)


@pytest.mark.anyio
async def test_cancel_frees_the_slot_before_the_next_step() -> None:
    engine = FakeEngine()
    config = SchedulerConfig(eos_ids=frozenset({EOS}))

    async def body(handle: SchedulerHandle) -> None:
        stream = submit(handle, request("long", [1], max_tokens=1000, ignore_eos=True))
        async with stream:
            await stream.receive()
            # Marked in the engine's log, which the engine thread appends to as it runs.
            engine.calls.append(("cancel", None))
            handle.cancel("long")
            # The stream ends (the scheduler closed it) after at most the step in flight.
            remaining = [message async for message in stream]
            assert len(remaining) <= 1
        await anyio.sleep(0.05)
        assert handle.running_rows == 0

    await run_with(engine, config, body)
    kinds = [kind for kind, _ in engine.calls]
    cancelled_at, free_at = kinds.index("cancel"), kinds.index("free")
    # At most one decode step ran between the cancel and the free (the one in
    # flight), and none after it. A decode run ahead and then undone never
    # reached the row (run-ahead starts the next step before the cancel lands).
    between = kinds[cancelled_at:free_at]
    assert between.count("decode") - between.count("undo_decode") <= 1, kinds[cancelled_at:]
    assert "decode" not in kinds[free_at:]
    assert kinds.count("free") == 1


@pytest.mark.anyio
async def test_queue_bound_and_waiting_cancellation() -> None:
    engine = FakeEngine()
    config = SchedulerConfig(eos_ids=frozenset({EOS}), max_num_seqs=1, max_queued_requests=1)

    async def body(handle: SchedulerHandle) -> None:
        running = submit(handle, request("a", [1], max_tokens=1000, ignore_eos=True))
        await running.receive()
        waiting = submit(handle, request("b", [2]))
        from sluiceway.protocol.errors import Overloaded

        with pytest.raises(Overloaded):
            submit(handle, request("c", [3]))
        await anyio.sleep(0.02)
        assert handle.queued == 1
        handle.cancel("b")
        await anyio.sleep(0.02)
        assert handle.queued == 0
        waiting.close()
        running.close()

    await run_with(engine, config, body)


@dataclass
class PackingFakeEngine(FakeEngine):
    """:class:`FakeEngine` that packs prompt chunks into the step decoded ahead."""

    packs_prefills: bool = True
    pending: set[int] = field(default_factory=set)
    #: What :meth:`prefills_apart` answers.
    apart: bool = False

    def prefills_apart(self, chunks: Sequence[tuple[int, int]]) -> bool:
        return self.apart

    def prefill(self, slot: int, token_ids: Sequence[int], *, all_logits: bool = False) -> Logits:
        self.pending.add(slot)
        return super().prefill(slot, token_ids, all_logits=all_logits)

    def fork(self, source: int, target: int) -> None:
        self.pending.add(target)
        super().fork(source, target)

    def decode(self, tokens: Mapping[int, int]) -> DecodeResult:
        self.pending -= set(tokens)
        return super().decode(tokens)

    def free(self, slot: int) -> None:
        self.pending.discard(slot)
        super().free(slot)

    def decode_prefilling(
        self, tokens: Mapping[int, int], chunks: Sequence[tuple[int, Sequence[int]]]
    ) -> tuple[DecodeResult, list[Logits]]:
        self.calls.append(("packed", tuple(slot for slot, _ in chunks)))
        last = [self.prefill(slot, ids) for slot, ids in chunks]
        if not tokens:  # a pass that only prefills
            return DecodeResult((), np.zeros((0, VOCAB), dtype=np.float32)), last
        return self.decode(tokens), last


@pytest.mark.anyio
async def test_prompts_packed_into_the_step_ahead_stream_as_usual() -> None:
    """New prompts arriving while a stream decodes go into the steps decoded
    ahead (their outcomes a step late): every stream is whole and right,
    one that is cancelled at once leaves nothing behind."""
    engine = PackingFakeEngine()
    config = SchedulerConfig(eos_ids=frozenset({EOS}))

    async def body(handle: SchedulerHandle) -> None:
        running = submit(handle, request("running", [3], max_tokens=60, ignore_eos=True))
        await running.receive()
        for round_ in range(6):
            start = 2 + round_
            streams = [
                submit(handle, request(f"r{round_}", [1, start], max_tokens=5, ignore_eos=True)),
                submit(handle, request(f"n{round_}", [start], max_tokens=3, n=2)),
            ]
            gone = submit(handle, request(f"gone{round_}", [5, 6], max_tokens=9))
            handle.cancel(f"gone{round_}")
            gone.close()
            first, second = [await collect(stream) for stream in streams]
            assert tokens_of(first) == [(start + 1 + i) % VOCAB or 1 for i in range(5)]
            for choice in range(2):
                assert tokens_of(second, choice) == [(start + 1 + i) % VOCAB or 1 for i in range(3)]
        assert len(tokens_of(await collect(running))) == 59
        await anyio.sleep(0.05)
        assert handle.running_rows == 0

    await run_with(engine, config, body)
    packed = [args for kind, args in engine.calls if kind == "packed"]
    assert len(packed) >= 6, "prompts that came while a stream decoded were packed"
    assert engine.running == []
    assert engine.pending == set(), "every prefilled slot was freed or joined"


class GatedFakeEngine(FakeEngine):
    """Holds each prefill until the test lets it go."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.gate = threading.Event()

    def prefill(self, slot: int, token_ids: Sequence[int], *, all_logits: bool = False) -> Logits:
        self.entered.set()
        assert self.gate.wait(10)
        return super().prefill(slot, token_ids, all_logits=all_logits)


@pytest.mark.anyio
async def test_a_request_counts_as_running_while_its_first_step_is_under_way() -> None:
    """The load figures (/metrics, /v1/loads) read a request admitted from
    idle as running from the step that starts it, not only once that step
    is back: a chat stream's first chunk goes out before its first token."""
    engine = GatedFakeEngine()

    async def body(handle: SchedulerHandle) -> None:
        stream = submit(handle, request("r0", [1, 2, 3]))
        assert await anyio.to_thread.run_sync(engine.entered.wait, 10)
        assert handle.running_requests == 1
        engine.gate.set()
        assert tokens_of(await collect(stream)) == chain(3, 4)

    await run_with(engine, SchedulerConfig(eos_ids=frozenset({EOS})), body)
