"""What it costs the engine child to wake the event loop, on this host.

With ``--engine-process`` each step ends with the child writing its reply
to a socket that the server's event loop waits on. The write returns only
after the kernel has woken the waiting thread, so the writer pays for the
wake-up, on the path from one forward pass to the next. The bare decode
loop pays nothing of the kind.

This measures it without a model. A child process stands in for the engine:
it reads a plan, stays busy for ``--work`` µs (the forward pass), then
writes a 17-byte reply (a one-row ``GreedyDecode`` on the pipe) and times
that write. The parent stands in for the event loop, in one of two ways:

* ``asleep``: it waits in ``anyio.wait_readable``, as ``ProcessEngine``
  does, so its thread sleeps in the kernel between replies;
* ``polling``: it retries a non-blocking read, so it never sleeps and the
  child's write has nobody to wake (what a busy-polling reader would buy,
  for a whole core of CPU).

    .venv/bin/python bench/wake.py [--steps 3000] [--work 1200] [--rounds 2]

Prints, for each mode and round, the child's write time (p50, p90, mean)
and each round trip's time beyond ``--work``, then the host's cpuidle driver
and guest halt-polling setting where Linux shows them.
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio

PLAN = b"D" * 17
REPLY = b"G" * 17
#: How much of the child's last message (its write times, as text) a read takes.
REPORT_SIZE = 200


@dataclass(frozen=True, slots=True)
class Summary:
    """Write times in µs."""

    p50: float
    p90: float
    mean: float

    def text(self) -> str:
        return f"{self.p50:.1f} {self.p90:.1f} {self.mean:.1f}"

    @classmethod
    def parse(cls, text: str) -> Summary:
        p50, p90, mean = (float(value) for value in text.split())
        return cls(p50, p90, mean)


def summarise(seconds: Sequence[float]) -> Summary:
    ordered = sorted(seconds)
    return Summary(
        ordered[len(ordered) // 2] * 1e6,
        ordered[int(len(ordered) * 0.9)] * 1e6,
        statistics.fmean(ordered) * 1e6,
    )


def child(conn: socket.socket, steps: int, work: float) -> None:
    """The engine's stand-in: a plan in, ``work`` seconds busy, the reply out."""
    writes = []
    for _ in range(steps):
        conn.recv(len(PLAN))
        started = time.perf_counter()
        while time.perf_counter() - started < work:
            pass
        before = time.perf_counter()
        conn.send(REPLY)
        writes.append(time.perf_counter() - before)
    conn.send(summarise(writes).text().encode())


async def _asleep(conn: socket.socket, steps: int) -> None:
    for _ in range(steps):
        conn.send(PLAN)
        await anyio.wait_readable(conn.fileno())
        conn.recv(len(REPLY))


def _polling(conn: socket.socket, steps: int) -> None:
    for _ in range(steps):
        conn.send(PLAN)
        while True:
            try:
                conn.recv(len(REPLY))
                break
            except BlockingIOError:
                pass


@dataclass(frozen=True, slots=True)
class Round:
    mode: str
    #: Each round trip's time beyond the child's work, in µs.
    overhead: float
    writes: Summary


def run(mode: str, steps: int, work: float, backend: str = "asyncio") -> Round:
    """One round: ``steps`` round trips with the parent ``asleep`` (in an
    event loop of ``backend``) or ``polling``."""
    ours, theirs = socket.socketpair()
    context = multiprocessing.get_context("spawn")
    process = context.Process(target=child, args=(theirs, steps, work))
    process.start()
    theirs.close()
    ours.setblocking(False)
    try:
        started = time.perf_counter()
        if mode == "asleep":
            anyio.run(_asleep, ours, steps, backend=backend)
        else:
            _polling(ours, steps)
        elapsed = time.perf_counter() - started
        ours.setblocking(True)
        # Read to the end: the report may arrive in pieces.
        report = b"".join(iter(lambda: ours.recv(REPORT_SIZE), b"")).decode()
    finally:
        process.join()
        ours.close()
    return Round(mode, (elapsed / steps - work) * 1e6, Summary.parse(report))


def host_idle() -> str:
    """The cpuidle driver and the guest's halt polling, where Linux shows them."""
    found = []
    for label, path in (
        ("cpuidle driver", "/sys/devices/system/cpu/cpuidle/current_driver"),
        ("guest_halt_poll_ns", "/sys/module/haltpoll/parameters/guest_halt_poll_ns"),
    ):
        try:
            found.append(f"{label}: {Path(path).read_text().strip()}")
        except OSError:
            continue
    return "; ".join(found) or "cpuidle: not shown"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--work", type=float, default=1200.0, help="µs busy per step")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    print(f"{args.steps} steps of {args.work:.0f} µs; times in µs")
    print("mode     round trip beyond the work   child's write p50 / p90 / mean")
    for _ in range(args.rounds):
        for mode in ("asleep", "polling"):
            done = run(mode, args.steps, args.work / 1e6)
            writes = done.writes
            print(
                f"{mode:8} {done.overhead:27.1f}   "
                f"{writes.p50:.1f} / {writes.p90:.1f} / {writes.mean:.1f}"
            )
    print(host_idle())


if __name__ == "__main__":
    main()
