"""The engine in a child process (``--engine-process``), on both engines."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from sluiceway.actors.engine_process import EngineProcessError, EngineSpec, ProcessEngine
from sluiceway.actors.engine_work import PrefillWork, StepPlan, execute
from sluiceway.actors.sampling import Draw
from sluiceway.actors.thread_tuner import ThreadedEngine
from sluiceway.engines.base import DropKV, KeepKV, SplitKV
from sluiceway.engines.default_model import default_cache_dir
from sluiceway.engines.loader import ModelSource
from sluiceway.engines.select import make_engine, process_environment
from sluiceway.protocol.messages import LogprobParams, SamplingParams
from tests.engines.conftest import ENGINES
from tests.engines.helpers import exact_dtype, greedy_alone
from tests.engines.test_parity import PROMPTS

STEPS = 6


@pytest.fixture(scope="module", params=ENGINES)
def in_child(request: pytest.FixtureRequest, tiny_model: ModelSource) -> Iterator[ProcessEngine]:
    spec = EngineSpec(
        choice=str(request.param),
        source=tiny_model,
        device="auto",
        dtype=exact_dtype(str(request.param)),
    )
    child = ProcessEngine(spec)
    yield child
    child.close()


def test_the_child_decodes_as_the_engine_does(
    in_child: ProcessEngine, tiny_model: ModelSource
) -> None:
    local = make_engine(
        in_child.info.name, tiny_model, device="auto", dtype=exact_dtype(in_child.info.name)
    )
    try:
        for prompt in (PROMPTS["short"], PROMPTS["long"]):
            assert greedy_alone(in_child, prompt, STEPS).tokens == (
                greedy_alone(local, prompt, STEPS).tokens
            )
        # The child says whether it picks its thread count by timing steps:
        # the transformers engine does when given none and having 2 or more.
        tuned = isinstance(local, ThreadedEngine) and local.tunable
        assert in_child.info.threads_tuned is tuned
        assert replace(in_child.info, threads_tuned=False) == local.info
    finally:
        local.close()


@pytest.mark.anyio
async def test_steps_over_the_pipe_match_steps_on_a_thread(
    in_child: ProcessEngine, tiny_model: ModelSource
) -> None:
    """Greedy steps, served from ahead in the child, against ``execute`` in process."""
    local = make_engine(
        in_child.info.name, tiny_model, device="auto", dtype=exact_dtype(in_child.info.name)
    )
    try:
        plan = StepPlan(
            prefills=(
                PrefillWork(request_id="a", slot=3, tokens=tuple(PROMPTS["medium"]), final=True),
            ),
            greedy=True,
        )
        for _ in range(STEPS):
            got = await in_child.start_step(plan).result()
            expected = execute(local, plan)
            if plan.prefills:
                assert got.prefills[0].greedy is not None
                assert expected.prefills[0].greedy is not None
                token = int(expected.prefills[0].greedy[0])
                assert int(got.prefills[0].greedy[0]) == token
            else:
                assert got.decode is not None
                assert got.decode_greedy is not None
                assert expected.decode_greedy is not None
                assert got.decode.slots == (3,)
                token = int(expected.decode_greedy[0])
                assert int(got.decode_greedy[0]) == token
                # A greedy step's logits stay in the child.
                assert got.decode.logits.shape == (1, 0)
            plan = StepPlan(decode={3: token}, greedy=True)
        await in_child.start_step(StepPlan(frees=(3,))).result()
    finally:
        local.close()


@pytest.mark.anyio
async def test_drawn_steps_over_the_pipe_match_steps_on_a_thread(
    in_child: ProcessEngine, tiny_model: ModelSource
) -> None:
    """Sampled rows the child draws, a prompt's two choices among them, with
    logprobs: the same picks and logprobs as ``execute`` in process, and
    only those cross the pipe."""
    local = make_engine(
        in_child.info.name, tiny_model, device="auto", dtype=exact_dtype(in_child.info.name)
    )
    hot = SamplingParams(temperature=1.5)
    scored = LogprobParams(top=3)
    try:
        draws = (Draw.of(hot, 0.1, scored), Draw.of(hot, 0.9))
        prompt = PrefillWork(
            request_id="a",
            slot=3,
            tokens=tuple(PROMPTS["medium"]),
            final=True,
            forks=(4,),
            draws=draws,
        )
        plan = StepPlan(prefills=(prompt,), greedy=True)
        got = await in_child.start_step(plan).result()
        expected = execute(local, plan)
        first, wanted = got.prefills[0], expected.prefills[0]
        assert first.greedy is not None
        assert wanted.greedy is not None
        assert first.greedy.tolist() == wanted.greedy.tolist()
        assert first.first_logprobs == wanted.first_logprobs
        assert first.first_logprobs is not None
        assert first.first_logprobs[1] is None
        tokens = dict(zip((3, 4), first.greedy.tolist(), strict=True))
        for step in range(STEPS):
            uniform = (step + 0.5) / STEPS
            plan = StepPlan(
                decode=tokens,
                greedy=True,
                draws={3: Draw.of(hot, uniform, scored), 4: Draw.of(hot, 1 - uniform)},
            )
            got = await in_child.start_step(plan).result()
            expected = execute(local, plan)
            assert got.decode is not None
            assert got.decode_greedy is not None
            assert expected.decode_greedy is not None
            assert got.decode_greedy.tolist() == expected.decode_greedy.tolist()
            assert got.decode_logprobs == expected.decode_logprobs
            assert got.decode.logits.shape == (2, 0)  # the logits stay in the child
            tokens = dict(zip(got.decode.slots, got.decode_greedy.tolist(), strict=True))
        await in_child.start_step(StepPlan(frees=(3, 4))).result()
    finally:
        local.close()


@pytest.mark.anyio
async def test_prefix_cache_edits_ride_on_the_steps_over_the_pipe(
    in_child: ProcessEngine, tiny_model: ModelSource
) -> None:
    """A chunk kept, a row kept from the batch, an edit that fails: the
    child's outcomes are those of the same plans run in process."""
    local = make_engine(
        in_child.info.name, tiny_model, device="auto", dtype=exact_dtype(in_child.info.name)
    )
    prompt = tuple(PROMPTS["medium"])
    keep = KeepKV(entry=1, slot=3, start=0, end=len(prompt))
    plans = [
        StepPlan(
            prefills=(PrefillWork(request_id="a", slot=3, tokens=prompt, final=True, keep=keep),),
            greedy=True,
        ),
        StepPlan(
            prefills=(
                PrefillWork(
                    request_id="b",
                    slot=4,
                    tokens=(7,),
                    final=True,
                    restore=(1,),
                    restore_length=len(prompt),
                ),
            ),
            decode={3: 7},
            greedy=True,
        ),
        StepPlan(
            cache_ops=(KeepKV(entry=2, slot=3, start=len(prompt), end=len(prompt) + 1),),
            frees=(3, 4),
        ),
        StepPlan(cache_ops=(SplitKV(entry=99, at=1, head=None), DropKV(entry=1), DropKV(entry=2))),
    ]
    try:
        for plan in plans:
            got = await in_child.start_step(plan).result()
            expected = execute(local, plan)
            assert [p.kept for p in got.prefills] == [p.kept for p in expected.prefills]
            assert [p.error for p in got.prefills] == [p.error for p in expected.prefills]
            assert [p.greedy.tolist() for p in got.prefills if p.greedy is not None] == [
                p.greedy.tolist() for p in expected.prefills if p.greedy is not None
            ]
            assert (got.cache_error is None) == (expected.cache_error is None)
            if plan is plans[1]:
                # Restored and prefilled, or decoded: the same sequence, the same token.
                assert got.decode_greedy is not None
                assert got.prefills[0].greedy is not None
                assert got.decode_greedy.tolist() == got.prefills[0].greedy.tolist()
        assert got.cache_error is not None  # the split of an unknown entry
        second = await in_child.start_step(plans[1]).result()
        assert second.prefills[0].error is not None  # entry 1 is gone
    finally:
        local.close()


@pytest.mark.anyio
async def test_a_dead_child_fails_the_step_not_the_server(tiny_model: ModelSource) -> None:
    child = ProcessEngine(
        EngineSpec(choice="transformers", source=tiny_model, device="auto", dtype="float32")
    )
    try:
        child._process.kill()
        child._process.join()
        plan = StepPlan(
            prefills=(PrefillWork(request_id="a", slot=0, tokens=(1, 2), final=True),),
            decode={5: 1},
        )
        outcome = await child.start_step(plan).result()
        assert outcome.prefills[0].error is not None
        assert "engine" in outcome.prefills[0].error
        assert outcome.decode_error is not None
        with pytest.raises(EngineProcessError):
            child.free(0)
    finally:
        child.close()


def test_an_engine_that_cannot_start_says_why(tiny_model: ModelSource) -> None:
    broken = ModelSource(path=tiny_model.path / "missing", config=tiny_model.config, name="x")
    with pytest.raises(EngineProcessError, match="missing"):
        ProcessEngine(EngineSpec(choice="transformers", source=broken, device="auto", dtype="auto"))


def test_a_greedy_decode_crosses_the_pipe_as_plain_values() -> None:
    import pickle
    from dataclasses import replace

    import numpy as np

    from sluiceway.actors.engine_pipe import GreedyDecode, for_pipe
    from sluiceway.actors.engine_work import PrefillOutcome, StepOutcome
    from sluiceway.engines.base import DecodeResult
    from sluiceway.protocol.messages import TokenLogprob

    logits = np.random.default_rng(0).standard_normal((3, 50)).astype(np.float32)
    outcome = StepOutcome(
        prefills=[],
        decode=DecodeResult((7, 2, 9), logits),
        decode_greedy=logits.argmax(axis=-1),
    )
    sent = for_pipe(StepPlan(decode={7: 1, 2: 1, 9: 1}, greedy=True), outcome)
    assert isinstance(sent, GreedyDecode)
    received = pickle.loads(pickle.dumps(sent)).outcome()
    assert received.decode is not None
    assert received.decode_greedy is not None
    assert received.decode.slots == (7, 2, 9)
    assert received.decode_greedy.tolist() == logits.argmax(axis=-1).tolist()
    assert received.decode.logits.shape == (3, 0)
    assert received.prefills == []
    assert received.decode_logprobs is None
    # Drawn rows' logprobs come along, None where a row asked for none.
    scored = [TokenLogprob(-0.25, ((4, -0.25), (1, -2.5)), ((9, -7.0),)), None, TokenLogprob(-1.0)]
    with_logprobs = replace(outcome, decode_logprobs=scored)
    sent = for_pipe(StepPlan(decode={7: 1, 2: 1, 9: 1}, greedy=True), with_logprobs)
    assert isinstance(sent, GreedyDecode)
    received = pickle.loads(pickle.dumps(sent)).outcome()
    assert received.decode_logprobs == scored
    assert received.decode_greedy is not None
    assert received.decode_greedy.tolist() == logits.argmax(axis=-1).tolist()
    # A step that also prefills keeps its shape (zero-width logits), and the
    # outcome left in the child still has its logits for decoding ahead.
    prefilled = PrefillOutcome(logits=logits[:1], greedy=logits[:1].argmax(axis=-1))
    mixed = StepOutcome(
        prefills=[prefilled],
        decode=DecodeResult((7, 2, 9), logits),
        decode_greedy=logits.argmax(axis=-1),
    )
    sent_mixed = for_pipe(StepPlan(decode={7: 1, 2: 1, 9: 1}, greedy=True), mixed)
    assert isinstance(sent_mixed, StepOutcome)
    assert sent_mixed.decode is not None
    assert sent_mixed.decode.logits.shape == (3, 0)
    assert mixed.decode is not None
    assert mixed.decode.logits.shape == (3, 50)
    # Sampled steps send their logits.
    sampled = StepOutcome(prefills=[], decode=DecodeResult((7,), logits[:1]))
    assert for_pipe(StepPlan(decode={7: 1}), sampled) is sampled


def _report_environment(names: list[str], queue: Any) -> None:
    queue.put({name: os.environ.get(name) for name in names})


def test_the_child_starts_with_the_engines_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Variables the parent does not set reach the spawned child, and only it;
    the parent's own settings win."""
    import multiprocessing

    from sluiceway.actors.engine_process import _environment_added

    monkeypatch.setenv("SLUICEWAY_TEST_KEPT", "parent")
    monkeypatch.delenv("SLUICEWAY_TEST_ADDED", raising=False)
    names = ["SLUICEWAY_TEST_ADDED", "SLUICEWAY_TEST_KEPT"]
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    with _environment_added({"SLUICEWAY_TEST_ADDED": "child", "SLUICEWAY_TEST_KEPT": "spec"}):
        child = context.Process(target=_report_environment, args=(names, queue))
        child.start()
    try:
        seen = queue.get(timeout=60)
    finally:
        child.join(10)
    assert seen == {"SLUICEWAY_TEST_ADDED": "child", "SLUICEWAY_TEST_KEPT": "parent"}
    assert "SLUICEWAY_TEST_ADDED" not in os.environ
    assert os.environ["SLUICEWAY_TEST_KEPT"] == "parent"
    assert "OPENBLAS_THREAD_TIMEOUT" in process_environment("mlx")
    assert process_environment("transformers") == {}
    compiled = {"TORCHINDUCTOR_CACHE_DIR": str(default_cache_dir() / "inductor")}
    assert process_environment("transformers", "on") == compiled
    assert process_environment("transformers", "auto") == compiled
    assert process_environment("mlx", "on") == process_environment("mlx")


class _Threaded:
    """An engine stand-in with a thread count (only what the tuning reads)."""

    def __init__(self, threads: int, *, tunable: bool = True) -> None:
        from sluiceway.engines.base import EngineInfo

        self.info = EngineInfo(
            name="transformers",
            device="cpu",
            dtype="float32",
            vocab_size=8,
            max_context=64,
            threads=threads,
        )
        self.threads = threads
        self.tunable = tunable
        self.calls: list[int] = []

    def set_threads(self, count: int) -> None:
        self.threads = count
        self.calls.append(count)


def test_the_child_tunes_its_threads_only_where_the_engine_may_choose() -> None:
    """Whether a count was asked for is the engine's to say (``tunable``:
    ``test_only_an_engine_given_no_thread_count_is_tunable``); an engine
    that cannot change its count is never tuned."""
    from sluiceway.actors.engine_process import _tuning

    assert _tuning(_Threaded(2)) is not None  # type: ignore[arg-type]
    assert _tuning(_Threaded(2, tunable=False)) is None  # type: ignore[arg-type]
    assert _tuning(object()) is None  # type: ignore[arg-type]


def test_the_tuning_times_each_round_and_applies_the_faster_count() -> None:
    """A round is the time from one plan to the next; on a host where one
    thread fewer is faster, the child moves to it. A call between steps
    (a prefix-cache copy, a memory release) is not counted as a round."""
    engine = _Threaded(2)
    tuning = _tuned(engine)
    # After a pause the first round has nothing to be timed against.
    tuning.pause()
    assert tuning.since is None
    tuning.before(StepPlan(prefills=_PREFILL))
    assert tuning.rows == 0
    assert not tuning.steady


_FOUR_ROWS = StepPlan(decode=dict.fromkeys(range(4), 1))
_PREFILL = (PrefillWork(request_id="r", slot=9, tokens=(1, 2), final=True),)


def _tuned(engine: _Threaded, *, faster: int = 1) -> Any:
    """A tuning whose steps of four rows ran faster on ``faster`` threads."""
    from sluiceway.actors.engine_process import _Tuning
    from sluiceway.actors.thread_tuner import ThreadTuner

    now = [0.0]
    tuning = _Tuning(engine, ThreadTuner(2), 2, clock=lambda: now[0])
    for _ in range(200):
        tuning.before(_FOUR_ROWS)
        now[0] += 0.006 if engine.threads == faster else 0.010
    assert engine.threads == faster
    return tuning


def test_a_prefill_runs_on_the_count_of_the_batch_it_joins() -> None:
    """Where one thread fewer decodes faster (another process holds a core,
    and OpenMP's threads spin), prefills on every thread tripled the TTFT at
    16 streams: a prefill follows the batch's count, and one row's count
    when it decodes none (a new bucket starts on its nearest decided one's)."""
    for faster in (1, 2):
        engine = _Threaded(2)
        tuning = _tuned(engine, faster=faster)
        for decode in (_FOUR_ROWS.decode, {}):
            tuning.before(StepPlan(decode=decode, prefills=_PREFILL))
            assert engine.threads == faster
        tuning.before(_FOUR_ROWS)
        assert engine.threads == faster
