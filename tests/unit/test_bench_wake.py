"""bench/wake.py: the engine child's reply write, timed with the reader asleep or polling."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))

from wake import Summary, run, summarise


def test_a_summary_reads_back_from_its_text() -> None:
    summary = Summary(18.25, 22.5, 19.75)
    assert Summary.parse(summary.text()) == Summary(18.2, 22.5, 19.8)


def test_the_summary_orders_the_times_before_taking_percentiles() -> None:
    seconds = [float(value) * 1e-6 for value in range(10, 0, -1)]
    assert summarise(seconds) == pytest.approx(Summary(6.0, 10.0, 5.5))


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_sleeping_reader_is_measured_on_either_backend(backend: str) -> None:
    done = run("asleep", 40, 300e-6, backend)
    assert done.mode == "asleep"
    assert done.overhead > 0  # a round trip takes longer than the child's work alone
    assert 0 < done.writes.p50 <= done.writes.p90


def test_a_polling_reader_is_measured() -> None:
    done = run("polling", 40, 300e-6)
    assert done.overhead > 0
    assert 0 < done.writes.p50 <= done.writes.p90
