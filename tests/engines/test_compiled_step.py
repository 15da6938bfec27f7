"""The compiled decode step (``--compile on``) against the eager one, and
``--compile auto``'s choice of it (at the end).

Compiling is slow (seconds per batch bucket), so one compiled engine serves
the session (conftest's ``compiled_transformers``) and it compiles only the
buckets 1, 2 and 4; larger batches take the eager step. The parity suite
(test_parity.py) runs it as a third engine, against plain transformers.
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from sluiceway.engines import torch_engine
from sluiceway.engines.compile_choice import Verdict, VerdictStore, time_rounds
from sluiceway.engines.loader import ModelSource, resolve_model
from sluiceway.engines.torch_compiled import CompiledStep, bucket_for
from sluiceway.engines.torch_compiled_prefill import CompiledPrefill
from sluiceway.engines.torch_engine import TransformersEngine
from tests.engines.conftest import COMPILE_MAX_BATCH
from tests.engines.helpers import assert_same_trace, run_schedule

#: Each batch bucket compiles on its first step: 23-81 s on a cold Inductor
#: cache on a 2-core host (bench/compile-results.md), three buckets in a test.
pytestmark = pytest.mark.timeout(900)

MAX_BATCH = COMPILE_MAX_BATCH


def compiled_engine(source: ModelSource) -> TransformersEngine:
    return TransformersEngine(source, dtype="float32", compile="on", compile_max_batch=MAX_BATCH)


@pytest.fixture
def compiled(compiled_transformers: TransformersEngine) -> Iterator[TransformersEngine]:
    yield compiled_transformers
    compiled_transformers.close()


@pytest.fixture(scope="module")
def eager(tiny_model: ModelSource) -> Iterator[TransformersEngine]:
    engine = TransformersEngine(tiny_model, dtype="float32")
    yield engine
    engine.close()


def prompt(seed: int, length: int) -> list[int]:
    return [
        int(t)
        for t in torch.randint(0, 500, (length,), generator=torch.Generator().manual_seed(seed))
    ]


def test_buckets_pad_up_to_the_next_size() -> None:
    assert [bucket_for(rows) for rows in (1, 2, 3, 4, 5, 64)] == [1, 2, 4, 4, 8, 64]
    assert bucket_for(65) is None
    assert bucket_for(3, (1, 2)) is None


def test_a_step_limited_to_fewer_buckets_decodes_larger_batches_eagerly() -> None:
    step = CompiledStep(object(), "past_key_values", buckets=(1, 2, 4))
    step.limit((1, 2))
    assert [step.bucket(rows) for rows in (1, 2, 3)] == [1, 2, None]
    with pytest.raises(ValueError, match="not a prefix"):
        step.limit((2,))
    step.limit(())
    assert step.bucket(1) is None


def test_compiled_rows_equal_eager_rows_in_every_bucket(
    compiled: TransformersEngine, eager: TransformersEngine
) -> None:
    """Rows join one by one (buckets 1, 2, 4, with padding at 3) and leave;
    the longest prompt's past crosses two time steps (256 positions) and the
    graphs are reused there: no new graph past the buckets'."""
    from torch._dynamo.utils import counters

    step = compiled.compiled_step
    assert step is not None
    prompts = {
        0: prompt(1, 300),
        1: prompt(2, 9),
        2: prompt(3, 40),
        3: prompt(4, 500),
        4: prompt(5, 3),
    }
    joins = {0: [0], 2: [1], 4: [2], 6: [3], 9: [4]}
    leaves = {8: [1], 12: [0]}
    before = dict(step.steps)
    graphs = counters["stats"]["unique_graphs"]
    got = run_schedule(compiled, prompts, joins, leaves, 16)
    want = run_schedule(eager, prompts, joins, leaves, 16)
    assert step.failure is None
    assert [s for s, _ in got] == [s for s, _ in want]
    for (slot, trace), (_, expected) in zip(got, want, strict=True):
        assert_same_trace(trace, expected, f"slot {slot}")
    ran = {bucket: step.steps[bucket] - before[bucket] for bucket in step.buckets}
    assert ran[1] >= 2, ran
    assert ran[2] >= 2, ran
    assert ran[4] >= 5, ran
    # One graph per bucket, and the compiled prefill's (one for every length).
    assert counters["stats"]["unique_graphs"] - graphs <= len(step.buckets) + 1


def test_a_longer_past_and_a_larger_buffer_reuse_the_graph(
    compiled: TransformersEngine, eager: TransformersEngine
) -> None:
    """One row decodes until its buffers are reallocated (a new time
    capacity, new strides): the same graph serves before and after."""
    from torch._dynamo.utils import counters

    prompts, joins = {0: prompt(40, 500)}, {0: [0]}
    got = run_schedule(compiled, prompts, joins, {}, 1)  # bucket 1 compiled, if it was not
    graphs = counters["stats"]["unique_graphs"]
    compiled.prefill(0, prompts[0])
    token = 7
    compiled.decode({0: token})
    batch = compiled._batch
    assert batch is not None
    capacities = {batch.time_capacity}
    for _ in range(300):  # past 768 positions: a 768-position buffer is reallocated
        token = int(compiled.decode({0: token}).logits[0].argmax())
        capacities.add(batch.time_capacity)
    compiled.free(0)
    assert len(capacities) > 1, capacities
    assert counters["stats"]["unique_graphs"] == graphs
    got = run_schedule(compiled, prompts, joins, {}, 40)
    for (slot, trace), (_, expected) in zip(
        got, run_schedule(eager, prompts, joins, {}, 40), strict=True
    ):
        assert_same_trace(trace, expected, f"slot {slot}")


def test_a_batch_past_the_largest_bucket_decodes_eagerly(
    compiled: TransformersEngine, eager: TransformersEngine
) -> None:
    step = compiled.compiled_step
    assert step is not None
    prompts = {slot: prompt(10 + slot, 5 + slot) for slot in range(MAX_BATCH + 1)}
    joins = {0: list(prompts)}
    before = sum(step.steps.values())
    got = run_schedule(compiled, prompts, joins, {}, 3)
    assert sum(step.steps.values()) == before
    for (slot, trace), (_, expected) in zip(
        got, run_schedule(eager, prompts, joins, {}, 3), strict=True
    ):
        assert_same_trace(trace, expected, f"slot {slot}")


def _failing_backend(graph: Any, inputs: Any) -> Any:
    raise RuntimeError("no C++ compiler here")


def test_a_failed_compile_falls_back_to_eager(
    tiny_model: ModelSource,
    eager: TransformersEngine,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(
        torch_engine, "CompiledStep", functools.partial(CompiledStep, backend=_failing_backend)
    )
    engine = compiled_engine(tiny_model)
    step = engine.compiled_step
    assert step is not None
    assert step.failure is None
    prompts = {0: prompt(20, 30), 1: prompt(21, 7)}
    joins = {0: [0, 1]}
    with caplog.at_level(logging.WARNING, logger="sluiceway.engines.torch_compiled"):
        got = run_schedule(engine, prompts, joins, {}, 4)
    engine.close()
    assert step.failure is not None
    assert "no C++ compiler here" in step.failure
    assert "decoding eagerly" in caplog.text
    assert sum(step.steps.values()) == 0
    assert step.bucket(1) is None
    for (slot, trace), (_, expected) in zip(
        got, run_schedule(eager, prompts, joins, {}, 4), strict=True
    ):
        assert_same_trace(trace, expected, f"slot {slot}")


def test_compile_off_builds_no_step_and_a_bad_mode_is_refused(tiny_model: ModelSource) -> None:
    engine = TransformersEngine(tiny_model, dtype="float32", compile="off")
    assert engine.compiled_step is None
    engine.close()
    with pytest.raises(ValueError, match="--compile must be one of"):
        TransformersEngine(tiny_model, dtype="float32", compile="yes")
    with pytest.raises(ValueError, match="--compile-max-batch must be at least 1"):
        TransformersEngine(tiny_model, dtype="float32", compile="on", compile_max_batch=0)


def test_a_sliding_window_model_decodes_eagerly_and_says_why(
    tiny_model: ModelSource, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The compiled step takes the ready mask of full-attention models only."""
    target = tmp_path / "sliding"
    shutil.copytree(tiny_model.path, target)
    config = json.loads((target / "config.json").read_text())
    layers = config["num_hidden_layers"]
    config.update(
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=layers,
        layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"],
    )
    (target / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="sluiceway.engines.torch_engine"):
        engine = compiled_engine(resolve_model(str(target)))
    assert engine.compiled_step is None
    assert "--compile on: decoding eagerly" in caplog.text
    assert "sliding-window" in caplog.text
    engine.prefill(0, prompt(30, 12))
    assert engine.decode({0: 5}).logits.shape == (1, engine.info.vocab_size)
    engine.close()


# -- --compile auto: the verdict, taken with a cheap backend ------------------------------
# Dynamo without Inductor (backend "eager") traces the same step in a second or
# so: what auto decides is under test here, the graphs' equality is above.


def _auto_engine(source: ModelSource, store: VerdictStore) -> TransformersEngine:
    return TransformersEngine(
        source, dtype="float32", compile="auto", compile_max_batch=2, compile_verdicts=store
    )


def _timed(*speedups: float) -> Any:
    """``time_rounds`` running each kind of step once (so the scratch rows
    really decode both ways), then reporting step times whose ratio is the
    next of ``speedups`` (one per bucket timed, in order)."""
    left = list(speedups)

    def timed(*args: Any, **kwargs: Any) -> tuple[list[float], list[float]]:
        real_eager, real_compiled = time_rounds(*args, rounds=1, steps=1)
        assert len(real_eager) == len(real_compiled) == 1
        return [1e-3 * left.pop(0)] * 3, [1e-3] * 3

    return timed


def _untimed(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a stored verdict is not measured again")


@pytest.fixture
def cheap_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        torch_engine, "CompiledStep", functools.partial(CompiledStep, backend="eager")
    )
    monkeypatch.setattr(
        torch_engine, "CompiledPrefill", functools.partial(CompiledPrefill, backend="eager")
    )


def _decode_verdicts(directory: Path) -> Path:
    (stored,) = [path for path in directory.iterdir() if not path.stem.endswith("-prefill")]
    return stored


@pytest.mark.usefixtures("cheap_compile")
def test_auto_keeps_a_faster_step_and_compiles_its_buckets_before_serving(
    tiny_model: ModelSource,
    eager: TransformersEngine,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch_engine, "time_rounds", _timed(2.0, 1.5, 1.3))
    store = VerdictStore(tmp_path)
    engine = _auto_engine(tiny_model, store)
    step = engine.compiled_step
    assert step is not None
    assert step.buckets == (1, 2)
    assert all(count >= 1 for count in step.steps.values()), step.steps  # compiled at start
    stored = _decode_verdicts(tmp_path)
    assert store.load(stored.stem) == [Verdict(1, 2.0, True), Verdict(2, 1.5, True)]
    # The one-row step is compiled, so the prefill was timed too, and kept.
    assert store.load(f"{stored.stem}-prefill") == [Verdict(64, 1.3, True)]
    graph = engine._compiled_prefill
    assert graph is not None
    runs = graph.runs
    # The scratch rows are gone: every slot is free, and rows decode as the eager engine's.
    prompts = {0: prompt(40, 9), 1: prompt(41, 5)}
    got = run_schedule(engine, prompts, {0: [0, 1]}, {}, 3)
    expected = run_schedule(eager, prompts, {0: [0, 1]}, {}, 3)
    for (slot, trace), (_, want) in zip(got, expected, strict=True):
        assert_same_trace(trace, want, f"slot {slot}")
    assert graph.runs == runs + 2  # both new prompts went through it
    engine.close()
    # A later start takes the stored verdicts without timing again.
    monkeypatch.setattr(torch_engine, "time_rounds", _untimed)
    again = _auto_engine(tiny_model, store)
    assert again.compiled_step is not None
    assert again.compiled_step.buckets == (1, 2)
    assert all(count == 1 for count in again.compiled_step.steps.values())
    assert again._compiled_prefill is not None
    # Compiled at start, from the stored verdict: one row, and the batch
    # graph's two forms (three rows of one length, then of two).
    assert again._compiled_prefill.runs == 1 + 3 + 3
    assert again._compiled_prefill.rows_active
    again.close()


@pytest.mark.usefixtures("cheap_compile")
def test_auto_stops_at_the_first_bucket_that_is_not_faster(
    tiny_model: ModelSource,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(torch_engine, "time_rounds", _timed(1.5, 1.0, 1.05))
    store = VerdictStore(tmp_path)
    with caplog.at_level(logging.INFO, logger="sluiceway.engines.torch_engine"):
        engine = _auto_engine(tiny_model, store)
    step = engine.compiled_step
    assert step is not None
    assert step.buckets == (1,)
    assert "batches up to 1 (compiled ÷ eager 1: 1.50x, 2: 1.00x, measured)" in caplog.text
    assert engine._compiled_prefill is None  # the prefill's 1.05x is not enough
    assert "eager prefill (compiled ÷ eager 1.05x for 64 tokens, measured)" in caplog.text
    assert step.bucket(1) == 1
    assert step.bucket(2) is None
    engine.prefill(0, prompt(44, 5))
    engine.prefill(1, prompt(45, 6))
    before = dict(step.steps)
    assert engine.decode({0: 5, 1: 6}).slots == (0, 1)
    assert step.steps == before  # two rows: eager
    engine.close()


@pytest.mark.usefixtures("cheap_compile")
def test_auto_decodes_eagerly_where_the_compiled_step_is_not_faster(
    tiny_model: ModelSource,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(torch_engine, "time_rounds", _timed(1.05))
    store = VerdictStore(tmp_path)
    with caplog.at_level(logging.INFO, logger="sluiceway.engines.torch_engine"):
        engine = _auto_engine(tiny_model, store)
    assert engine.compiled_step is None
    assert "decoding eagerly (compiled ÷ eager 1: 1.05x, measured)" in caplog.text
    engine.prefill(0, prompt(42, 6))
    assert engine.decode({0: 5}).slots == (0,)
    engine.close()
    (stored,) = tmp_path.iterdir()  # no prefill verdict: the one-row step is eager
    assert store.load(stored.stem) == [Verdict(1, 1.05, False)]  # bucket 2 never timed
    # Later starts neither time nor compile.
    monkeypatch.setattr(torch_engine, "time_rounds", _untimed)
    monkeypatch.setattr(torch_engine, "CompiledStep", _CountingStep)
    again = _auto_engine(tiny_model, store)
    assert again.compiled_step is None
    assert _CountingStep.calls == 0
    again.close()


class _CountingStep(CompiledStep):
    calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        _CountingStep.calls += 1
        return super().__call__(*args, **kwargs)


def test_auto_stores_no_verdict_when_compiling_fails(
    tiny_model: ModelSource, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        torch_engine, "CompiledStep", functools.partial(CompiledStep, backend=_failing_backend)
    )
    engine = _auto_engine(tiny_model, VerdictStore(tmp_path))
    assert engine.compiled_step is None
    assert list(tmp_path.iterdir()) == []
    engine.prefill(0, prompt(43, 4))
    assert engine.decode({0: 5}).slots == (0,)
    engine.close()
