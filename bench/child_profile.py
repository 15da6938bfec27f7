"""Where the engine's child process spends a served load (issue J's profile,
the engine's side).

    python3 -m venv /tmp/spyenv && /tmp/spyenv/bin/pip install py-spy
    .venv/bin/python bench/child_profile.py --py-spy /tmp/spyenv/bin/py-spy \\
        [--concurrency 16] [--requests 12] [--body JSON] [--out FILE]

``bench/pertoken.py`` times the event loop's stages with the engine on a
thread of the server's process. With the engine in its child process (the
default on the CPU), what decides decode ÷ bare is the child's step: how
much of it is the model's forward pass (which the bare loop also runs), how
much is the engine's own Python around it, and how long the child waits for
the event loop's next plan. This starts ``sluiceway serve`` on the embedded
default model, drives streaming completions at one concurrency with
``bench/loadgen.py``, samples the child's main thread with py-spy (``--idle``,
so a wait for the plan counts) and prints each part's share of the samples.

py-spy is not a dependency of the project (it is not in the lock): give its
path. It samples by pausing the child, so the tokens/s printed here are
below an unprofiled run's; the shares are what to read.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loadgen import Target, run_level, wait_healthy

HERE = Path(__file__).resolve().parent

#: What a sample of the child's main thread is doing, by the first of these
#: markers its stack holds (checked in this order).
PARTS: tuple[tuple[str, str], ...] = (
    ("Connection._recv", "waiting for the next plan (pipe read)"),
    ("Connection._send", "sending the outcome (pipe write)"),
    ("draw_rows", "picks drawn in the engine (sampling, logprobs)"),
    ("_attention (", "forward: attention over the engine's KV rows"),
    ("Linear.forward", "forward: linear layers"),
    ("Qwen3ForCausalLM.forward", "forward: the rest (norms, rotary, module calls)"),
    ("TransformersEngine.", "engine, outside the forward pass"),
    ("_serve", "the child's loop: plans, outcomes, run-ahead"),
)


def part_of(stack: str) -> str:
    phase = ""
    if "TransformersEngine.prefill" in stack:
        phase = "prefill, "
    elif "TransformersEngine.decode" in stack:
        phase = "decode, "
    for marker, name in PARTS:
        if marker in stack:
            return phase + name
    return "other"


def shares(raw: str) -> tuple[int, collections.Counter[str]]:
    """Samples of the main thread (the one running ``_serve``) by part."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if "_serve (" in stack:
            counts[part_of(stack)] += int(count)
    return sum(counts.values()), counts


def child_of(pid: int) -> int:
    """The engine's child: the spawned process that is not the resource tracker."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        listed = subprocess.run(
            ["ps", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True
        ).stdout
        for line in listed.splitlines():
            child, _, args = line.strip().partition(" ")
            if "spawn_main" in args:
                return int(child)
        time.sleep(0.5)
    raise RuntimeError("the server started no engine child")


def level(port: int, concurrency: int, requests: int, body: dict[str, object]) -> float:
    """Stream the requests; tokens/s over the level."""
    target = Target(f"http://127.0.0.1:{port}", "sluiceway-default", extra=tuple(body.items()))
    prompts = (
        f"{time.time()} {i}: tell me about rivers and the sea. " * 4 for i in itertools.count()
    )
    done = asyncio.run(
        run_level(
            target, prompts, concurrency=concurrency, requests_per_client=requests, max_tokens=128
        )
    )
    return sum(s.tokens for s in done.samples) / done.wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--py-spy", required=True, help="path of the py-spy executable")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=12, help="per client")
    parser.add_argument("--body", default="{}", help="more fields for every request (JSON)")
    parser.add_argument("--port", type=int, default=8431)
    parser.add_argument("--out", help="keep py-spy's raw stacks here")
    args = parser.parse_args()
    server = subprocess.Popen(
        [sys.executable, "-m", "sluiceway", "serve", "--port", str(args.port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    out = args.out or tempfile.mkstemp(prefix="child-profile-", suffix=".txt")[1]
    try:
        asyncio.run(
            wait_healthy(f"http://127.0.0.1:{args.port}", 300, lambda: server.poll() is None)
        )
        child = child_of(server.pid)
        body = json.loads(args.body)
        level(args.port, args.concurrency, 1, body)  # warm-up, not sampled
        record = ["record", "-p", str(child), "--idle", "--rate", "400", "--nonblocking"]
        spy = subprocess.Popen(
            [args.py_spy, *record, "--format", "raw", "-o", out],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        rate = level(args.port, args.concurrency, args.requests, body)
        spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        spy.wait(timeout=60)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    total, counts = shares(Path(out).read_text())
    print(
        f"c={args.concurrency}, body {args.body}: {rate:.0f} tok/s while sampled; {total} samples"
    )
    print("| where the child's main thread is | share |\n|---|--:|")
    for name, count in counts.most_common():
        print(f"| {name} | {100 * count / max(total, 1):.1f}% |")
    if not args.out:
        os.unlink(out)


if __name__ == "__main__":
    main()
