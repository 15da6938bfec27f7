"""``--compile auto``'s pure parts: the verdict, its key, its store, the timing rounds."""

from __future__ import annotations

import itertools
import json
import logging
import statistics
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluiceway.engines.compile_choice import (
    MIN_SPEEDUP,
    SCRATCH_PROMPT,
    UNTIMED_STEPS,
    Verdict,
    VerdictStore,
    decide,
    kept_buckets,
    scratch_prompts,
    time_rounds,
    verdict_key,
)


def test_the_compiled_step_is_kept_from_the_threshold_up() -> None:
    assert decide(1, [1.1], [1.0]) == Verdict(bucket=1, speedup=1.1, keep=True)
    assert decide(1, [1.0999], [1.0]).keep is False
    assert decide(4, [2.0, 2.0, 2.0], [1.0, 1.0, 1.0]) == Verdict(bucket=4, speedup=2.0, keep=True)
    assert decide(1, [1.0], [1.0], threshold=1.0).keep is True
    assert MIN_SPEEDUP > 1.0


def test_the_kept_buckets_end_at_the_first_loss() -> None:
    def verdict(bucket: int, keep: bool) -> Verdict:
        return Verdict(bucket=bucket, speedup=1.5 if keep else 1.0, keep=keep)

    assert kept_buckets([]) == ()
    assert kept_buckets([verdict(1, False)]) == ()
    assert kept_buckets([verdict(1, True), verdict(2, True)]) == (1, 2)
    assert kept_buckets([verdict(1, True), verdict(2, False), verdict(4, True)]) == (1,)


def test_one_slow_step_does_not_flip_the_verdict() -> None:
    """Medians: a step the host preempted does not decide."""
    assert decide(1, [1.0, 1.0, 1.0, 1.0, 50.0], [1.0, 1.0, 1.0, 1.0, 1.0]).keep is False
    assert decide(1, [2.0, 2.0, 2.0], [1.0, 1.0, 30.0]).keep is True


def test_a_verdict_needs_both_kinds_of_step() -> None:
    with pytest.raises(ValueError, match="at least one timing"):
        decide(1, [], [1.0])
    with pytest.raises(ValueError, match="at least one timing"):
        decide(1, [1.0], [])


@given(
    st.lists(st.floats(1e-4, 1.0), min_size=1, max_size=20),
    st.lists(st.floats(1e-4, 1.0), min_size=1, max_size=20),
)
def test_keeping_is_a_speedup_at_the_threshold_or_above(
    eager: list[float], compiled: list[float]
) -> None:
    verdict = decide(2, eager, compiled)
    speedup = statistics.median(eager) / statistics.median(compiled)
    assert verdict.keep == (speedup >= MIN_SPEEDUP)
    assert verdict.speedup == round(speedup, 3)


def _model(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"x" * 10)
    return model


def test_the_key_follows_the_model_files_and_the_settings(tmp_path: Path) -> None:
    model = _model(tmp_path)
    base = {"dtype": "float32", "threads": 2, "torch_version": "2.13.0", "buckets": (1, 2)}
    key = verdict_key(model, **base)  # type: ignore[arg-type]
    assert key == verdict_key(model, **base)  # type: ignore[arg-type]
    assert len(key) == 32
    changes = (
        {"dtype": "bfloat16"},
        {"threads": 1},
        {"torch_version": "2.14.0"},
        {"buckets": (1,)},
        {"prepacked": True},
    )
    for change in changes:
        assert verdict_key(model, **(base | change)) != key  # type: ignore[arg-type]
    (model / "model.safetensors").write_bytes(b"y" * 11)
    assert verdict_key(model, **base) != key  # type: ignore[arg-type]
    other = tmp_path / "other"
    model.rename(other)
    assert verdict_key(other, **base) != key  # type: ignore[arg-type]


def test_the_key_follows_openmps_wait_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model(tmp_path)
    base = {"dtype": "float32", "threads": 2, "torch_version": "2.13.0", "buckets": (1, 2)}
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    spinning = verdict_key(model, **base)  # type: ignore[arg-type]
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    sleeping = verdict_key(model, **base)  # type: ignore[arg-type]
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")
    assert len({spinning, sleeping, verdict_key(model, **base)}) == 3  # type: ignore[arg-type]


def test_the_store_keeps_verdicts_and_reads_nothing_from_a_bad_file(tmp_path: Path) -> None:
    store = VerdictStore(tmp_path / "compile")
    assert store.load("k") is None
    verdicts = [Verdict(bucket=1, speedup=1.61, keep=True), Verdict(4, 1.02, False)]
    store.save("k", verdicts)
    assert store.load("k") == verdicts
    assert json.loads((tmp_path / "compile" / "k.json").read_text()) == [
        {"bucket": 1, "speedup": 1.61, "keep": True},
        {"bucket": 4, "speedup": 1.02, "keep": False},
    ]
    assert [p.name for p in (tmp_path / "compile").iterdir()] == ["k.json"]
    for broken in (
        "[",
        "{}",
        "[]",
        '[{"speedup": 1.0}]',
        '[{"bucket": 1, "speedup": "x", "keep": 1}]',
    ):
        (tmp_path / "compile" / "k.json").write_text(broken)
        assert store.load("k") is None, broken


def test_a_store_over_a_file_only_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "compile").write_text("a file where the directory should be")
    with caplog.at_level(logging.WARNING, logger="sluiceway.engines.compile_choice"):
        VerdictStore(tmp_path / "compile").save("k", [Verdict(1, 1.0, keep=False)])
    assert "could not store the verdict" in caplog.text
    assert VerdictStore(tmp_path / "compile").load("k") is None


def test_the_kinds_take_turns_step_by_step_and_only_timed_steps_are_timed() -> None:
    calls: list[str] = []
    ticks = itertools.count()

    def clock() -> float:
        calls.append("clock")
        return float(next(ticks))

    eager, compiled = time_rounds(
        lambda: calls.append("eager"), lambda: calls.append("compiled"), clock, rounds=2, steps=3
    )
    assert len(eager) == len(compiled) == 6
    assert all(t == 1.0 for t in eager + compiled)  # one tick from each start to its end
    steps = [c for c in calls if c != "clock"]
    untimed = ["eager"] * UNTIMED_STEPS + ["compiled"] * UNTIMED_STEPS
    one_round = untimed + ["eager", "compiled"] * 3
    assert steps == one_round * 2
    assert calls.count("clock") == 2 * 6 * 2


def test_scratch_prompts_are_distinct_rows_of_the_vocabulary() -> None:
    prompts = list(scratch_prompts(32, 1920))
    assert len(prompts) == 32
    assert len({tuple(p) for p in prompts}) == 32
    assert all(len(p) == SCRATCH_PROMPT and all(0 <= t < 1920 for t in p) for p in prompts)
