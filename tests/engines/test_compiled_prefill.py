"""A new prompt's first chunk through the compiled prefill graph (with
``--compile on``, or ``auto`` where the one-row step is kept; auto's choice
is in test_compiled_step.py).

Most tests trace with Dynamo's ``eager`` backend (a second, not a compile):
what is under test is which chunks take the graph and what the row's cache
holds after it. The last holds Inductor's graph to the eager prefill.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from sluiceway.actors.engine_work import PrefillWork, StepPlan, execute
from sluiceway.engines import torch_engine
from sluiceway.engines.loader import ModelSource
from sluiceway.engines.torch_compiled import CompiledStep
from sluiceway.engines.torch_compiled_prefill import CompiledPrefill
from sluiceway.engines.torch_engine import PREFILL_STEP, TransformersEngine
from tests.engines.helpers import (
    Trace,
    assert_same_trace,
    greedy_alone,
    log_softmax,
    run_schedule,
)

pytestmark = pytest.mark.timeout(900)


def prompt(seed: int, length: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 500, length)]


@pytest.fixture(scope="module")
def eager(tiny_model: ModelSource) -> Iterator[TransformersEngine]:
    engine = TransformersEngine(tiny_model, dtype="float32")
    yield engine
    engine.close()


def _engine(
    source: ModelSource, monkeypatch: pytest.MonkeyPatch, backend: Any, threads: int = 0
) -> TransformersEngine:
    monkeypatch.setattr(
        torch_engine, "CompiledStep", functools.partial(CompiledStep, backend="eager")
    )
    monkeypatch.setattr(
        torch_engine, "CompiledPrefill", functools.partial(CompiledPrefill, backend=backend)
    )
    return TransformersEngine(
        source, dtype="float32", compile="on", compile_max_batch=2, threads=threads
    )


@pytest.fixture
def traced(
    tiny_model: ModelSource, monkeypatch: pytest.MonkeyPatch
) -> Iterator[TransformersEngine]:
    engine = _engine(tiny_model, monkeypatch, "eager")
    yield engine
    engine.close()


def _runs(engine: TransformersEngine) -> int:
    graph = engine._compiled_prefill
    assert graph is not None
    return graph.runs


def test_new_prompts_go_through_the_graph_and_decode_as_the_eager_engines(
    traced: TransformersEngine, eager: TransformersEngine
) -> None:
    prompts = {0: prompt(1, 9), 1: prompt(2, 30), 2: prompt(3, 2)}
    joins, leaves = {0: [0], 2: [1], 3: [2]}, {5: [0]}
    got = run_schedule(traced, prompts, joins, leaves, 8)
    want = run_schedule(eager, prompts, joins, leaves, 8)
    assert _runs(traced) == 3
    for (slot, trace), (_, expected) in zip(got, want, strict=True):
        assert_same_trace(trace, expected, f"slot {slot}")


def test_what_the_graph_does_not_fit_is_prefilled_eagerly(
    traced: TransformersEngine, eager: TransformersEngine
) -> None:
    # One token: a size torch specialises.
    traced.prefill(0, [7])
    assert _runs(traced) == 0
    traced.free(0)
    # Every position's logits (prompt logprobs): the graph keeps only the last.
    everything = traced.prefill(0, prompt(4, 12), all_logits=True)
    assert everything.shape[0] == 12
    assert _runs(traced) == 0
    traced.free(0)
    # A long prompt: its first chunk takes the graph, the next one (a row
    # with a past) the eager forward, and the row decodes as the eager one's.
    long = prompt(5, PREFILL_STEP + 40)
    assert_same_trace(greedy_alone(traced, long, 3), greedy_alone(eager, long, 3), "long")
    assert _runs(traced) == 1


def test_a_graph_that_fails_is_given_up_for_good(
    tiny_model: ModelSource, eager: TransformersEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def failing(graph: Any, inputs: Any) -> Any:
        calls.append(1)
        raise RuntimeError("no C++ compiler here")

    torch._dynamo.reset()
    engine = _engine(tiny_model, monkeypatch, failing)
    first, second = prompt(6, 8), prompt(7, 10)
    assert_same_trace(greedy_alone(engine, first, 3), greedy_alone(eager, first, 3), "first")
    graph = engine._compiled_prefill
    assert graph is not None
    assert not graph.active
    assert "no C++ compiler here" in (graph.failure or "")
    tried = len(calls)
    assert_same_trace(greedy_alone(engine, second, 3), greedy_alone(eager, second, 3), "second")
    assert len(calls) == tried
    engine.close()


class _Counted:
    """The compiled decode step, counting its runs."""

    def __init__(self, step: Any) -> None:
        self.step, self.runs = step, 0

    def bucket(self, rows: int) -> int | None:
        return self.step.bucket(rows)  # type: ignore[no-any-return]

    def __call__(self, *args: Any) -> Any:
        self.runs += 1
        return self.step(*args)


def test_graphs_run_only_on_the_engines_whole_thread_count(
    tiny_model: ModelSource, eager: TransformersEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the fewer threads the child's tuner chose, a step is eager: the
    tuner's choice is one of the eager step on fewer threads (where another
    process takes a core, the faster), and Dynamo guards a graph on the
    thread count, so a graph run there would compile again, on a request."""
    from torch._dynamo.utils import counters

    engine = _engine(tiny_model, monkeypatch, "eager", threads=2)
    step = _Counted(engine._compiled)
    engine._compiled = step  # type: ignore[assignment]
    try:
        greedy_alone(engine, prompt(11, 6), 3)  # the prefill and bucket 1, on 2 threads
        graphs, runs, steps = counters["stats"]["unique_graphs"], _runs(engine), step.runs
        assert (runs, steps) == (1, 2)
        engine.set_threads(1)
        tokens = prompt(12, 7)
        assert_same_trace(greedy_alone(engine, tokens, 3), greedy_alone(eager, tokens, 3), "1")
        assert (_runs(engine), step.runs) == (runs, steps)  # eager on 1 thread
        assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled again
        assert torch.get_num_threads() == 1  # the eager steps keep the tuner's count
        engine.set_threads(2)
        greedy_alone(engine, prompt(13, 8), 3)
        assert (_runs(engine), step.runs) == (runs + 1, steps + 2)
    finally:
        engine.set_threads(2)
        engine.close()


def test_inductors_graph_prefills_as_the_eager_forward(
    compiled_transformers: TransformersEngine, eager: TransformersEngine
) -> None:
    """The session's ``--compile on`` engine (Inductor, float32): one graph
    for prompts of several lengths, their rows then decode as the eager ones."""
    graph = compiled_transformers._compiled_prefill
    assert graph is not None
    before = graph.runs
    for seed, length in ((8, 5), (9, 37), (10, 130)):
        tokens = prompt(seed, length)
        got = greedy_alone(compiled_transformers, tokens, 4)
        assert_same_trace(got, greedy_alone(eager, tokens, 4), f"{length} tokens")
    assert graph.active, graph.failure
    assert graph.runs == before + 3


def prefilled_together(
    engine: TransformersEngine, prompts: dict[int, list[int]], steps: int
) -> dict[int, Trace]:
    """The prompts prefilled in one pass with no decode (as the later passes
    of a step that prefills several are), then decoded together greedily."""
    traces = {slot: Trace() for slot in prompts}
    nothing, lasts = engine.decode_prefilling({}, list(prompts.items()))
    assert nothing.slots == ()
    tokens = {slot: traces[slot].take(last[0]) for slot, last in zip(prompts, lasts, strict=True)}
    for _ in range(steps - 1):
        result = engine.decode(tokens)
        rows = zip(result.slots, result.logits, strict=True)
        tokens = {slot: traces[slot].take(row) for slot, row in rows}
    for slot in prompts:
        engine.free(slot)
    return traces


def assert_same_traces(got: dict[int, Trace], want: dict[int, Trace]) -> None:
    for slot, trace in got.items():
        assert_same_trace(trace, want[slot], f"slot {slot}")


def test_new_prompts_prefilled_together_go_through_the_batch_graph(
    traced: TransformersEngine, eager: TransformersEngine
) -> None:
    """Rows of different lengths, padded on the right to the longest: each
    takes its logits at its own last position, and its cache holds only its
    own positions (its decode then matches the eager engine's packed pass)."""
    prompts = {0: prompt(13, 20), 1: prompt(14, 17), 2: prompt(15, 19)}
    got = prefilled_together(traced, prompts, 4)
    assert _runs(traced) == 3
    assert_same_traces(got, prefilled_together(eager, prompts, 4))
    assert_same_traces(got, {slot: greedy_alone(eager, ids, 4) for slot, ids in prompts.items()})


def test_what_the_batch_graph_does_not_fit_is_packed_eagerly(
    traced: TransformersEngine, eager: TransformersEngine
) -> None:
    cases = [
        {0: prompt(16, 40), 1: prompt(17, 8)},  # padding past a quarter of the tokens
        {0: prompt(18, 12), 1: [9]},  # one token: a size torch specialises
    ]
    for prompts in cases:
        assert_same_traces(
            prefilled_together(traced, prompts, 3), prefilled_together(eager, prompts, 3)
        )
    # A row with a past: a prefix already in its cache.
    past, rest = prompt(19, 10), prompt(20, 10)
    traced.prefill(0, past)
    runs = _runs(traced)
    _, lasts = traced.decode_prefilling({}, [(0, rest), (1, prompt(21, 10))])
    assert _runs(traced) == runs
    want = eager.prefill(0, past + rest)[-1]
    assert float(np.max(np.abs(log_softmax(lasts[0][0]) - log_softmax(want)))) < 1e-4
    for slot in (0, 1):
        traced.free(slot)
    eager.free(0)


def test_a_batch_graph_that_fails_is_given_up_alone(
    traced: TransformersEngine, eager: TransformersEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model whose forward takes no tensor of logit positions loses the
    batch graph; the one-row graph goes on."""
    graph = traced._compiled_prefill
    assert graph is not None

    def failing(*inputs: Any) -> Any:
        raise TypeError("logits_to_keep must be an int")

    monkeypatch.setattr(graph, "_compiled_rows", failing)
    prompts = {0: prompt(22, 11), 1: prompt(23, 12)}
    assert_same_traces(
        prefilled_together(traced, prompts, 3), prefilled_together(eager, prompts, 3)
    )
    assert not graph.rows_active
    assert graph.active
    assert "logits_to_keep must be an int" in (graph.rows_failure or "")
    runs = _runs(traced)
    greedy_alone(traced, prompt(24, 9), 2)
    assert _runs(traced) == runs + 1


def test_inductors_batch_graph_prefills_as_the_eager_forward(
    compiled_transformers: TransformersEngine, eager: TransformersEngine
) -> None:
    """The batch graph through Inductor (float32), at three batch sizes,
    rows of one length and of several: rows that then decode as the eager
    ones."""
    graph = compiled_transformers._compiled_prefill
    assert graph is not None
    before = graph.runs
    for seed, lengths in ((25, (30, 33, 36)), (26, (70, 64)), (27, (9, 9, 9, 9))):
        prompts = {slot: prompt(seed + slot, n) for slot, n in enumerate(lengths)}
        got = prefilled_together(compiled_transformers, prompts, 4)
        assert_same_traces(got, prefilled_together(eager, prompts, 4))
    assert graph.rows_active, graph.rows_failure
    assert graph.runs == before + 9


def test_enough_new_prompts_are_prefilled_apart_from_a_decode(
    traced: TransformersEngine, eager: TransformersEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that decodes and prefills new prompts holding enough tokens
    runs them through the batch graph, and its decode on its own: the same
    logits as the eager engine's one packed pass. Too few tokens, or a row
    with a past, stay packed with the decode."""
    monkeypatch.setattr(torch_engine, "APART_MIN_TOKENS", 40)
    assert not traced.prefills_apart([(1, 20)])
    assert traced.prefills_apart([(1, 20), (2, 22)])
    assert not traced.prefills_apart([(1, 20), (2, 40)])  # past the padding the graph takes
    traced.prefill(3, prompt(31, 5))
    assert not traced.prefills_apart([(3, 20), (2, 22)])  # row 3 holds a past
    traced.free(3)
    assert not eager.prefills_apart([(1, 20), (2, 22)])  # no graph to take them
    outcomes, runs = [], _runs(traced)
    for engine in (traced, eager):
        first = engine.prefill(0, prompt(32, 6))[-1]
        works = tuple(
            PrefillWork(
                request_id=str(slot), slot=slot, tokens=tuple(prompt(32 + slot, n)), final=True
            )
            for slot, n in ((1, 20), (2, 22))
        )
        plan = StepPlan(decode={0: int(first.argmax())}, greedy=True, prefills=works)
        outcomes.append(execute(engine, plan, pack=True))
        for slot in (0, 1, 2):
            engine.free(slot)
    assert _runs(traced) == runs + 3  # row 0's prompt, then the two taken apart
    got, want = outcomes
    assert got.decode is not None
    assert want.decode is not None
    pairs = [(got.decode.logits, want.decode.logits)]
    pairs += [(g.logits, w.logits) for g, w in zip(got.prefills, want.prefills, strict=True)]
    for mine, theirs in pairs:
        assert mine is not None
        assert theirs is not None
        assert float(np.max(np.abs(log_softmax(mine) - log_softmax(theirs)))) < 1e-4


def test_a_frozen_decode_takes_fewer_new_tokens_apart(
    traced: TransformersEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the running rows decode through a graph with frozen weights, its
    own pass is cheap, and new prompts go apart from APART_MIN_TOKENS_FROZEN
    tokens; otherwise from APART_MIN_TOKENS (and not past the largest
    bucket, where the decode is eager)."""
    monkeypatch.setattr(torch_engine, "APART_MIN_TOKENS", 80)
    monkeypatch.setattr(torch_engine, "APART_MIN_TOKENS_FROZEN", 40)
    chunks = [(1, 20), (2, 22)]
    assert not traced.prefills_apart(chunks)
    step = traced.compiled_step
    assert step is not None
    monkeypatch.setattr(type(step), "frozen", property(lambda _: True))
    assert traced.prefills_apart(chunks)
    assert not traced.prefills_apart([(1, 18), (2, 20)])
    monkeypatch.setattr(type(step), "bucket", lambda _, rows: None)
    assert not traced.prefills_apart(chunks)
