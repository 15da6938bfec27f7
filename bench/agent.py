"""Agent-shaped workload: the prefix cache on against off, and against ``mlx_lm.server``.

Eight conversations of six turns each. Every turn sends the whole
conversation so far to ``/v1/chat/completions`` (streamed, greedy): one
system message shared by all conversations -- about ``--system-tokens``
(2,000) tokens of text, then tool definitions written out as JSON -- and the
conversation's history, user and assistant messages alternating, ending in a
new user message. The assistant messages are scripted (the same text for
every server, whatever the model answered), as an agent's client sends back
what it has; so every server sees exactly the same prompts. Clients run the
conversations ``--concurrency`` at a time (1 and 4), each one turn after the
other.

Per engine it starts, side by side, our server with the prefix cache (the
default), our server with ``--no-prefix-cache``, and on mlx ``mlx_lm.server``
(whose LRU prompt cache reuses a conversation's earlier turns); at each
concurrency they take turns on the same workload (a fresh system prompt per
concurrency level, so no level reuses another's). It prints time to first
token (p50/p95) of first turns, of later turns and of all, the total time,
the share of prompt tokens each server reports cached, the ratios of cache
on to cache off and to the peer, and how busy the rest of the host was
(``bench/hostload.py``).

    .venv/bin/python bench/agent.py [--engine transformers|mlx|both]
        [--model tiny|large] [--concurrency 1 4] [--no-peer] [--threads N]
        [--output bench/agent-results.md]

The tiny model (the embedded default) is the default. On the large bench
model (``--model large``) a 2-core host prefills a 2,300-token turn in about
0.6 s on the transformers engine (bfloat16) but about 11 s on mlx, whose
cache-off run of 48 turns then takes about 9 minutes at concurrency 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty, SimpleQueue
from typing import IO

import numpy as np
from hostload import Span, wait_quiet
from loadgen import Connection, HttpError, NoResponse, sse_events, wait_healthy
from models import serving_model, synthetic_corpus
from serve import find_openblas, free_port

from sluiceway.engines.default_model import default_model_dir
from sluiceway.engines.select import process_environment

PYTHON = sys.executable
ON, OFF, PEER = "sluiceway", "sluiceway --no-prefix-cache", "mlx_lm.server"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {
                    arg: {"type": "string", "description": f"the {arg}"} for arg in args
                },
                "required": list(args),
            },
        },
    }
    for name, description, args in (
        ("read_file", "Read a file of the repository and return its text.", ("path",)),
        ("write_file", "Replace a file's text with new text.", ("path", "text")),
        ("run_command", "Run a shell command in the repository; return its output.", ("command",)),
        ("search_code", "Find where a string occurs in the repository.", ("query", "glob")),
        ("list_directory", "List the entries of a directory.", ("path",)),
    )
]


@dataclass(frozen=True, slots=True)
class Workload:
    system: str
    #: Per conversation, per turn: (user message, scripted assistant reply).
    conversations: tuple[tuple[tuple[str, str], ...], ...]

    def messages(self, conversation: int, turn: int) -> list[dict[str, str]]:
        out = [{"role": "system", "content": self.system}]
        for user, assistant in self.conversations[conversation][:turn]:
            out += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        out.append({"role": "user", "content": self.conversations[conversation][turn][0]})
        return out


def build_workload(
    tokenizer_json: Path, corpus: str, *, system_tokens: int, conversations: int, turns: int
) -> Workload:
    """Text cut from ``corpus``: a system prompt of ``system_tokens`` tokens,
    tool definitions included; user messages of ~60 tokens, replies of ~40."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    words = corpus.split()
    rng = np.random.default_rng(0)

    def text(tokens: int) -> str:
        start = int(rng.integers(0, len(words) - 4 * tokens))
        piece: list[str] = []
        while len(tokenizer.encode(" ".join(piece)).ids) < tokens:
            piece += words[start + len(piece) : start + len(piece) + 4]
        return " ".join(piece)

    tools = f"You may call these tools:\n{json.dumps(TOOLS)}"
    words_budget = max(100, system_tokens - len(tokenizer.encode(tools).ids))
    system = (
        f"Session {secrets.token_hex(4)}. You are a coding agent. {text(words_budget)}\n\n{tools}"
    )
    return Workload(
        system,
        tuple(tuple((text(60), text(40)) for _ in range(turns)) for _ in range(conversations)),
    )


# --- one turn ----------------------------------------------------------------


@dataclass(slots=True)
class Turn:
    conversation: int
    turn: int
    sent: float
    first: float | None = None
    done: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return (self.first or self.done) - self.sent


def chat_turn(
    connection: Connection, body: dict[str, object], conversation: int, turn: int
) -> Turn:
    record = Turn(conversation, turn, sent=time.perf_counter())
    try:
        reply = connection.post(
            "/v1/chat/completions", json.dumps(body).encode(), record.sent + 900
        )
        pieces = reply.body()
    except (OSError, EOFError, HttpError, NoResponse) as error:
        connection.close()
        record.error = f"{type(error).__name__}: {error}"[:200]
        return record
    record.done = time.perf_counter()
    if reply.status != 200:
        record.error = f"HTTP {reply.status}: {b''.join(p for _, p in pieces)[:200]!r}"
        return record
    for arrived, data in sse_events(pieces):
        if data == b"[DONE]":
            continue
        chunk = json.loads(data)
        usage = chunk.get("usage")
        if usage:
            record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            record.completion_tokens = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            record.cached_tokens = int(details.get("cached_tokens") or 0)
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            visible = any(
                delta.get(key)
                for key in ("content", "reasoning_content", "reasoning", "tool_calls")
            )
            if visible and record.first is None:
                record.first = arrived
    return record


# --- one run: every conversation on one server ---------------------------------------------


@dataclass(slots=True)
class Run:
    server: str
    concurrency: int
    turns: list[Turn] = field(default_factory=list)
    wall: float = 0.0
    other_cores: float = 0.0

    def good(self, first: bool | None = None) -> list[Turn]:
        return [
            t for t in self.turns if t.error is None and (first is None or (t.turn == 0) == first)
        ]

    def ttft(self, q: float, first: bool | None = None) -> float:
        values = [t.ttft for t in self.good(first)]
        return float(np.percentile(values, q)) if values else float("nan")

    @property
    def errors(self) -> int:
        return len(self.turns) - len(self.good())

    @property
    def cached_share(self) -> float:
        good = self.good()
        prompt = sum(t.prompt_tokens for t in good)
        return sum(t.cached_tokens for t in good) / prompt if prompt else 0.0

    @property
    def completion_tokens(self) -> int:
        return sum(t.completion_tokens for t in self.good())


def run_conversations(
    base_url: str, body_fields: dict[str, object], workload: Workload, concurrency: int
) -> tuple[list[Turn], float]:
    """``concurrency`` clients take conversations from a shared list, each
    playing one conversation's turns one after the other."""
    pending: SimpleQueue[int] = SimpleQueue()
    for conversation in range(len(workload.conversations)):
        pending.put(conversation)

    def client() -> list[Turn]:
        connection = Connection(base_url)
        done: list[Turn] = []
        try:
            while True:
                try:
                    conversation = pending.get_nowait()
                except Empty:
                    break
                for turn in range(len(workload.conversations[conversation])):
                    body = {**body_fields, "messages": workload.messages(conversation, turn)}
                    done.append(chat_turn(connection, body, conversation, turn))
        finally:
            connection.close()
        return done

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(lambda _: client(), range(concurrency)))
    return [t for r in results for t in r], time.perf_counter() - started


# --- servers -------------------------------------------------------------------------------


@dataclass(slots=True)
class Server:
    name: str
    process: subprocess.Popen[bytes]
    base_url: str
    body: dict[str, object]
    log: IO[str]


def start(name: str, engine: str, model: Path, args: argparse.Namespace) -> Server:
    port = free_port()
    if name == PEER:
        command = [
            *(PYTHON, "-m", "mlx_lm", "server", "--model", str(model), "--port", str(port)),
            *("--decode-concurrency", str(max(args.concurrency))),
            *("--max-tokens", str(args.max_tokens), "--log-level", "WARNING"),
        ]
        extra: dict[str, object] = {}
    else:
        command = [
            *(PYTHON, "-m", "sluiceway", "serve", "--model", str(model), "--engine", engine),
            *("--port", str(port), "--max-num-seqs", str(max(args.concurrency))),
            *("--log-level", "warning"),
            *(["--no-prefix-cache"] if name == OFF else []),
        ]
        # Ours always generates max_tokens (the peer ignores unknown fields).
        extra = {"ignore_eos": True}
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    if engine == "mlx":
        env = process_environment(engine) | env
        if (openblas := find_openblas()) and not args.no_openblas:
            env["LD_PRELOAD"] = openblas
    log = tempfile.NamedTemporaryFile(  # noqa: SIM115  # closed in stop()
        "w+", prefix=f"bench-agent-{name.split()[0]}-", suffix=".log", delete=False
    )
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tempfile.gettempdir()
    )
    body = {
        "model": str(model),
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    return Server(name, process, f"http://127.0.0.1:{port}", body, log)


def stop(server: Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(30)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
    server.log.close()
    os.unlink(server.log.name)


def ready(server: Server) -> None:
    alive = server.process.poll
    asyncio.run(wait_healthy(server.base_url, 900, lambda: alive() is None))
    # A short conversation unrelated to the workload: compiles and warms.
    warm = Workload("Warm up.", ((("Hello there.", "Hi."),),))
    turns, _ = run_conversations(server.base_url, server.body, warm, 1)
    if turns[0].error:
        raise RuntimeError(f"{server.name} failed its warm-up: {turns[0].error}")


# --- the report ----------------------------------------------------------------------------


def table(runs: Sequence[Run]) -> list[str]:
    lines = [
        "| server | concurrency | TTFT p50 / p95, first turns | TTFT p50 / p95, later turns "
        "| TTFT p50 / p95, all | total | cached | tokens out | errors | other CPU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        lines.append(
            f"| {run.server} | {run.concurrency} "
            f"| {run.ttft(50, True):.3f} / {run.ttft(95, True):.3f} s "
            f"| {run.ttft(50, False):.3f} / {run.ttft(95, False):.3f} s "
            f"| {run.ttft(50):.3f} / {run.ttft(95):.3f} s | {run.wall:.1f} s "
            f"| {run.cached_share:.0%} | {run.completion_tokens} | {run.errors} "
            f"| {run.other_cores:.2f} |"
        )
    return lines


def ratios(runs: Sequence[Run]) -> list[str]:
    by = {(r.server, r.concurrency): r for r in runs}
    lines = []
    for concurrency in sorted({r.concurrency for r in runs}):
        on, off, peer = (by.get((s, concurrency)) for s in (ON, OFF, PEER))
        if on is None:
            continue
        parts = []
        if off is not None:
            parts.append(
                f"later-turn TTFT p50 on/off {on.ttft(50, False) / off.ttft(50, False):.2f} "
                f"(target <= 0.2), total on/off {on.wall / off.wall:.2f} (target <= 0.5)"
            )
        if peer is not None:
            parts.append(
                f"later-turn TTFT p50 ours/{PEER} {on.ttft(50, False) / peer.ttft(50, False):.2f}, "
                f"total ours/{PEER} {on.wall / peer.wall:.2f} (target < 1)"
            )
        lines.append(f"- concurrency {concurrency}: " + "; ".join(parts))
    return lines


def section(engine: str, model: Path, tokenizer_corpus: str, args: argparse.Namespace) -> list[str]:
    names = [ON, OFF] + ([PEER] if engine == "mlx" and not args.no_peer else [])
    print(f"== {engine}: starting {', '.join(names)}", flush=True)
    servers = [start(name, engine, model, args) for name in names]
    runs: list[Run] = []
    try:
        for server in servers:
            ready(server)
        for concurrency in args.concurrency:
            workload = build_workload(
                model / "tokenizer.json",
                tokenizer_corpus,
                system_tokens=args.system_tokens,
                conversations=args.conversations,
                turns=args.turns,
            )
            for server in servers:
                wait_quiet(args.busy)
                span = Span.start()
                turns, wall = run_conversations(server.base_url, server.body, workload, concurrency)
                run = Run(server.name, concurrency, turns, wall, span.other_cores())
                runs.append(run)
                print(f"  {table([run])[-1]}", flush=True)
    finally:
        for server in servers:
            stop(server)
    prompt = max((t.prompt_tokens for r in runs for t in r.good()), default=0)
    return [
        f"### {engine}",
        "",
        f"Prompts of up to {prompt} tokens, {args.max_tokens} tokens out per turn.",
        "",
        *table(runs),
        "",
        *ratios(runs),
        "",
    ]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["transformers", "mlx", "both"], default="both")
    parser.add_argument("--model", choices=["tiny", "large"], default="tiny")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--no-peer", action="store_true", help=f"leave {PEER} out")
    parser.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS for the servers")
    parser.add_argument("--no-openblas", action="store_true")
    parser.add_argument("--busy", type=float, default=0.3, help="wait for others below this")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    model = serving_model() if args.model == "large" else default_model_dir()
    corpus = synthetic_corpus(seed=1, lines=4000)
    engines = ["transformers", "mlx"] if args.engine == "both" else [args.engine]
    started = time.perf_counter()
    load = os.getloadavg()
    lines = [
        f"## Agent workload ({args.model} model, {args.conversations} conversations x "
        f"{args.turns} turns, ~{args.system_tokens}-token system prompt with tools)",
        "",
        f"Load average at the start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
        f"on {os.cpu_count()} CPUs; *other CPU* is the cores other processes used "
        "during each run.",
        "",
    ]
    for engine in engines:
        lines += section(engine, model, corpus, args)
    lines.append(f"Ran in {time.perf_counter() - started:.0f} s.")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.output is not None:
        args.output.write_text(report)


if __name__ == "__main__":
    main()
