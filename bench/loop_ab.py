"""A/B the event loop's CPU per streamed token between two code trees (or flags).

    .venv/bin/python bench/loop_ab.py --tree-b ../other-checkout [--phases 16]
    .venv/bin/python bench/loop_ab.py --args-b='--worker-class trio'
    .venv/bin/python bench/loop_ab.py --tree-b /tmp/other --concurrency 64 --whole-process
    .venv/bin/python bench/loop_ab.py --tree-a /tmp/base --api chat \
        --body '{"temperature": 1, "seed": 7, "logprobs": true, "top_logprobs": 5}'
    .venv/bin/python bench/loop_ab.py --floor b --concurrency 16 --step-ms 4

Two servers run at once, each on a stand-in engine that sleeps for a decode
step instead of computing (``--step-ms``, 16 by default: the large benchmark
model's pace at concurrency 1), so the cores stay free and what is measured
is the server's own pipeline. The load goes to one server, then the other,
in short phases (one request per client each), and for each phase the event
loop thread's on-CPU time (``/proc/PID/task/PID/schedstat``, nanoseconds) is
divided by the tokens streamed (``--whole-process``: every thread's, for a
change that moves work between the loop and worker threads). Alternating cancels the host's drift, which
moves whole bench runs by 5-10%: the paired difference resolves about
±20 µs per token in 16 phases, where separate runs minutes apart did not
resolve ±60.

``--floor a|b`` runs that side as ``bench/floor_app.py`` instead: Hypercorn
alone, streaming a prebuilt frame per stream at every step of a ticker. What
its event loop spends per token is what asyncio and Hypercorn cost without
any of sluiceway, so the difference is the server's own share.

A tree is a checkout of this repository (``git worktree add``); it goes
first on the server's ``sys.path``, so its ``sluiceway`` package is the one
served. The stand-in engine emits ordinary tokens of the embedded default
model's vocabulary, one after the other; what matters is that every step
streams one token per row, as greedy decoding does. ``--body`` adds fields to
every request (sampling, logprobs); sampled at temperature 1, the stand-in's
peak token keeps ~92% of the mass over the tiny vocabulary, the rest is
spread evenly.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
from loadgen import Target, run_level, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
#: The stand-in's tokens: ordinary pieces of the default model's vocabulary.
FIRST_TOKEN, TOKEN_SPAN = 300, 500


class StandInEngine:
    """The engine interface, with sleeps (the GIL released) for the model."""

    def __init__(self, vocab_size: int, step_seconds: float) -> None:
        from sluiceway.engines.base import EngineInfo

        self.info = EngineInfo(
            name="stand-in", device="cpu", dtype="float32", vocab_size=vocab_size, max_context=8192
        )
        self._step = step_seconds
        self._lengths: dict[int, int] = {}
        #: The slots of the last decode, which ``undo_decode`` takes back.
        self._decoded: tuple[int, ...] = ()

    def _logits(self, slots: Sequence[int]) -> np.ndarray:
        logits = np.zeros((len(slots), self.info.vocab_size), np.float32)
        for row, slot in enumerate(slots):
            logits[row, FIRST_TOKEN + (self._lengths[slot] * 7) % TOKEN_SPAN] = 10.0
        return logits

    def prefill(self, slot: int, token_ids: Sequence[int], *, all_logits: bool = False) -> Any:
        self._lengths[slot] = self._lengths.get(slot, 0) + len(token_ids)
        time.sleep(self._step)
        logits = self._logits([slot])
        return np.repeat(logits, len(token_ids), axis=0) if all_logits else logits

    def fork(self, source: int, target: int) -> None:
        self._lengths[target] = self._lengths[source]

    def decode(self, tokens: Mapping[int, int]) -> Any:
        from sluiceway.engines.base import DecodeResult

        time.sleep(self._step)
        slots = tuple(tokens)
        for slot in slots:
            self._lengths[slot] += 1
        self._decoded = slots
        return DecodeResult(slots, self._logits(slots))

    def start_decode(self, tokens: Mapping[int, int]) -> Callable[[], Any]:
        return lambda: self.decode(tokens)

    def free(self, slot: int) -> None:
        self._lengths.pop(slot, None)

    def undo_decode(self) -> None:
        # A slot still being prefilled did not decode: it keeps its length.
        for slot in self._decoded:
            if slot in self._lengths:
                self._lengths[slot] -= 1

    def close(self) -> None:
        pass


def serve_with_stand_in(step_seconds: float, argv: Sequence[str]) -> None:
    """Run ``sluiceway serve`` in this process with the stand-in engine."""
    import sluiceway.server.runtime as runtime
    from sluiceway.server.cli import main

    # ``**_options`` takes what either tree passes (``device``, ``dtype``,
    # ``threads``...): the stand-in serves old and new trees alike.
    def make_engine(choice: str, source: Any, **_options: Any) -> StandInEngine:
        return StandInEngine(source.vocab_size, step_seconds)

    runtime.make_engine = make_engine  # type: ignore[assignment]
    sys.exit(main(["serve", *argv]))


@dataclass(slots=True)
class Server:
    name: str
    process: subprocess.Popen[bytes]
    url: str
    log: IO[bytes]

    def cpu_ns(self, whole: bool) -> int:
        """On-CPU nanoseconds of the event loop's thread, or of every thread
        (``--whole-process``: a change that moves work to worker threads)."""
        pid = self.process.pid
        tasks = Path(f"/proc/{pid}/task")
        total = 0
        for task in tasks.iterdir() if whole else [tasks / str(pid)]:
            with contextlib.suppress(OSError):  # a thread that just ended
                total += int((task / "schedstat").read_text().split()[0])
        return total


def start(
    name: str, tree: Path, port: int, model: Path, step_ms: float, args: str, floor: bool
) -> Server:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    if floor:
        script = str(Path(__file__).resolve())
        command = [
            sys.executable,
            script,
            "--serve-floor",
            str(port),
            "--serve-step-ms",
            str(step_ms),
        ]
    else:
        command = _serve_command(port, model, step_ms, args)
    path = Path(tempfile.gettempdir()) / f"loop-ab-{name}.log"
    log = open(path, "wb")  # noqa: SIM115  (closed when the server stops)
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    return Server(name, process, f"http://127.0.0.1:{port}", log)


def _serve_command(port: int, model: Path, step_ms: float, args: str) -> list[str]:
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        "--serve-step-ms",
        str(step_ms),
        "--",
        "--model",
        str(model),
        "--port",
        str(port),
        "--no-engine-process",
        "--log-level",
        "warning",
        *shlex.split(args),
    ]


async def phase(
    server: Server, model: Path, prompts: Any, concurrency: int, shape: argparse.Namespace
) -> float:
    """Stream one request per client; the loop's CPU per streamed token, in µs."""
    extra = tuple(json.loads(shape.body).items())
    target = Target(server.url, str(model), api=shape.api, extra=extra)
    before = server.cpu_ns(shape.whole_process)
    level = await run_level(
        target, prompts, concurrency=concurrency, requests_per_client=1, max_tokens=128
    )
    if level.errors:
        raise RuntimeError(f"{server.name}: {level.first_errors()}")
    return (server.cpu_ns(shape.whole_process) - before) / 1e3 / level.tokens


async def compare(args: argparse.Namespace, model: Path) -> dict[str, list[float]]:
    servers = [
        start("A", args.tree_a, args.port, model, args.step_ms, args.args_a, args.floor == "a"),
        start("B", args.tree_b, args.port + 1, model, args.step_ms, args.args_b, args.floor == "b"),
    ]
    prompts = (f"request {i}: " + "words " * 40 for i in itertools.count())
    try:
        for server in servers:
            await wait_healthy(server.url, 120, lambda s=server: s.process.poll() is None)
            await phase(server, model, prompts, args.concurrency, args)  # warm-up
        costs: dict[str, list[float]] = {"A": [], "B": []}
        for index in range(args.phases):
            for server in servers if index % 2 == 0 else servers[::-1]:
                cost = await phase(server, model, prompts, args.concurrency, args)
                costs[server.name].append(cost)
        return costs
    finally:
        for server in servers:
            server.process.send_signal(2)
            server.process.wait()
            server.log.close()


def report(costs: dict[str, list[float]]) -> str:
    a, b = costs["A"], costs["B"]
    differences = [y - x for x, y in zip(a, b, strict=True)]
    error = statistics.stdev(differences) / len(differences) ** 0.5
    return (
        f"A: {statistics.mean(a):.0f} µs per token (median {statistics.median(a):.0f}); "
        f"B: {statistics.mean(b):.0f} (median {statistics.median(b):.0f}); "
        f"B - A: {statistics.mean(differences):+.0f} ± {error:.0f} µs per token "
        f"({len(differences)} paired phases)"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree-a", type=Path, default=ROOT)
    parser.add_argument("--tree-b", type=Path, default=ROOT)
    parser.add_argument("--args-a", default="", help="extra flags for server A")
    parser.add_argument("--args-b", default="", help="extra flags for server B")
    parser.add_argument("--phases", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--step-ms", type=float, default=16.0)
    parser.add_argument("--api", choices=["completions", "chat"], default="completions")
    parser.add_argument("--body", default="{}", help="more fields for every request (JSON)")
    parser.add_argument("--port", type=int, default=8861)
    parser.add_argument(
        "--whole-process",
        action="store_true",
        help="count every thread's CPU, not only the event loop's",
    )
    parser.add_argument(
        "--floor",
        choices=["a", "b"],
        help="run that side as bench/floor_app.py: Hypercorn streaming prebuilt frames, "
        "the least a token costs without sluiceway (completions, greedy only)",
    )
    parser.add_argument("--serve-step-ms", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--serve-floor", type=int, help=argparse.SUPPRESS)
    parser.add_argument("serve_args", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_floor is not None:
        from floor_app import serve

        serve(args.serve_floor, args.serve_step_ms / 1e3)
        return
    if args.serve_step_ms is not None:
        serve_with_stand_in(args.serve_step_ms / 1e3, args.serve_args)
        return
    from sluiceway.engines.default_model import default_model_dir

    costs = asyncio.run(compare(args, default_model_dir()))
    print(report(costs))


if __name__ == "__main__":
    main()
