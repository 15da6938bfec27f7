"""The benchmark's host steadiness probe (``bench/hostload.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from hostload import Steadiness, steadiness


def test_the_quantiles_are_nearest_rank_in_milliseconds() -> None:
    times = [0.019, 0.011, 0.018, 0.030, 0.019, 0.012, 0.019, 0.018, 0.019, 0.020]
    probe = Steadiness.of(times)
    assert probe == Steadiness(best=11.0, median=19.0, p90=30.0)
    assert probe.line() == (
        "a fixed Python loop took 11.0 ms at best, 19.0 at the median (1.73x) "
        "and 30.0 at p90 (2.73x)"
    )


def test_a_steady_host_reads_near_one() -> None:
    probe = Steadiness.of([0.010] * 29 + [0.011])
    assert probe.median / probe.best == 1.0
    assert probe.p90 / probe.best == 1.0


def test_the_probe_times_real_work() -> None:
    probe = steadiness(samples=3, pause=0.0)
    assert 0 < probe.best <= probe.median <= probe.p90
