"""bench/mlx_overlap.py compares two loops that must decode the same tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from sluiceway.engines.loader import ModelSource

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))

from mlx_overlap import engine_loops, loops, main


def test_both_loops_decode_the_same_greedy_tokens(tiny_model: ModelSource) -> None:
    from mlx_lm.utils import load_model

    model, config = load_model(tiny_model.path)
    steps = loops(model, int(config["vocab_size"]), batch=3, prompt=9)
    sync = [steps["sync"]() for _ in range(10)]
    overlapped = [steps["overlapped"]() for _ in range(11)]
    # The overlapped loop reads each step's input, one step behind.
    assert overlapped[1:] == sync
    assert all(len(tokens) == 3 for tokens in sync)


def test_the_report_has_a_row_per_batch(
    tiny_model: ModelSource, capsys: pytest.CaptureFixture[str]
) -> None:
    main(["--model", str(tiny_model.path), "--batches", "1", "2", "--rounds", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("|")[0].strip() for line in lines[1:]] == ["1", "2"]
    assert all(float(line.split("|")[-1]) > 0 for line in lines[1:])


def test_both_engine_loops_decode_the_same_greedy_tokens(
    tiny_model: ModelSource, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--engine``: the engine with and without the queued step decode alike."""
    steps = engine_loops(tiny_model.path, batch=3, prompt=9)
    plain = [steps["engine"]() for _ in range(10)]
    queued = [steps["engine, queued ahead"]() for _ in range(10)]
    assert queued == plain
    main(["--model", str(tiny_model.path), "--batches", "2", "--rounds", "1", "--engine"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("batch | engine ms/step | engine, queued ahead ms/step")
    assert [line.split("|")[0].strip() for line in lines[1:]] == ["2"]
