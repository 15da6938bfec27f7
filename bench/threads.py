"""Which thread a served load keeps busy: each thread's CPU per streamed token
(issue J's profile, by thread rather than by function).

    .venv/bin/python bench/threads.py [--engine transformers|mlx]
        [--concurrency 1 16] [--requests 40] [--model DIR]

``bench/child_profile.py`` says what the engine child's main thread does;
this says which thread of which process sets the pace. It starts ``sluiceway
serve`` (mlx with OpenBLAS preloaded where installed, as ``bench/serve.py``
runs it), warms each level up, then reads every thread's CPU time and the
scheduler's counts from ``/proc`` around a level of streamed completions
(``bench/loadgen.py``). A thread near 100% of a core is the pace-setter; the
involuntary switches count how often the kernel took its core away (another
thread woke there) per hundred streamed tokens. Linux only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from child_profile import child_of, level
from hostload import thread_ticks
from loadgen import wait_healthy
from serve import env_for, find_openblas

#: What the thread tuner logs when it chooses a count
#: (``sluiceway.actors.thread_tuner``).
TUNER_SWITCH = "engine threads for batches of"
#: The fields of ``/proc/<pid>/task/<tid>/sched`` this reads.
SCHED_FIELDS = ("nr_involuntary_switches", "nr_voluntary_switches", "se.nr_migrations")


@dataclass(frozen=True, slots=True)
class ThreadTimes:
    """One thread's counters at one moment."""

    name: str
    cpu_s: float
    sched: tuple[int, ...]


def read_threads(pid: int) -> dict[int, ThreadTimes]:
    """Every thread of ``pid``: CPU seconds (user + system) and scheduler counts."""
    per_second = os.sysconf("SC_CLK_TCK")
    found: dict[int, ThreadTimes] = {}
    for tid, ticks in thread_ticks(pid).items():
        task = Path(f"/proc/{pid}/task/{tid}")
        try:
            sched = (task / "sched").read_text().splitlines()
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        counts = {k.strip(): v for k, _, v in (line.partition(":") for line in sched)}
        found[tid] = ThreadTimes(
            name, ticks / per_second, tuple(int(float(counts[f])) for f in SCHED_FIELDS)
        )
    return found


def rows(
    process: str,
    pid: int,
    before: dict[int, ThreadTimes],
    after: dict[int, ThreadTimes],
    wall: float,
    tokens: int,
) -> list[str]:
    """Table rows for ``process``'s threads that used at least 1% of a core."""
    found = []
    for tid, now in after.items():
        then = before.get(tid, ThreadTimes(now.name, 0.0, (0,) * len(now.sched)))
        cpu = now.cpu_s - then.cpu_s
        if cpu < 0.01 * wall:
            continue
        switches = [b - a for a, b in zip(then.sched, now.sched, strict=True)]
        which = "main" if tid == pid else f"{now.name} {tid}"
        found.append(
            (
                -cpu,
                f"| {process} | {which} | {100 * cpu / wall:.0f}% | {1e6 * cpu / tokens:.0f} "
                f"| {100 * switches[0] / tokens:.1f} | {100 * switches[1] / tokens:.0f} "
                f"| {switches[2]} |",
            )
        )
    return [row for _, row in sorted(found)]


def measure(port: int, pids: dict[str, int], concurrency: int, requests: int) -> list[str]:
    level(port, concurrency, 1, {})  # warm-up (and the thread tuner's first checks)
    before = {name: read_threads(pid) for name, pid in pids.items()}
    start = time.monotonic()
    rate = level(port, concurrency, requests, {})
    wall = time.monotonic() - start
    after = {name: read_threads(pid) for name, pid in pids.items()}
    tokens = round(rate * wall)
    table = [
        f"c={concurrency}: {rate:.0f} tok/s over {wall:.1f} s ({tokens} tokens)",
        "",
        "| process | thread | of a core | µs CPU per token | involuntary switches "
        "per 100 tokens | voluntary per 100 | migrations |",
        "|---|---|--:|--:|--:|--:|--:|",
    ]
    for name, pid in pids.items():
        table += rows(name, pid, before[name], after[name], wall, tokens)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["transformers", "mlx"], default="transformers")
    parser.add_argument("--model", help="a model directory (default: the embedded default)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--requests", type=int, default=40, help="per level, over its clients")
    parser.add_argument("--port", type=int, default=8433)
    args = parser.parse_args()
    command = [sys.executable, "-m", "sluiceway", "serve", "--engine", args.engine]
    command += ["--port", str(args.port), "--max-num-seqs", str(max(args.concurrency))]
    command += ["--model", args.model] if args.model else []
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115  # read and closed below
    server = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=log,
        env=env_for(args.engine, find_openblas()),
        start_new_session=True,
    )
    try:
        asyncio.run(
            wait_healthy(f"http://127.0.0.1:{args.port}", 300, lambda: server.poll() is None)
        )
        pids = {"server": server.pid, "engine child": child_of(server.pid)}
        print(f"sluiceway serve --engine {args.engine}, streamed completions, greedy, 128 tokens")
        for concurrency in args.concurrency:
            requests = max(1, args.requests // concurrency)
            print("\n".join(["", *measure(args.port, pids, concurrency, requests)]), flush=True)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        log.seek(0)
        switches = [line.strip() for line in log if TUNER_SWITCH in line]
        log.close()
    # The thread count decides whose core a second torch thread takes.
    print("\n".join(["", "The thread tuner's choices:", *switches] if switches else []))


if __name__ == "__main__":
    main()
