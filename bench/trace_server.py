"""``sluiceway serve`` with its engine steps timed, for ``bench/serve.py --trace``.

    .venv/bin/python bench/trace_server.py TRACE.json serve --model DIR ...

Runs the ordinary CLI after wrapping, without changing them, the scheduler's
call into the engine thread (``execute``: free, prefill, batched decode) and
the sampler's step, and writes every call's start and end
(``time.perf_counter``, which is the system-wide monotonic clock on Linux, so
the benchmark process can cut the trace by its own timestamps) to TRACE.json
when the server exits. The wrappers cost two clock reads per step.

:func:`summarise` turns a window of the trace into where the time went: how
much of the wall the engine was computing, the mean decode step, and the mean
gap between one step's end and the next one's start -- the time the engine
sat idle while the pipeline sampled, fanned out and planned.
"""

from __future__ import annotations

import itertools
import json
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: (start, end, decode rows, prefill tokens) of each engine step.
STEPS: list[tuple[float, float, int, int]] = []
#: (start, end, rows) of each sampler step.
SAMPLES: list[tuple[float, float, int]] = []
#: Native ids of the threads that ran engine steps and sampler steps.
THREADS: dict[str, set[int]] = {"engine": set(), "sampler": set()}
_LOCK = threading.Lock()


def install() -> None:
    from sluiceway.actors import sampler, scheduler

    execute = scheduler.execute
    sample_step = sampler.sample_step

    def timed_execute(engine: Any, plan: Any) -> Any:
        started = time.perf_counter()
        outcome = execute(engine, plan)
        ended = time.perf_counter()
        prefill = sum(len(work.tokens) for work in plan.prefills)
        with _LOCK:
            STEPS.append((started, ended, len(plan.decode), prefill))
            THREADS["engine"].add(threading.get_native_id())
        return outcome

    def timed_sample(sampler_: Any, step: Any, config: Any) -> Any:
        started = time.perf_counter()
        result = sample_step(sampler_, step, config)
        ended = time.perf_counter()
        with _LOCK:
            SAMPLES.append((started, ended, len(step.rows)))
            THREADS["sampler"].add(threading.get_native_id())
        return result

    scheduler.execute = timed_execute  # type: ignore[assignment]
    sampler.sample_step = timed_sample  # type: ignore[assignment]


@dataclass(frozen=True, slots=True)
class Summary:
    wall: float
    #: Fraction of the window the engine thread spent in steps.
    engine_busy: float
    steps: int
    #: Mean time of steps that only decoded (no prefill), and their mean rows.
    decode_step: float
    decode_rows: float
    #: Mean time from one step's end to the next one's start, between two decode-only steps.
    gap: float
    #: Mean sampler time per step.
    sample: float


def summarise(trace: dict[str, Any], start: float, end: float) -> Summary | None:
    steps = [s for s in trace["steps"] if start <= s[0] and s[1] <= end]
    if len(steps) < 2:
        return None
    decode = [s for s in steps if s[3] == 0 and s[2] > 0]
    gaps = [
        b[0] - a[1]
        for a, b in itertools.pairwise(steps)
        if a[3] == 0 and b[3] == 0 and a[2] > 0 and b[2] > 0
    ]
    samples = [s for s in trace["samples"] if start <= s[0] and s[1] <= end]
    return Summary(
        wall=end - start,
        engine_busy=sum(s[1] - s[0] for s in steps) / (end - start),
        steps=len(steps),
        decode_step=sum(s[1] - s[0] for s in decode) / len(decode) if decode else 0.0,
        decode_rows=sum(s[2] for s in decode) / len(decode) if decode else 0.0,
        gap=sum(gaps) / len(gaps) if gaps else 0.0,
        sample=sum(s[1] - s[0] for s in samples) / len(samples) if samples else 0.0,
    )


def thread_roles(trace: dict[str, Any], pid: int, ticks: dict[int, int]) -> dict[str, int]:
    """Group per-thread CPU ticks by role: the event loop (the main thread),
    the engine thread, the sampler's worker threads, and the rest (torch's
    OpenMP / BLAS compute threads, idle pool threads)."""
    roles = {tid: role for role, ids in trace.get("threads", {}).items() for tid in ids}
    roles[pid] = "event loop"
    grouped: dict[str, int] = {}
    for tid, value in ticks.items():
        role = roles.get(tid, "compute")
        grouped[role] = grouped.get(role, 0) + value
    return grouped


def main(argv: Sequence[str]) -> int:
    out, *rest = argv
    install()
    from sluiceway.server.cli import main as cli_main

    try:
        return cli_main(rest)
    finally:
        with _LOCK:
            threads = {role: sorted(ids) for role, ids in THREADS.items()}
            trace = {"steps": STEPS, "samples": SAMPLES, "threads": threads}
        with open(out, "w") as file:
            json.dump(trace, file)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
