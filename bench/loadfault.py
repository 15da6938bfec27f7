"""The load-and-fault bench: a real server under a burst of streaming
clients, some of them faulty, and what it keeps afterwards.

    .venv/bin/python bench/loadfault.py --engine transformers
    .venv/bin/python bench/loadfault.py --engine mlx --engine-process

It starts ``sluiceway serve`` (the embedded default model unless
``--model``), sends a warm-up burst, lets the server go idle, then sends the
measured burst (``bench/faults.py``: ``--clients`` streaming clients on chat,
completions, Responses and Messages for ``--seconds``, 30 % hanging up at a
random point, 10 % sending bad requests, a few stalled readers). It prints:

- the 5xx count (must be 0), the good streams that ended well and the bad
  requests refused in their surface's error shape (every one must);
- how long the running and waiting gauges of ``/metrics`` took to read 0
  once the clients were done;
- the server's CPU (in cores) over 5 s starting 10 s after that (idle: ~0);
- its resident memory (the server and its engine process): before any
  burst, after the warm-up burst once idle, at the measured burst's peak,
  right after it, and once idle again (``--settle`` seconds later); and
  what the prefix cache holds, which every new prompt adds to (kept on
  purpose, up to ``--prefix-cache-bytes``). The target: idle again, less
  the prefix cache's growth, within 10 % of the level after the warm-up,
  and at most half of what the bursts added over the level before them
  still held (a server that gives nothing back stays at its high-water
  mark, which the warm-up already reached, so only this tells).

It exits 1 when a check fails. Resident memory does not depend on how busy
the host is; the request counts, the time to idle and the CPU figure do.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from faults import Burst, Tally, gauges, rss_mib, run_burst, seconds_to_idle
from hostload import tree_ticks

HERE = Path(__file__).parent
#: Resident memory once idle may exceed its level after the warm-up burst by this share.
RSS_TOLERANCE = 0.10
#: Idle after the measured burst, RSS may keep at most this share of what
#: the burst added over the level before any burst, the prefix cache's
#: contents set aside on both sides (a server that gives nothing back keeps
#: all of it).
KEPT_SHARE = 0.5
#: Cores a server may use while idle and still count as idle.
IDLE_CORES = 0.05


@dataclass(frozen=True, slots=True)
class Memory:
    before: float
    warmed: float = 0.0
    peak: float = 0.0
    after_burst: float = 0.0
    settled: float = 0.0
    #: What the prefix cache held (MiB) once idle after each burst: memory
    #: kept on purpose, up to its budget, which new prompts keep filling.
    cache_warmed: float = 0.0
    cache_settled: float = 0.0

    @property
    def settled_net(self) -> float:
        """Idle RSS after the measured burst, less what the prefix cache gained since warm-up."""
        return self.settled - (self.cache_settled - self.cache_warmed)


def start(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    command = [
        *(sys.executable, "-m", "sluiceway", "serve", "--engine", args.engine),
        *("--port", str(port), "--served-model-name", "bench", "--log-level", "warning"),
        *([] if args.engine_process is None else [engine_process_flag(args.engine_process)]),
        *(["--model", args.model] if args.model else []),
        # '--server-args="--a 1 --b 2"' arrives as one word: split it as a shell would.
        *(word for flags in args.server_args for word in shlex.split(flags)),
    ]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return process, base_url
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise TimeoutError("the server did not start")


def engine_process_flag(on: bool) -> str:
    return "--engine-process" if on else "--no-engine-process"


class PeakRss:
    """The highest resident memory of a process tree while it runs."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            self.peak = max(self.peak, rss_mib(self.pid))


def idle_cores(pid: int, after: float = 10.0, window: float = 5.0) -> float:
    """The tree's CPU use over ``window`` seconds, ``after`` seconds from now."""
    time.sleep(after)
    ticks = tree_ticks(pid)
    time.sleep(window)
    return (tree_ticks(pid) - ticks) / os.sysconf("SC_CLK_TCK") / window


def burst_of(args: argparse.Namespace, base_url: str, seconds: float, seed: int) -> Burst:
    return Burst(
        base_url=base_url,
        model="bench",
        clients=args.clients,
        seconds=seconds,
        stalled=args.stalled,
        max_tokens=args.max_tokens,
        seed=seed,
        request_timeout=args.request_timeout,
    )


def report_burst(tally: Tally, idle: float, timeout: float) -> list[str]:
    good = sum(n for kind, n in tally.sent.items() if kind.startswith("good"))
    bad = sum(n for kind, n in tally.sent.items() if kind.startswith("bad"))
    hung_up = sum(n for kind, n in tally.sent.items() if kind.startswith("disconnect"))
    lines = [
        f"- requests: {sum(tally.sent.values())} in {tally.wall:.1f} s "
        f"({good} good, {hung_up} hung up, {bad} bad, "
        f"{sum(n for k, n in tally.sent.items() if k.startswith('stalled'))} stalled readers)",
        f"- statuses: {dict(sorted(tally.statuses.items()))}; 5xx: {tally.server_errors}",
        f"- good streams well formed: {sum(tally.completed.values())} of {good} "
        f"({dict(sorted(tally.completed.items()))})",
        f"- bad requests refused in their surface's error shape: "
        f"{sum(tally.refused.values())} of {bad} ({dict(sorted(tally.refused.items()))})",
        f"- running and waiting gauges at 0: {idle:.2f} s after the last client",
        f"- requests the clients gave up on after {timeout:.0f} s: "
        f"{sum(tally.timed_out.values())} ({dict(sorted(tally.timed_out.items()))})",
        f"- good requests refused with a 429 (queue full): {sum(tally.shed.values())}",
    ]
    lines += [f"  - problem: {problem}" for problem in tally.problems[:10]]
    return lines


def one_burst(
    args: argparse.Namespace, base_url: str, seconds: float, seed: int
) -> tuple[Tally, float]:
    tally = run_burst(burst_of(args, base_url, seconds, seed))
    return tally, seconds_to_idle(base_url)


def run(args: argparse.Namespace) -> int:
    log = Path(tempfile.mkstemp(prefix="loadfault-", suffix=".log")[1])
    process, base_url = start(args, log)
    try:
        return measure(args, process.pid, base_url)
    finally:
        process.terminate()
        process.wait(60)
        print(f"(server log: {log})")


def measure(args: argparse.Namespace, pid: int, base_url: str) -> int:
    memory = Memory(before=rss_mib(pid))
    print(f"warm-up burst: {args.clients} clients, {args.warmup_seconds:.0f} s", flush=True)
    warm, warm_idle = one_burst(args, base_url, args.warmup_seconds, seed=1)
    print("\n".join(report_burst(warm, warm_idle, args.request_timeout)), flush=True)
    time.sleep(args.settle)
    warmed, cache_warmed = rss_mib(pid), cache_mib(base_url)
    print(f"measured burst: {args.clients} clients, {args.seconds:.0f} s", flush=True)
    with PeakRss(pid) as peak:
        tally, idle = one_burst(args, base_url, args.seconds, seed=2)
    after_burst = rss_mib(pid)
    cores = idle_cores(pid)
    time.sleep(max(0.0, args.settle - 15.0))
    memory = Memory(
        memory.before,
        warmed,
        peak.peak,
        after_burst,
        rss_mib(pid),
        cache_warmed,
        cache_mib(base_url),
    )
    lines = report_burst(tally, idle, args.request_timeout)
    lines.append(f"- server CPU 10 s after: {cores:.3f} cores")
    lines += memory_lines(memory)
    failures = checks(tally, cores, memory)
    lines += [f"- FAILED: {failure}" for failure in failures] or ["- every check passed"]
    print("\n".join(lines))
    return 1 if failures else 0


def cache_mib(base_url: str) -> float:
    """What the prefix cache holds (0 when it is off)."""
    held = gauges(base_url, ("prefix_cache_bytes",))["prefix_cache_bytes"]
    return 0.0 if math.isnan(held) else held / 2**20


def memory_lines(memory: Memory) -> list[str]:
    def share(value: float, of: float) -> str:
        return f"{value:.0f} MiB ({(value / of - 1) * 100:+.0f} %)"

    return [
        f"- RSS before any burst: {memory.before:.0f} MiB",
        f"- RSS after the warm-up burst, idle: {share(memory.warmed, memory.before)}",
        f"- RSS peak in the measured burst: {share(memory.peak, memory.before)}",
        f"- RSS right after it: {share(memory.after_burst, memory.before)}",
        f"- RSS idle again: {share(memory.settled, memory.before)}; "
        f"{(memory.settled / memory.warmed - 1) * 100:+.1f} % of the warm-up level",
        f"- prefix cache (kept on purpose): {memory.cache_warmed:.1f} MiB after the warm-up "
        f"burst, {memory.cache_settled:.1f} MiB after the measured one",
        f"- RSS idle again less the prefix cache's growth: {memory.settled_net:.0f} MiB, "
        f"{(memory.settled_net / memory.warmed - 1) * 100:+.1f} % of the warm-up level",
    ]


def checks(tally: Tally, cores: float, memory: Memory) -> list[str]:
    failures = []
    if tally.server_errors:
        failures.append(f"{tally.server_errors} responses were 5xx")
    if tally.problems:
        failures.append(f"{len(tally.problems)} malformed streams or misshapen refusals")
    if cores > IDLE_CORES:
        failures.append(f"the server used {cores:.2f} cores while idle")
    if memory.settled_net > memory.warmed * (1 + RSS_TOLERANCE):
        failures.append(
            f"RSS {memory.settled_net:.0f} MiB idle (less the prefix cache's growth), more "
            f"than {RSS_TOLERANCE:.0%} over {memory.warmed:.0f} MiB after the warm-up burst"
        )
    # The prefix cache is empty before any burst and keeps what it holds on
    # purpose (up to its budget, hundreds of MiB on a large host): what the
    # bursts added and what stays are both counted without it.
    added = memory.after_burst - memory.before - memory.cache_settled
    kept = memory.settled - memory.before - memory.cache_settled
    if kept > KEPT_SHARE * added:
        failures.append(
            f"memory not given back: idle again, RSS keeps {kept:.0f} MiB of the "
            f"{added:.0f} MiB the bursts added (the prefix cache set aside)"
        )
    return failures


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["transformers", "mlx"], default="transformers")
    parser.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        help="the engine in a child process, or not (default: the server's choice)",
    )
    parser.add_argument("--model", help="a model directory (default: the embedded model)")
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=30.0, help="the measured burst")
    parser.add_argument("--warmup-seconds", type=float, default=15.0)
    parser.add_argument("--stalled", type=int, default=4, help="stalled readers per burst")
    parser.add_argument("--max-tokens", type=int, default=32, help="most tokens a request asks for")
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=300.0,
        help="seconds a client waits for a whole reply before giving up",
    )
    parser.add_argument(
        "--settle", type=float, default=20.0, help="idle seconds before RSS counts as settled"
    )
    parser.add_argument(
        "--server-args", nargs="*", default=[], help="more server flags, given with '='"
    )
    args = parser.parse_args(argv)
    print(f"command: {' '.join(sys.argv)}", flush=True)
    sys.exit(run(args))


if __name__ == "__main__":
    main()
