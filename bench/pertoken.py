"""Where a streamed token's CPU time goes, stage by stage (issue J's profile).

    .venv/bin/python bench/pertoken.py [--concurrency 1 16] [--requests 8]
        [--max-tokens 128] [--api chat completions] [--out FILE.json]

Starts ``sluiceway serve`` on the embedded default model (transformers
engine, engine thread) with counters wrapped around the per-token path, then
streams greedy, sampled (temperature 1) and sampled-with-top-5-logprobs
requests at each concurrency and prints, per token, the CPU time of each
stage in µs and as a share of the pipeline's CPU.

Why CPU time and not wall time: the host is shared and loaded, and a stage
that waits for a core has not used it. Each wrapper reads its thread's CPU
clock (``time.thread_time_ns``, ``CLOCK_THREAD_CPUTIME_ID``) on entry and
exit and charges the time *exclusively*: a stage's figure excludes the
stages it calls (the output actor excludes the detokenizer and parsers it
runs; the encoder excludes JSON and SSE framing). Only synchronous code is
wrapped, so a suspension can never be charged to a stage. What is left of
the event loop thread's CPU (``/proc``'s schedstat for the thread) after the
stages is *event loop and glue*: asyncio's selector and callbacks, anyio's
channels and task switches, Hypercorn's ASGI send path above the socket
write, request handling (parse, validate, render, tokenise) amortised over
the request's tokens.

Stages:

- scheduler: the scheduler's synchronous bookkeeping (absorb a step, plan
  the next, decide finishes, fan out to requests) -- mailbox wake-ups of the
  HTTP task included.
- sampler: ``sample_step`` (on the loop, in the scheduler's task, for a
  step of at most ``INLINE_LOGITS`` logits, else in a worker thread; both
  reported, by thread).
- reducer: ``reduce_step`` (likewise).
- detokenizer / stop + parsers + assembler / output actor: the text path
  (``IncrementalDetokenizer``, ``ChoicePipeline.feed`` minus the
  detokenizer, ``RequestOutputs.handle`` minus both: deltas, logprob
  entries, finish).
- encoder / JSON / SSE: ``encode`` of the surface's stream encoder, minus
  pydantic's ``to_json`` and the ``sse`` framing it calls.
- HTTP framing: h11's ``Connection.send`` (chunked encoding).
- socket write: asyncio's transport ``write`` (the ``send`` syscall; on
  loopback the kernel runs the receiver's TCP work and wake-up inside it).

Each wrapper costs two clock reads (about 0.3 µs each on this host: printed
as ``clock read``); with ~15 wrapped calls per token that is a few µs per
token, charged to the stages.

``--process-cpu``: the API process's whole CPU per streamed token, nothing
wrapped (issues N and P)::

    .venv/bin/python bench/pertoken.py --process-cpu [--rounds 5]
        [--concurrency 1 16] [--api completions chat] [--engine transformers|vllm]
        [--python .venv-vllm/bin/python] [--ab OLD_CHECKOUT] [--vllm-peer]

Each side is a plain ``sluiceway serve`` on the embedded default model (the
engine where the server puts it by default: the transformers engine in its
child process), or vLLM's own OpenAI server (``--vllm-peer``). Streaming
requests of ``--max-tokens`` with ``ignore_eos`` come from ``loadgen``'s
client (a closed loop of ``concurrency`` clients); the CPU is the
``utime + stime`` of the server's process from ``/proc/PID/stat`` before and
after the level (its threads, not the engine's child process), over the
tokens the replies report. ``--ab DIR`` adds a side that runs the code of
another checkout (a ``git worktree`` of an older commit, on ``PYTHONPATH``);
the sides take turns within each round, in alternating order, and the
medians of the rounds are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent

# --- in the server process ------------------------------------------------

_clock = time.thread_time_ns
#: Per thread: [current stage stack, exclusive ns per stage, calls per stage].
_LOCAL = threading.local()
_ALL: list[tuple[str, dict[str, int], dict[str, int]]] = []
_ALL_LOCK = threading.Lock()


def _state() -> tuple[list[Any], dict[str, int], dict[str, int]]:
    try:
        return _LOCAL.state  # type: ignore[no-any-return]
    except AttributeError:
        # A stack of [stage, start] frames, the totals and the call counts.
        stack: list[Any] = []
        totals: dict[str, int] = {}
        calls: dict[str, int] = {}
        _LOCAL.state = (stack, totals, calls)
        with _ALL_LOCK:
            _ALL.append((threading.current_thread().name, totals, calls))
        return _LOCAL.state  # type: ignore[no-any-return]


def _timed(stage: str, function: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        stack, totals, calls = _state()
        now = _clock()
        if stack:  # the caller's time so far is the caller's
            caller = stack[-1]
            totals[caller[0]] = totals.get(caller[0], 0) + now - caller[1]
        frame: list[Any] = [stage, now]
        stack.append(frame)
        try:
            return function(*args, **kwargs)
        finally:
            now = _clock()
            totals[stage] = totals.get(stage, 0) + now - frame[1]
            calls[stage] = calls.get(stage, 0) + 1
            stack.pop()
            if stack:
                stack[-1][1] = now

    wrapper.__wrapped__ = function  # type: ignore[attr-defined]
    return wrapper


def _wrap(owner: Any, name: str, stage: str) -> None:
    setattr(owner, name, _timed(stage, getattr(owner, name)))


def install() -> None:
    """Wrap the per-token path (see the module docstring)."""
    import asyncio.base_events
    import asyncio.events
    import asyncio.selector_events
    import selectors

    import h11

    from sluiceway.actors import output, reducer, sampler, scheduler, scheduler_core
    from sluiceway.parsers import detokenizer, pipeline
    from sluiceway.surfaces import wire
    from sluiceway.surfaces.openai import chat_encoder, completions_encoder, encoding

    cls = scheduler.Scheduler
    core = scheduler_core.SchedulerCore
    for name in ("absorb", "plan", "decide", "rows"):
        _wrap(core, name, f"scheduler: {name}")
    for name in ("_start", "_drain"):
        _wrap(cls, name, f"scheduler: {name.strip('_')}")
    _wrap(cls, "_publish_counters", "scheduler: other")
    _wrap(core, "command", "scheduler: other")
    _wrap(asyncio.base_events.BaseEventLoop, "_run_once", "asyncio loop (timers, ready queue)")
    _wrap(selectors.EpollSelector, "select", "epoll")
    _wrap(asyncio.events.Handle, "_run", "coroutine glue (anyio, Hypercorn, async code)")
    _wrap(sampler, "sample_step", "sampler")
    for module in (reducer, sampler):  # each calls the reducer's core by its own name
        if hasattr(module, "reduce_step"):
            _wrap(module, "reduce_step", "reducer")
    _wrap(detokenizer.IncrementalDetokenizer, "feed", "detokenizer")
    _wrap(pipeline.ChoicePipeline, "feed", "stop + parsers + assembler")
    _wrap(output.RequestOutputs, "handle", "output actor (deltas, entries)")
    _wrap(chat_encoder.ChatStreamEncoder, "encode", "encoder")
    _wrap(completions_encoder.CompletionStreamEncoder, "encode", "encoder")
    _wrap(wire.WireModel, "to_json", "JSON (pydantic)")
    for module in (chat_encoder, completions_encoder, encoding):
        if hasattr(module, "sse"):
            _wrap(module, "sse", "SSE framing")
        if hasattr(module, "json_string"):
            _wrap(module, "json_string", "JSON (text)")
    _wrap(h11.Connection, "send", "HTTP framing (h11)")
    transport = getattr(asyncio.selector_events, "_SelectorSocketTransport")  # noqa: B009
    _wrap(transport, "write", "socket write")


def _thread_cpu() -> dict[int, tuple[str, int]]:
    """CPU ns of every thread of this process, by native id."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    found: dict[int, tuple[str, int]] = {}
    for task in Path("/proc/self/task").iterdir():
        tid = int(task.name)
        try:
            ns = int((task / "schedstat").read_text().split()[0])
        except OSError:
            continue
        found[tid] = (names.get(tid, "compute"), ns)
    return found


_BASE: dict[str, Any] = {}
#: ``--cprofile``: the event loop thread under cProfile between reset and snapshot.
_PROFILE: dict[str, Any] = {}


def _reset(*_: Any) -> None:
    if "path" in _PROFILE:
        import cProfile

        _PROFILE["profile"] = profile = cProfile.Profile(time.thread_time)
        profile.enable()
    with _ALL_LOCK:
        for _name, totals, calls in _ALL:
            totals.clear()
            calls.clear()
    _BASE["threads"] = _thread_cpu()


def _snapshot(path: str) -> Callable[..., None]:
    def handler(*_: Any) -> None:
        threads = _thread_cpu()
        if "profile" in _PROFILE:
            profile = _PROFILE.pop("profile")
            profile.disable()
            count = len(list(Path(_PROFILE["path"]).parent.glob("*.pstats")))
            profile.dump_stats(f"{_PROFILE['path']}.{count}.pstats")
        base = _BASE.get("threads", {})
        cpu: dict[str, int] = {}
        for tid, (name, ns) in threads.items():
            role = _role(tid, name)
            cpu[role] = cpu.get(role, 0) + ns - base.get(tid, (name, 0))[1]
        stages: dict[str, dict[str, int]] = {}
        calls: dict[str, dict[str, int]] = {}
        with _ALL_LOCK:
            for name, totals, counts in _ALL:
                role = "event loop" if name == "MainThread" else _role(0, name)
                for stage, ns in totals.items():
                    stages.setdefault(role, {})
                    stages[role][stage] = stages[role].get(stage, 0) + ns
                for stage, n in counts.items():
                    calls.setdefault(role, {})
                    calls[role][stage] = calls[role].get(stage, 0) + n
        Path(path).write_text(json.dumps({"cpu": cpu, "stages": stages, "calls": calls}))

    return handler


def _role(tid: int, name: str) -> str:
    if tid == os.getpid() or name == "MainThread":
        return "event loop"
    if name == "engine":
        return "engine thread"
    if name.startswith("AnyIO worker"):
        return "worker threads"
    return "compute"


def serve(snapshot: str, argv: Sequence[str]) -> int:
    if os.environ.get("PERTOKEN_CPROFILE"):
        _PROFILE["path"] = os.environ["PERTOKEN_CPROFILE"]
    install()
    signal.signal(signal.SIGUSR1, _reset)
    signal.signal(signal.SIGUSR2, _snapshot(snapshot))
    from sluiceway.server.cli import main as cli_main

    return cli_main(list(argv))


# --- in the benchmark process ---------------------------------------------

MODES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0},
    "sampled": {"temperature": 1.0, "seed": 7},
    "sampled, top-5 logprobs": {"temperature": 1.0, "seed": 7, "logprobs": True},
}


def _body(api: str, mode: str, index: int, max_tokens: int) -> tuple[str, dict[str, Any]]:
    prompt = f"request {index}: tell me about rivers and the sea. " * 4
    body: dict[str, Any] = {
        "model": "sluiceway-default",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **MODES[mode],
    }
    if api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        if body.pop("logprobs", False):
            body |= {"logprobs": True, "top_logprobs": 5}
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    if body.pop("logprobs", False):
        body["logprobs"] = 5
    return "/v1/completions", body


def _stream(client: httpx.Client, path: str, body: dict[str, Any]) -> int:
    tokens = 0
    with client.stream("POST", path, json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {") and '"usage":{' in line:
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    return tokens


def _load(url: str, api: str, mode: str, concurrency: int, requests: int, max_tokens: int) -> int:
    counter = iter(range(10**9))
    lock = threading.Lock()

    def client_run(_: int) -> int:
        total = 0
        with httpx.Client(base_url=url) as client:
            for _ in range(requests):
                with lock:
                    index = next(counter)
                total += _stream(client, *_body(api, mode, index, max_tokens))
        return total

    with ThreadPoolExecutor(concurrency) as pool:
        return sum(pool.map(client_run, range(concurrency)))


def _wait(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError("the server exited")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise RuntimeError("the server did not start")


def measure(
    process: subprocess.Popen[bytes], url: str, snapshot: Path, level: dict[str, Any]
) -> dict[str, Any]:
    api, mode, conc = level["api"], level["mode"], level["concurrency"]
    _load(url, api, mode, conc, 1, 16)  # warm-up of this mode
    process.send_signal(signal.SIGUSR1)
    time.sleep(0.2)
    started = time.perf_counter()
    tokens = _load(url, api, mode, conc, level["requests"], level["max_tokens"])
    wall = time.perf_counter() - started
    snapshot.unlink(missing_ok=True)
    process.send_signal(signal.SIGUSR2)
    while not snapshot.exists():
        time.sleep(0.05)
    time.sleep(0.1)
    data = json.loads(snapshot.read_text())
    return {**level, "tokens": tokens, "wall": wall, **data}


def table(result: dict[str, Any]) -> str:
    """One level's figures: µs per token by stage and thread, and shares."""
    tokens = result["tokens"]
    us = 1e-3 / tokens
    cpu = result["cpu"]
    rows: list[tuple[str, str, float]] = []
    for role in ("event loop", "worker threads"):
        stages = result["stages"].get(role, {})
        for stage, ns in sorted(stages.items(), key=lambda kv: -kv[1]):
            rows.append((role, stage, ns * us))
        if role == "event loop":
            rest = cpu.get(role, 0) - sum(stages.values())
            rows.append((role, "the rest (signal handlers, loop exits)", rest * us))
        elif cpu.get(role):
            rest = cpu[role] - sum(stages.values())
            rows.append((role, "thread pool hand-over (the rest)", rest * us))
    pipeline = sum(value for _, _, value in rows)
    calls = sum(n for role in result["calls"].values() for n in role.values()) / tokens
    lines = [
        f"#### {result['api']}, {result['mode']}, concurrency {result['concurrency']}",
        "",
        f"{tokens} tokens in {result['wall']:.1f} s ({tokens / result['wall']:.0f} tok/s); "
        f"pipeline CPU **{pipeline:.0f} µs per token** (event loop "
        f"{cpu.get('event loop', 0) * us:.0f}, worker threads "
        f"{cpu.get('worker threads', 0) * us:.0f}); engine thread "
        f"{cpu.get('engine thread', 0) * us:.0f}, torch compute "
        f"{cpu.get('compute', 0) * us:.0f}. Wrapped calls: {calls:.0f} per token "
        f"(at ~{result['wrapper_us']:.1f} µs each, ~{calls * result['wrapper_us']:.0f} µs "
        "of the figures below are the measurement's own).",
        "",
        "| thread | stage | µs/token | share of pipeline |",
        "|---|---|--:|--:|",
    ]
    for role, stage, value in rows:
        lines.append(f"| {role} | {stage} | {value:.1f} | {value / pipeline:.0%} |")
    return "\n".join(lines) + "\n"


def wrapper_cost() -> float:
    """CPU µs one wrapped call adds (its two clock reads and bookkeeping)."""
    count = 100_000
    bare, timed = (lambda: None), _timed("calibration", lambda: None)
    costs = []
    for function in (bare, timed):
        started = _clock()
        for _ in range(count):
            function()
        costs.append((_clock() - started) / count / 1e3)
    return costs[1] - costs[0]


# --- --process-cpu: the API process's CPU per streamed token ----------------


@dataclass(frozen=True, slots=True)
class Side:
    """One server under measurement: how to start it."""

    label: str
    command: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()


def process_ticks(pid: int) -> int:
    """``utime + stime`` of one process (all its threads, no children), in ticks."""
    with open(f"/proc/{pid}/stat") as stat:
        rest = stat.read().rsplit(")", 1)[1].split()
    return int(rest[11]) + int(rest[12])  # fields 14 and 15


def sides(args: argparse.Namespace) -> list[Side]:
    python = str(args.python)
    model: tuple[str, ...] = ()
    if args.engine == "vllm" or args.vllm_peer:
        from sluiceway.engines.default_model import default_model_dir

        model = ("--model", str(default_model_dir()))
    ours = (
        *(python, "-m", "sluiceway", "serve", *model, "--engine", args.engine),
        *("--max-num-seqs", str(max(args.concurrency)), "--log-level", "warning"),
        *args.server_args.split(),
    )
    from peers import VLLM_ENVIRONMENT

    vllm_env = tuple(VLLM_ENVIRONMENT.items())
    env = vllm_env if args.engine == "vllm" else ()
    found = [Side("this checkout", ours, (("PYTHONPATH", str(ROOT)), *env))]
    if args.ab is not None:
        found.append(Side(f"{args.ab}", ours, (("PYTHONPATH", str(args.ab.resolve())), *env)))
    if args.vllm_peer:
        peer = (
            *(python, "-m", "vllm.entrypoints.openai.api_server", *model),
            *("--max-num-seqs", str(max(args.concurrency))),
        )
        found.append(Side("vLLM's server", peer, vllm_env))
    return found


@dataclass(slots=True)
class Running:
    side: Side
    process: subprocess.Popen[bytes]
    port: int
    model: str = ""
    #: (api, concurrency) -> ms of CPU per token, one per round.
    figures: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    rates: dict[tuple[str, int], list[float]] = field(default_factory=dict)


def start(side: Side, port: int) -> Running:
    log = open(Path(tempfile.gettempdir()) / f"pertoken-cpu-{port}.log", "wb")  # noqa: SIM115
    command = [*side.command, "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **dict(side.env)}
    # The working directory is not this checkout: ``python -m`` puts it first on sys.path.
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tempfile.gettempdir()
    )
    log.close()
    return Running(side, process, port)


def measure_cpu(running: Running, api: str, concurrency: int, args: argparse.Namespace) -> None:
    from loadgen import Target, run_level

    target = Target(f"http://127.0.0.1:{running.port}", running.model, api=api)
    prompts = (f"request {i}: tell me about rivers and the sea. " * 4 for i in range(10**9))
    requests = max(1, args.tokens_per_level // (concurrency * args.max_tokens))
    asyncio.run(
        run_level(target, prompts, concurrency=concurrency, requests_per_client=1, max_tokens=16)
    )
    before = process_ticks(running.process.pid)
    level = asyncio.run(
        run_level(
            target,
            prompts,
            concurrency=concurrency,
            requests_per_client=requests,
            max_tokens=args.max_tokens,
        )
    )
    ticks = process_ticks(running.process.pid) - before
    if level.errors:
        raise RuntimeError(f"{running.side.label}: {level.first_errors()}")
    ms = ticks / os.sysconf("SC_CLK_TCK") * 1e3 / level.tokens
    running.figures.setdefault((api, concurrency), []).append(ms)
    running.rates.setdefault((api, concurrency), []).append(level.throughput)
    print(
        f"  {running.side.label:>20} {api:>11} c={concurrency:<3} {ms:.3f} ms CPU/token "
        f"({level.tokens} tokens, {level.throughput:.0f} tok/s)",
        flush=True,
    )


def process_cpu(args: argparse.Namespace) -> None:
    from loadgen import wait_healthy

    running = [start(side, args.port + i) for i, side in enumerate(sides(args))]
    try:
        for server in running:
            alive = server.process.poll
            url = f"http://127.0.0.1:{server.port}"
            asyncio.run(wait_healthy(url, 1200, lambda alive=alive: alive() is None))
            server.model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        for round_ in range(args.rounds):
            print(f"round {round_ + 1}", flush=True)
            for api in args.api:
                for concurrency in args.concurrency:
                    order = running if round_ % 2 == 0 else running[::-1]
                    for server in order:
                        measure_cpu(server, api, concurrency, args)
    finally:
        for server in running:
            server.process.send_signal(signal.SIGINT)
        for server in running:
            try:
                server.process.wait(30)
            except subprocess.TimeoutExpired:
                server.process.kill()
                server.process.wait()
    print("\n| server | api | c | ms CPU/token, median | rounds | tok/s, median |")
    print("|---|---|--:|--:|---|--:|")
    for server in running:
        for (api, concurrency), values in server.figures.items():
            rates = server.rates[(api, concurrency)]
            print(
                f"| {server.side.label} | {api} | {concurrency} | {statistics.median(values):.3f} "
                f"| {' '.join(f'{v:.3f}' for v in values)} | {statistics.median(rates):.0f} |"
            )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--requests", type=int, default=8, help="per client")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--api", nargs="+", default=["chat", "completions"])
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    parser.add_argument("--port", type=int, default=8871)
    parser.add_argument("--server-args", default="", help="extra flags for the server")
    parser.add_argument("--out", type=Path, help="write the raw figures here (JSON)")
    parser.add_argument(
        "--cprofile",
        type=Path,
        help="also run the event loop thread under cProfile (CPU clock) and write "
        "PREFIX.N.pstats per level (slower: use for the breakdown, not the figures)",
    )
    parser.add_argument(
        "--process-cpu",
        action="store_true",
        help="measure the API process's whole CPU per streamed token (see the docstring)",
    )
    parser.add_argument("--rounds", type=int, default=5, help="--process-cpu: rounds")
    parser.add_argument(
        "--tokens-per-level", type=int, default=4096, help="--process-cpu: tokens per measurement"
    )
    parser.add_argument("--engine", default="transformers", help="--process-cpu: our engine")
    parser.add_argument(
        "--python",
        type=Path,
        default=Path(sys.executable),
        help="--process-cpu: the servers' python",
    )
    parser.add_argument(
        "--ab", type=Path, help="--process-cpu: also a checkout of other code (a git worktree)"
    )
    parser.add_argument(
        "--vllm-peer", action="store_true", help="--process-cpu: also vLLM's own server"
    )
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("serve_args", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        sys.exit(serve(args.serve, args.serve_args))
    if args.process_cpu:
        process_cpu(args)
        return
    snapshot = Path(tempfile.gettempdir()) / f"pertoken-{os.getpid()}.json"
    url = f"http://127.0.0.1:{args.port}"
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--serve",
        str(snapshot),
        "--",
        "serve",
        "--engine",
        "transformers",
        "--no-engine-process",
        "--port",
        str(args.port),
        "--log-level",
        "warning",
        *args.server_args.split(),
    ]
    log = open(Path(tempfile.gettempdir()) / "pertoken-server.log", "wb")  # noqa: SIM115
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if args.cprofile:
        env["PERTOKEN_CPROFILE"] = str(args.cprofile.resolve())
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    results = []
    try:
        _wait(url, process)
        overhead = wrapper_cost()
        print(f"one wrapped call costs {overhead:.2f} µs of CPU\n")
        for api in args.api:
            for concurrency in args.concurrency:
                for mode in args.modes:
                    level = {
                        "api": api,
                        "mode": mode,
                        "concurrency": concurrency,
                        "requests": args.requests,
                        "max_tokens": args.max_tokens,
                    }
                    result = measure(process, url, snapshot, level) | {"wrapper_us": overhead}
                    results.append(result)
                    print(table(result), flush=True)
    finally:
        process.send_signal(signal.SIGINT)
        process.wait()
        log.close()
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
