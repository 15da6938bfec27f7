"""``sluiceway serve`` with its engine steps timed, for ``bench/serve.py --trace``.

    .venv/bin/python bench/trace_server.py TRACE.json serve --model DIR ...

The engine runs on the server's engine thread, even where its default is a
child process (mlx on the CPU), since the wrappers only see this process.
Runs the ordinary CLI after wrapping, without changing them, the engine
thread's step (``execute``: free, prefill, batched decode; and the greedy
decode run ahead of the plan) and the sampler's step, and writes every call's start and end
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
#: (label, time) of each point a step passes, in order (see :data:`MARKS`).
POINTS: list[tuple[str, float]] = []
_LOCK = threading.Lock()

#: The points of one scheduler step, in the order it passes them, and what
#: the time from each to the next is spent on.
MARKS = (
    ("exec_start", "engine step"),
    ("exec_end", "hop back to the event loop"),
    ("absorb", "absorb, finish checks, drain commands"),
    ("plan", "plan the next step"),
    ("submit", "hop to the engine thread"),
)


def _mark(label: str) -> None:
    POINTS.append((label, time.perf_counter()))  # list.append is atomic


def install() -> None:
    from sluiceway.actors import run_ahead, sampler, scheduler, scheduler_core

    execute = run_ahead.execute
    decode_ahead = run_ahead.RunAhead.run_ahead
    sample_step = sampler.sample_step
    cls = scheduler.Scheduler
    core = scheduler_core.SchedulerCore
    absorb, sample, plan = core.absorb, cls._sample, core.plan

    def timed_absorb(self: Any, *args: Any) -> Any:
        _mark("absorb")
        return absorb(self, *args)

    async def timed_sample_call(self: Any, *args: Any) -> Any:
        _mark("to_sampler")
        return await sample(self, *args)

    def timed_plan(self: Any, *args: Any) -> Any:
        _mark("plan")
        return plan(self, *args)

    start_step = run_ahead.SteppingThread.start

    def timed_start(self: Any, step_plan: Any) -> Any:
        _mark("submit")
        return start_step(self, step_plan)

    run_ahead.SteppingThread.start = timed_start  # type: ignore[method-assign]
    # The rules live in the scheduler's pure core; the shell samples.
    core.absorb = timed_absorb  # type: ignore[method-assign]
    cls._sample = timed_sample_call  # type: ignore[method-assign]
    core.plan = timed_plan  # type: ignore[method-assign]

    def timed_execute(engine: Any, step_plan: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        POINTS.append(("exec_start", started))
        outcome = execute(engine, step_plan, **kwargs)
        ended = time.perf_counter()
        POINTS.append(("exec_end", ended))
        prefill = sum(len(work.tokens) for work in step_plan.prefills)
        # A decode served from ahead was timed when it ran (below).
        rows = 0 if kwargs.get("decoded") is not None else len(step_plan.decode)
        if rows or prefill:
            _step(started, ended, rows, prefill)
        return outcome

    def timed_decode_ahead(self: Any, step_plan: Any, outcome: Any, handover: Any) -> None:
        started = time.perf_counter()
        decode_ahead(self, step_plan, outcome, handover)
        if self._ahead is not None:
            _step(started, time.perf_counter(), len(self._ahead.tokens), 0)

    def _step(started: float, ended: float, rows: int, prefill: int) -> None:
        with _LOCK:
            STEPS.append((started, ended, rows, prefill))
            THREADS["engine"].add(threading.get_native_id())

    def timed_sample(sampler_: Any, step: Any, config: Any) -> Any:
        started = time.perf_counter()
        POINTS.append(("sample_start", started))
        result = sample_step(sampler_, step, config)
        ended = time.perf_counter()
        POINTS.append(("sample_end", ended))
        with _LOCK:
            SAMPLES.append((started, ended, len(step.rows)))
            THREADS["sampler"].add(threading.get_native_id())
        return result

    run_ahead.execute = timed_execute  # type: ignore[assignment]
    run_ahead.RunAhead.run_ahead = timed_decode_ahead  # type: ignore[method-assign]
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
    #: Mean time per segment of a decode-only step (see :data:`MARKS`), in seconds.
    segments: dict[str, float]


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
        segments=segments(trace.get("points", []), start, end),
    )


def segments(points: list[tuple[str, float]], start: float, end: float) -> dict[str, float]:
    """Mean time of each segment over the complete, in-order steps in the window."""
    order = [label for label, _ in MARKS]
    names = dict(MARKS)
    window = [(label, t) for label, t in points if start <= t <= end]
    totals: dict[str, float] = {}
    count = 0
    index = 0
    while index + len(order) < len(window):
        labels = [label for label, _ in window[index : index + len(order) + 1]]
        if labels[:-1] != order or labels[-1] != order[0]:
            index += 1
            continue
        times = [t for _, t in window[index : index + len(order) + 1]]
        for position, label in enumerate(order):
            totals[names[label]] = totals.get(names[label], 0.0) + (
                times[position + 1] - times[position]
            )
        count += 1
        index += len(order)
    return {name: total / count for name, total in totals.items()} if count else {}


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
    if "--engine-process" not in rest:
        # The wrappers live in this process: an engine in a child process
        # (the default on the CPU) would run untraced.
        rest.append("--no-engine-process")
    install()
    from sluiceway.server.cli import main as cli_main

    try:
        return cli_main(rest)
    finally:
        with _LOCK:
            threads = {role: sorted(ids) for role, ids in THREADS.items()}
            trace = {"steps": STEPS, "samples": SAMPLES, "threads": threads, "points": POINTS}
        with open(out, "w") as file:
            json.dump(trace, file)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
