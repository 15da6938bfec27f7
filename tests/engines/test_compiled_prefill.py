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

from sluiceway.engines import torch_engine
from sluiceway.engines.loader import ModelSource
from sluiceway.engines.torch_compiled import CompiledStep
from sluiceway.engines.torch_compiled_prefill import CompiledPrefill
from sluiceway.engines.torch_engine import PREFILL_STEP, TransformersEngine
from tests.engines.helpers import assert_same_trace, greedy_alone, run_schedule

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


def test_graphs_run_on_the_engines_thread_count_whatever_the_tuner_set(
    tiny_model: ModelSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dynamo guards a graph on the thread count: a graph run on the count
    the child's tuner chose for eager steps would compile again, on a request."""
    from torch._dynamo.utils import counters

    engine = _engine(tiny_model, monkeypatch, "eager", threads=2)
    try:
        greedy_alone(engine, prompt(11, 6), 3)  # the prefill and bucket 1, on 2 threads
        graphs = counters["stats"]["unique_graphs"]
        runs = _runs(engine)
        engine.set_threads(1)
        greedy_alone(engine, prompt(12, 7), 3)
        assert _runs(engine) == runs + 1
        assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled again
        assert torch.get_num_threads() == 1  # the eager steps keep the tuner's count
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
