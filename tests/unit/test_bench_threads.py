"""The per-thread CPU reading of bench/threads.py."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))

from threads import ThreadTimes, read_threads, rows

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc")


def test_a_busy_thread_shows_its_cpu_time() -> None:
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin)
    before = read_threads(os.getpid())
    spinner.start()
    time.sleep(0.3)
    after = read_threads(os.getpid())
    stop.set()
    spinner.join()
    new = set(after) - set(before)
    assert len(new) == 1  # the spinner, with its own counters
    (tid,) = new
    assert after[tid].cpu_s > 0.05
    assert len(after[tid].sched) == 3
    assert all(count >= 0 for count in after[tid].sched)


def test_rows_give_each_busy_thread_its_share_and_leave_idle_ones_out() -> None:
    before = {
        10: ThreadTimes("python", 1.0, (5, 100, 2)),
        11: ThreadTimes("python", 0.0, (0, 0, 0)),
    }
    after = {
        10: ThreadTimes("python", 1.5, (15, 300, 3)),  # half a core over 1 s
        11: ThreadTimes("python", 0.001, (0, 1, 0)),  # idle: under 1% of a core
        12: ThreadTimes("worker", 0.25, (1, 0, 0)),  # started during the level
    }
    table = rows("engine child", 10, before, after, wall=1.0, tokens=1000)
    assert table == [
        "| engine child | main | 50% | 500 | 1.0 | 20 | 1 |",
        "| engine child | worker 12 | 25% | 250 | 0.1 | 0 | 0 |",
    ]
