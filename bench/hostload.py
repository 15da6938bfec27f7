"""How busy the host is with work that is not ours (Linux ``/proc``).

A benchmark on a small shared machine is at the mercy of whatever else runs:
on 2 cores, one busy process elsewhere can halve a 2-thread torch step or
worse (every OpenMP region waits for its descheduled thread). This module
measures the CPU used by processes *outside* this process's tree (the
benchmark, its servers and its bare-engine subprocesses are inside it), so a
benchmark can wait for a quiet host, and flag or repeat a measurement taken
on a busy one.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass


def busy_ticks() -> int:
    """CPU ticks spent not idle, by everything on the host, since boot."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:9]]
    return sum(fields) - fields[3] - fields[4]  # less idle and iowait


def tree_ticks(root: int) -> int:
    """CPU ticks of ``root`` and its live descendants, each with the time of
    its children that have already exited and been waited for."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                rest = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        # rest[0] is field 3 (state): ppid, utime, stime, cutime, cstime are fields 4, 14-17.
        parents[int(entry)] = int(rest[1])
        ticks[int(entry)] = sum(int(v) for v in rest[11:15])
    total = 0
    for pid, own in ticks.items():
        node = pid
        while node > 1:
            if node == root:
                total += own
                break
            node = parents.get(node, 0)
    return total


@dataclass(slots=True)
class Span:
    """CPU used by others (in cores) between its start and :meth:`other_cores`."""

    started: float
    busy: int
    ours: int

    @classmethod
    def start(cls) -> Span:
        return cls(time.perf_counter(), busy_ticks(), tree_ticks(os.getpid()))

    def other_cores(self) -> float:
        wall = time.perf_counter() - self.started
        other = (busy_ticks() - self.busy) - (tree_ticks(os.getpid()) - self.ours)
        return max(0.0, other / os.sysconf("SC_CLK_TCK") / wall) if wall > 0 else 0.0


def wait_quiet(threshold: float, *, window: float = 2.0, patience: float = 180.0) -> float:
    """Wait until others use less than ``threshold`` cores over ``window``
    seconds, or ``patience`` seconds have passed. Return the seconds waited."""
    started = time.perf_counter()
    announced = False
    while True:
        span = Span.start()
        time.sleep(window)
        other = span.other_cores()
        waited = time.perf_counter() - started
        if other < threshold:
            return waited
        if waited >= patience:
            print(f"    host still busy ({other:.2f} other cores); measuring anyway", flush=True)
            return waited
        if not announced:
            print(f"    host busy ({other:.2f} other cores): waiting for it to calm", flush=True)
            announced = True


def thread_ticks(pid: int) -> dict[int, int]:
    """CPU ticks of each thread of ``pid``, by native thread id (Python 3.11
    does not name OS threads, so roles are told apart by id, not by name)."""
    ticks: dict[int, int] = {}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return ticks
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as stat:
                rest = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks[int(tid)] = int(rest[11]) + int(rest[12])
    return ticks


@dataclass(frozen=True, slots=True)
class Steadiness:
    """How alike the times of one fixed piece of work were, in ms."""

    best: float
    median: float
    p90: float

    @classmethod
    def of(cls, times: list[float]) -> Steadiness:
        """From the times in seconds (nearest-rank quantiles)."""
        ordered = sorted(times)

        def at(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3

        return cls(at(0.0), at(0.5), at(0.9))

    def line(self) -> str:
        return (
            f"a fixed Python loop took {self.best:.1f} ms at best, {self.median:.1f} at the "
            f"median ({self.median / self.best:.2f}x) and {self.p90:.1f} at p90 "
            f"({self.p90 / self.best:.2f}x)"
        )


def _fixed_work(iterations: int = 200_000) -> int:
    total = 0
    for i in range(iterations):
        total += i * i
    return total


def steadiness(samples: int = 30, pause: float = 0.2) -> Steadiness:
    """Time a fixed pure-Python loop ``samples`` times, ``pause`` seconds
    apart. On a shared virtual machine the host's speed swings in ways
    ``/proc`` does not show (another guest on the same physical core): on
    28 Nov this loop took 10.4-14.5 ms at best and 18.5-19.1 at the median
    with nothing else running, and the bare loop read up to 1.9x apart
    before and after one round. The spread says how far one round's ratio
    can be trusted."""
    times: list[float] = []
    for _ in range(samples):
        started = time.perf_counter()
        _fixed_work()
        times.append(time.perf_counter() - started)
        time.sleep(pause)
    return Steadiness.of(times)
