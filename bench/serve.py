"""Serving benchmark: our server against the bare engine and against peer servers.

One command builds (once, cached) the models, then for each engine:

* the **bare engine** (``bench/bare.py``, in a process of its own): the model in
  a plain decode loop at batch 1, 4, 16, 64 -- the ceiling;
* **sluiceway** (``sluiceway serve --max-num-seqs 64``) under a loopback load
  generator (``bench/loadgen.py``): streaming ``/v1/completions`` clients,
  greedy (``--load sampled`` / ``top5``, or any ``--body`` fields, for
  other loads), every prompt exactly ``--prompt-tokens`` tokens with the model's
  tokenizer (each request its own prompt), ``max_tokens`` fixed with
  ``ignore_eos``, at concurrency 1, 4, 16, 64, after a warm-up;
  each of those levels runs ``--paired-rounds`` times (3), each round between two
  measurements of the bare engine at the same batch size, and the round with
  the median ratio to the bare engine is reported (all ratios are listed,
  with their mean and its standard error);
* the **peers** on the same model, load and prompts, up at the same time as
  ours (``bench/peers.py``): at each concurrency they take turns with ours
  round by round (bare, ours, bare, each peer), each peer's median round by
  tok/s is reported, and ours ÷ theirs is the median of the per-round
  ratios, so that the host's drift over minutes does not decide it. Beside
  our transformers engine: vLLM's own OpenAI server at its defaults and
  forced to eager float32 (``--vllm-python``), and llama.cpp's
  ``llama-server`` on GGUFs of the weights at f32 and Q8_0
  (``bench/llama_peer.py``); beside our mlx engine, ``mlx_lm.server``;
  ``--peers`` picks others (``transformers serve``, run from a venv under
  /tmp created on first use that adds FastAPI and Uvicorn to this one's).

``--engine vllm`` races our server over vLLM's engine (``sluiceway serve
--engine vllm``) against vLLM's own OpenAI server, both from the vLLM
environment (``--vllm-python``) at their defaults (compiled, ``--dtype
auto``), the same engine underneath: there is no bare loop there, and each
level's rounds take turns server against server.

on two models: ``large``, a ~42M-parameter random Qwen3 (compute dominates)
and ``tiny``, the embedded default model (server overhead dominates). It
prints one markdown report (and writes it to ``--output``): tokens/s, TTFT
and inter-token latency percentiles, errors, our ratio to the bare engine,
the targets met or missed, and our pipeline's cost per streamed token.

    .venv/bin/python bench/serve.py [--engine transformers|mlx|vllm|both] [--quick]
        [--models large tiny] [--concurrency 1 4 16 64] [--no-peers] [--trace]
        [--server-args='--engine-process'] [--server-env K=V ...]
        [--load greedy|sampled|top5] [--body JSON] [--keep-logs]
        [--stagger SECONDS] [--bare-samples] [--one-thread-bare]
        [--output bench/serve-results.md]

The default run takes about 25 minutes on a 2-core host, ``--quick`` about 3.
The host is measured for other load (``bench/hostload.py``): a measurement
waits for a quiet host and is repeated while other processes were busy
(``--busy``, ``--retries``); the *other CPU* column shows what remained.
Load that ``/proc`` cannot see (another guest on the same physical core of
a virtual machine) shows in the header's *host steadiness*: a fixed Python
loop timed 30 times (10 with ``--quick``) at the start of the run and at
its end (about 7 s each); a median far above the best means the host ran
slow much of the time, and single rounds are not to be trusted.

The thread tuner's switches (``sluiceway.actors.thread_tuner``) are read
from our server's log into the report. ``--one-thread-bare`` (transformers)
keeps a second bare loop up on one torch thread and measures it around each
of our paired rounds too: where the tuner gives our engine one thread (the
tiny model at c>=16 on two cores), decode ÷ that loop separates what the
server costs from what the engine loses by computing on fewer threads than
the default bare loop.

``--trace`` runs our server under ``bench/trace_server.py``, which times each
scheduler step segment by segment and the CPU of each thread role, and adds
"where the time goes" tables. The traced server keeps the engine on its
engine thread (on the CPU it otherwise runs in a child process, which the
trace cannot see), so a traced run measures that placement.

mlx on Linux uses its bundled reference BLAS, which is very slow; when
Debian's OpenBLAS is installed (``apt-get install libopenblas0-pthread``) every
mlx process here -- ours, the peer and the bare loop -- runs with it preloaded
(``LD_PRELOAD``), unless ``--no-openblas``, and with the environment our
server gives its mlx engine process (``OPENBLAS_THREAD_TIMEOUT``: idle OpenBLAS
threads sleep instead of spinning; +14% for the bare loop at batch 1).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import glob
import itertools
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import llama_peer
import peers
from hostload import Span, steadiness, thread_ticks, wait_quiet
from loadgen import Level, Target, prompts_of_length, run_level, wait_healthy
from models import parameter_count, serving_model, shipped_corpus, synthetic_corpus
from peers import PeerSetup
from report import OURS, Model, Section, ServerRun, Settings, render
from trace_server import summarise, thread_roles

from sluiceway.engines.default_model import default_model_dir
from sluiceway.engines.select import process_environment

HERE = Path(__file__).resolve().parent
PYTHON = sys.executable
PEERS_VENV = Path(tempfile.gettempdir()) / "sluiceway-bench-peers"
#: What ``transformers serve`` needs beyond this venv (transformers' ``serving`` extra).
PEER_PACKAGES = ("fastapi", "uvicorn", "starlette", "rich", "accelerate")
OPENBLAS_GLOBS = (
    "/usr/lib/*/openblas-pthread/libopenblas.so.0",
    "/usr/lib/*/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)
BARE_BATCHES = (1, 4, 16, 64)
#: Requests per client at each concurrency (a closed loop: the next one starts
#: when the last one ends), in each round. Rounds of one request at
#: concurrency 1 were tried (twelve of them, for less drift within a round):
#: each then met a server idle for seconds (the wait for a quiet host, the
#: bare engine's turn), and the tiny model's ratios fell from ~0.8 to ~0.67,
#: the peers' alike. A closed-loop client keeps the server busy; so do rounds
#: of four.
REQUESTS_PER_CLIENT = {1: 4, 4: 2, 16: 2, 64: 1}
#: vLLM's interpreter, unless --vllm-python: the venv `make test-vllm` builds.
VLLM_PYTHON = HERE.parent / ".venv-vllm" / "bin" / "python"
#: The thread tuner's log line when it switches a batch size's thread count
#: (``sluiceway.actors.thread_tuner``): the report lists them.
TUNER_SWITCH = re.compile(
    r"engine threads for (batches of \d+: \d+, not \d+ \(\d+% of the time per row\))"
)


# --- processes --------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def find_openblas() -> str | None:
    for pattern in OPENBLAS_GLOBS:
        for path in sorted(glob.glob(pattern)):
            return path
    return None


def env_for(engine: str, openblas: str | None) -> dict[str, str]:
    """The environment a process running ``engine`` starts with: ``openblas``
    (a path, or None) preloaded for mlx."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    if engine == "mlx" and openblas:
        env["LD_PRELOAD"] = openblas
        # What our server gives its engine process, given to the bare loop and
        # the peer as well, so that the comparison is of the same BLAS set-up.
        env = process_environment(engine) | env
    return env


def peers_python(venv: Path, setup: bool) -> tuple[str | None, str]:
    """The peer venv's python, created on first use; or ``None`` and why not."""
    python = venv / "bin" / "python"
    probe = "import fastapi, uvicorn, transformers, torch"
    if (
        python.exists()
        and subprocess.run([python, "-c", probe], capture_output=True).returncode == 0
    ):
        return str(python), ""
    if not setup:
        return None, f"no peer venv at {venv} (run without --no-peer-setup to create it)"
    print(f"creating the peer venv {venv} (pip install {' '.join(PEER_PACKAGES)}) ...", flush=True)
    try:
        subprocess.run([PYTHON, "-m", "venv", "--clear", str(venv)], check=True)
        site = next((venv / "lib").glob("python*/site-packages"))
        # torch and transformers come from this venv; the peer venv only adds
        # what `transformers serve` needs on top, so nothing is installed here.
        ours = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
        (site / "_sluiceway_bench_base.pth").write_text("\n".join(ours) + "\n")
        subprocess.run(
            [python, "-m", "pip", "install", "--quiet", *PEER_PACKAGES],
            check=True,
            capture_output=True,
            text=True,
        )
    except (subprocess.CalledProcessError, StopIteration) as error:
        detail = getattr(error, "stderr", "") or str(error)
        return None, f"could not create the peer venv: {detail.strip()[-300:]}"
    if subprocess.run([python, "-c", probe], capture_output=True).returncode != 0:
        return None, "the peer venv cannot import fastapi/uvicorn/transformers/torch"
    return str(python), ""


def server_command(
    server: str,
    engine: str,
    model: Path,
    port: int,
    settings: Settings,
    peer_python: str | None,
    trace: str | None,
    setup: PeerSetup | None = None,
) -> list[str]:
    if server == OURS:
        python = PYTHON
        if engine == "vllm":  # our server over vLLM's engine, from the vLLM environment
            assert setup is not None
            assert setup.vllm_python is not None
            python = setup.vllm_python
        launcher = (
            [PYTHON, str(HERE / "trace_server.py"), trace] if trace else [python, "-m", "sluiceway"]
        )
        return [
            *launcher,
            *("serve", "--model", str(model), "--engine", engine),
            *("--port", str(port), "--max-num-seqs", str(max(settings.concurrency))),
            # info, the default: the report lists the thread tuner's switches
            # from the log (one access line per request costs next to nothing).
            *("--log-level", "info", "--worker-class", settings.worker_class),
            *settings.server_args,
        ]
    if server == "mlx_lm.server":
        return [
            *(PYTHON, "-m", "mlx_lm", "server", "--model", str(model), "--port", str(port)),
            *("--decode-concurrency", str(max(settings.concurrency))),
            *("--max-tokens", str(settings.max_tokens), "--log-level", "WARNING"),
        ]
    seqs = max(settings.concurrency)
    if server.startswith("vllm"):
        assert setup is not None
        assert setup.vllm_python is not None
        eager = server == "vllm-eager-f32"
        return peers.vllm_command(setup.vllm_python, model, port, seqs, eager_f32=eager)
    if server.startswith("llama"):
        assert setup is not None
        assert setup.llama_bin is not None
        gguf = llama_peer.gguf_of(model, "f32" if server == "llama-f32" else "Q8_0")
        context = settings.prompt_tokens + settings.max_tokens + 64
        return llama_peer.server_command(setup.llama_bin, gguf, port, seqs, context)
    assert peer_python is not None
    return [
        *(peer_python, "-m", "transformers.cli.transformers", "serve", str(model)),
        *("--continuous-batching", "--device", "cpu", "--dtype", "float32"),
        *("--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"),
    ]


#: ``--load``: the request bodies beside greedy. The bare engine stays a greedy
#: argmax loop unless ``--bare-samples``, so decode ÷ bare then includes
#: sampling (and the logprobs).
LOADS: dict[str, dict[str, object]] = {
    "greedy": {},
    "sampled": {"temperature": 1.0, "seed": 7},
    "top5": {"temperature": 1.0, "seed": 7, "logprobs": 5},
}


def target_for(
    server: str, port: int, model: Path, body: tuple[tuple[str, object], ...] = ()
) -> Target:
    if server == OURS:
        return Target(f"http://127.0.0.1:{port}", str(model), extra=body)
    return peers.target(server, port, model, body)


def load_body(load: str, body: str) -> tuple[tuple[str, object], ...]:
    """The fields ``--load`` names, then ``--body``'s (JSON) over them."""
    extra = json.loads(body)
    if not isinstance(extra, dict):
        raise SystemExit("--body takes a JSON object")
    return tuple({**LOADS[load], **extra}.items())


def describe_load(body: tuple[tuple[str, object], ...]) -> str:
    if not body:
        return "greedy"
    return "with " + ", ".join(f"`{key}: {json.dumps(value)}`" for key, value in body)


# --- running ----------------------------------------------------------------


def server_dtype(server_args: Sequence[str]) -> str:
    """Our server's ``--dtype`` among ``--server-args`` (auto when not given):
    the bare loop computes in the same one."""
    for index, arg in enumerate(server_args):
        if arg.startswith("--dtype="):
            return arg.partition("=")[2]
        if arg == "--dtype" and index + 1 < len(server_args):
            return server_args[index + 1]
    return "auto"


class BareEngine:
    """The bare decode loop (``bench/bare.py --stdin``) in a process of its own,
    kept up through the section so that it can be measured right before and
    after each of our levels: a drift of the host then hits both alike."""

    def __init__(self, section: Section, settings: Settings, *, one_thread: bool = False) -> None:
        command = [
            *(PYTHON, str(HERE / "bare.py"), "--engine", section.engine),
            *("--model", str(section.model.path), "--batches", "--stdin"),
            *("--prompt", str(settings.prompt_tokens), "--tokens", str(settings.max_tokens)),
            *(["--sample"] if settings.bare_samples else []),
            *("--dtype", server_dtype(settings.server_args)),
        ]
        self._process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env_for(section.engine, settings.openblas)
            | ({"OMP_NUM_THREADS": "1"} if one_thread else {}),
        )
        self._read()  # "ready", once the model is loaded and warm

    def _read(self) -> str:
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line:
            assert self._process.stderr is not None
            raise RuntimeError(self._process.stderr.read().strip()[-500:] or "bare.py exited")
        return line

    def measure(self, batch: int) -> tuple[float, float]:
        """Tokens/s and seconds per step at ``batch``."""
        assert self._process.stdin is not None
        self._process.stdin.write(f"{batch}\n")
        self._process.stdin.flush()
        row = json.loads(self._read())
        time.sleep(0.3)  # let its compute threads stop spinning before anything else runs
        return float(row["tokens_per_s"]), float(row["step"])

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


#: Why the vLLM section has no bare loop (stated in its report).
NO_VLLM_BARE = (
    "none on vLLM's engine: sluiceway and vLLM's own server run the same AsyncLLM, "
    "so they are raced against each other"
)


def start_bare(section: Section, settings: Settings) -> BareEngine | None:
    """Start the bare engine and measure every batch size: the best of
    ``bare_repeats``, each repeated while other processes were busy (none
    where the section has no bare loop: :attr:`Section.has_bare_loop`)."""
    if not section.has_bare_loop:
        section.bare_failure = NO_VLLM_BARE
        return None
    try:
        bare = BareEngine(section, settings)
    except RuntimeError as error:
        section.bare_failure = str(error)
        print(f"  bare engine failed: {error}", flush=True)
        return None
    for batch in (b for b in BARE_BATCHES if b in settings.concurrency):
        for _ in range(settings.bare_repeats):
            rate, step = measure_quietly(bare, batch, settings)
            if rate > section.bare.get(batch, 0.0):
                section.bare[batch], section.bare_step[batch] = rate, step
    cells = ", ".join(f"batch {b}: {r:.1f} tok/s" for b, r in section.bare.items())
    print(f"  bare engine: {cells}", flush=True)
    return bare


def measure_quietly(bare: BareEngine, batch: int, settings: Settings) -> tuple[float, float]:
    """The bare loop at ``batch`` on a quiet host: repeated (``--retries``)
    while other processes were busy, the fastest kept. The bare runs that
    bracket our level are its ratio's denominator: one slowed by others'
    work would flatter that round."""
    best = (0.0, 0.0)
    for _ in range(settings.retries + 1):
        wait_quiet(settings.busy)
        span = Span.start()
        measured = bare.measure(batch)
        best = max(best, measured)
        if span.other_cores() <= settings.busy:
            break
    return best


def start_one_thread_bare(section: Section, settings: Settings) -> BareEngine | None:
    """With ``--one-thread-bare``, a second bare loop on one torch thread,
    measured around each of our paired rounds beside the default one: on a
    host where the thread tuner gives our engine one thread (the tiny model
    at c>=16 on two cores), decode ÷ this loop is what the server costs on
    the threads it gave its engine."""
    if not settings.one_thread_bare or section.engine != "transformers":
        return None
    try:
        return BareEngine(section, settings, one_thread=True)
    except RuntimeError as error:
        print(f"  one-thread bare engine failed: {error}", flush=True)
        return None


@dataclass(slots=True)
class Server:
    """One server process under test, up for a whole section."""

    run: ServerRun
    process: subprocess.Popen[bytes]
    target: Target
    log: IO[str]
    prompts: Iterator[str]
    trace: str | None
    keep_log: bool = False

    @property
    def alive(self) -> bool:
        return self.run.failure is None

    def fail(self, error: Exception) -> None:
        self.log.seek(0)
        tail = self.log.read()[-1500:]
        self.run.failure = f"{error}"
        print(f"  {self.run.server} failed: {error}\n{tail}", flush=True)


def start_server(
    server: str,
    section: Section,
    settings: Settings,
    peer_python: str | None,
    setup: PeerSetup | None = None,
) -> Server:
    port = free_port()
    trace = None
    if settings.trace and server == OURS:
        handle, trace = tempfile.mkstemp(prefix="bench-trace-", suffix=".json")
        os.close(handle)
    command = server_command(
        server, section.engine, section.model.path, port, settings, peer_python, trace, setup
    )
    log = tempfile.NamedTemporaryFile(  # noqa: SIM115  # closed in stop_server
        "w+", prefix=f"bench-{server.split()[0]}-", suffix=".log", delete=False
    )
    process = subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env_for(section.engine, settings.openblas)
        | (dict(settings.server_env) if server == OURS else {})
        | (peers.vllm_environment(server) if uses_vllm(server, section.engine) else {}),
        cwd=tempfile.gettempdir(),
    )
    # The same prompts, in the same order, for every server.
    prompts = itertools.cycle(section.model.prompts)
    target = target_for(server, port, section.model.path, settings.body)
    run = ServerRun(peers.label(server), about=describe_peer(server, command, setup))
    return Server(run, process, target, log, prompts, trace, settings.keep_logs)


def uses_vllm(server: str, engine: str) -> bool:
    """Whether the server runs vLLM's engine: vLLM's own, or ours over it."""
    return server.startswith("vllm") or (server == OURS and engine == "vllm")


def describe_peer(server: str, command: list[str], setup: PeerSetup | None) -> str:
    """A peer's version and flags for the report (ours: nothing)."""
    if server == OURS or setup is None:
        return ""
    if server.startswith("vllm") and setup.vllm_python:
        env = peers.vllm_environment(server)
        return (
            f"{peers.vllm_version(setup.vllm_python)}, `{peers.flags_of(command, 3)}`, "
            f"environment `{' '.join(f'{k}={v}' for k, v in env.items())}`"
        )
    if server.startswith("llama"):
        return f"{setup.llama_version}, `{peers.flags_of(command, 1)}`"
    return f"`{peers.flags_of(command, 1)}`"


def warm_up_server(server: Server, settings: Settings) -> None:
    try:
        alive = server.process.poll
        asyncio.run(wait_healthy(server.target.base_url, 1200, lambda: alive() is None))
        asyncio.run(warm_up(server.target, server.prompts, settings))
    except (RuntimeError, TimeoutError, OSError) as error:
        server.fail(error)
        return
    if server.run.server != OURS:
        found = peers.probe(server.target, next(server.prompts))
        server.run.about = f"{server.run.about}; {found}".lstrip("; ")


def stop_server(server: Server) -> None:
    process, run = server.process, server.run
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    server.log.seek(0)
    run.tuner = [m.group(1) for m in TUNER_SWITCH.finditer(server.log.read())]
    server.log.close()
    if run.failure is None and not server.keep_log:
        os.unlink(server.log.name)
    else:
        run.note = f"log: {server.log.name}"
    if server.trace is not None:
        read_trace(run, server.trace, process.pid)


def run_servers(
    servers: Sequence[Server],
    settings: Settings,
    bare: BareEngine | None,
    single: BareEngine | None = None,
) -> None:
    """Every level on every server, taking turns: at the concurrencies the
    bare engine has a batch size for, ``rounds_at`` rounds of
    (bare engine, our level, bare engine, the peer's level), so that a drift
    of the host hits every side alike. Each server's reported level is its
    median round (ours: by decode ÷ bare; a peer: by tok/s)."""
    for concurrency in settings.concurrency:
        paired = bare if concurrency in BARE_BATCHES else None
        rounds = rounds_at(settings, concurrency)
        results: dict[str, list[tuple[float, Measured]]] = {}
        for _ in range(rounds):
            for server in servers:
                if not server.alive:
                    continue
                try:
                    key, measured = measure_turn(server, concurrency, settings, paired, single)
                except (RuntimeError, TimeoutError, OSError) as error:
                    server.fail(error)
                    continue
                results.setdefault(server.run.server, []).append((key, measured))
        for server in servers:
            turns = results.get(server.run.server)
            if turns:
                keep_median(server.run, concurrency, turns)


def measure_turn(
    server: Server,
    concurrency: int,
    settings: Settings,
    bare: BareEngine | None,
    single: BareEngine | None = None,
) -> tuple[float, Measured]:
    """One level on one server; returns the key its rounds are ranked by
    (decode ÷ bare for ours when paired, else tok/s) and the measurement.
    ``single``: the one-thread bare loop, measured around our level too."""
    run = server.run
    measure = functools.partial(
        measure_level,
        run.server,
        server.target,
        server.prompts,
        concurrency,
        settings,
        server.process.pid,
    )
    if run.server != OURS or bare is None:
        measured = measure()
        key = measured[0].throughput
    else:
        quietly = functools.partial(measure_quietly, batch=concurrency, settings=settings)
        single_before = quietly(single)[0] if single is not None else 0.0
        before = quietly(bare)
        measured = measure()
        after = quietly(bare)
        if single is not None:
            single_rate = (single_before + quietly(single)[0]) / 2
            ratio, middle = pair(run.single_ratios, run.single_middle, measured[0], single_rate)
            print(
                f"  {'one-thread bare':>18} c={concurrency:<3} {single_rate:8.1f} tok/s: "
                f"decode ÷ it {ratio:.3f} (middle half {middle:.3f})",
                flush=True,
            )
        rate, step = (before[0] + after[0]) / 2, (before[1] + after[1]) / 2
        key, middle = pair(run.paired_ratios, run.paired_middle, measured[0], rate)
        run.round_bare.setdefault(concurrency, []).append((rate, step))
        print(
            f"  {'bare engine':>18} c={concurrency:<3} {before[0]:8.1f} tok/s before, "
            f"{after[0]:.1f} after: decode ÷ bare {key:.3f} (middle half {middle:.3f})",
            flush=True,
        )
    run.round_throughput.setdefault(concurrency, []).append(measured[0].throughput)
    if server.process.poll() is not None:
        raise RuntimeError(f"the server exited with {server.process.returncode}")
    return key, measured


def pair(
    ratios: dict[int, list[float]], middles: dict[int, list[float]], level: Level, rate: float
) -> tuple[float, float]:
    """Record a round's decode ÷ a bare loop's ``rate``, whole span and middle
    half, under the level's concurrency; returns both."""
    ratio, middle = level.decode_throughput / rate, level.middle_throughput / rate
    ratios.setdefault(level.concurrency, []).append(ratio)
    middles.setdefault(level.concurrency, []).append(middle)
    return ratio, middle


def keep_median(run: ServerRun, concurrency: int, turns: list[tuple[float, Measured]]) -> None:
    """Report the round with the median key (with an even count, the lower middle one)."""
    index = sorted(range(len(turns)), key=lambda i: turns[i][0])[(len(turns) - 1) // 2]
    level, other, client, ticks = turns[index][1]
    if concurrency in run.round_bare:
        run.paired_bare[concurrency], run.paired_step[concurrency] = run.round_bare[concurrency][
            index
        ]
    run.levels.append(level)
    run.other_cpu.append(other)
    run.client_cpu.append(client)
    run.level_ticks.append(ticks)


def read_trace(run: ServerRun, path: str, pid: int) -> None:
    """Cut the server's step trace by level, and group its CPU by thread role."""
    try:
        with open(path) as file:
            trace = json.load(file)
    except (OSError, ValueError):
        run.note += " (no trace written)"
        return
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    hz = os.sysconf("SC_CLK_TCK")
    for index, level in enumerate(run.levels):
        run.traces.append(summarise(trace, level.started, level.started + level.wall))
        grouped = thread_roles(trace, pid, run.level_ticks[index])
        run.thread_cpu.append({role: t / hz / level.wall for role, t in grouped.items()})


#: A level, the cores other processes used, the load generator's cores, and
#: the server's CPU ticks per thread (with --trace).
Measured = tuple[Level, float, float, dict[int, int]]


def measure_level(
    server: str,
    target: Target,
    prompts: Iterator[str],
    concurrency: int,
    settings: Settings,
    pid: int,
) -> Measured:
    """One concurrency level on a quiet host; repeated while others were busy
    during it (the attempt with the least other load is kept). Returns the
    level, the cores others used, the cores the load generator used, and the
    server's CPU ticks per thread (with --trace)."""
    best: Measured | None = None
    for _ in range(settings.retries + 1):
        wait_quiet(settings.busy)
        before = thread_ticks(pid) if settings.trace else {}
        span = Span.start()
        level = asyncio.run(
            run_level(
                target,
                prompts,
                concurrency=concurrency,
                requests_per_client=settings.requests_per_client[concurrency],
                max_tokens=settings.max_tokens,
                stagger=settings.stagger,
            )
        )
        other = span.other_cores()
        after = thread_ticks(pid) if settings.trace else {}
        ticks = {tid: t - before.get(tid, 0) for tid, t in after.items()}
        print(f"  {server:>18} {progress_line(level, other)}", flush=True)
        if best is None or other < best[1]:
            best = (level, other, level.client_cpu, ticks)
        if other <= settings.busy:
            break
    assert best is not None
    return best


def warm_up_waves(highest: int) -> list[int]:
    """The warm-up's wave sizes: every power of two below ``highest``, then
    ``highest``. Each wave's streams start and end together, so it runs one
    batch size; a server with ``--compile on`` compiles each batch bucket on
    its first step (seconds to a minute), which must not land in a measured
    round (vLLM's server captures its batch sizes at start)."""
    waves = [1 << k for k in range(highest.bit_length()) if 1 << k < highest]
    return [*waves, highest]


async def warm_up(target: Target, prompts: Iterator[str], settings: Settings) -> None:
    """Short waves of every batch bucket up to the highest concurrency (first
    calls allocate caches, pick kernels and compile; the largest batch sizes
    them)."""
    for concurrency in warm_up_waves(max(settings.concurrency)):
        level = await run_level(
            target, prompts, concurrency=concurrency, requests_per_client=1, max_tokens=8
        )
        if level.errors:
            raise RuntimeError(f"warm-up failed: {level.first_errors(1)}")


def progress_line(level: Level, other: float) -> str:
    return (
        f"c={level.concurrency:<3} {level.throughput:8.1f} tok/s  decode {level.decode_throughput:8.1f}"
        f"  TTFT p50 {level.ttft(50) * 1e3:7.1f} ms  ITL p50 {level.itl(50) * 1e3:6.1f} ms"
        f"  errors {level.errors}  reconnects {level.retries}  other CPU {other:.2f}"
    )


# --- main ---------------------------------------------------------------------


def make_model(key: str, settings: Settings, prompts_needed: tuple[int, int]) -> Model:
    if key == "large":
        path = serving_model()
        params = parameter_count(json.loads((path / "config.json").read_text())["vocab_size"])
        label = f"{params / 1e6:.1f}M parameters, Qwen3 512x8, vocab 16384"
        text = synthetic_corpus(seed=1, lines=4000)
    else:
        path = default_model_dir()
        config = json.loads((path / "config.json").read_text())
        label = (
            f"the embedded default: Qwen3 {config['hidden_size']}x{config['num_hidden_layers']}, "
            f"vocab {config['vocab_size']}"
        )
        text = shipped_corpus()
    wanted, minimum = prompts_needed
    prompts = prompts_of_length(
        str(path / "tokenizer.json"), text, settings.prompt_tokens, wanted, minimum
    )
    return Model(key, path, label, tuple(prompts))


def rounds_at(settings: Settings, concurrency: int) -> int:
    """Paired rounds at ``concurrency`` (one at a level without a bare batch size)."""
    return settings.paired_rounds if concurrency in BARE_BATCHES else 1


def prompts_per_server(settings: Settings) -> tuple[int, int]:
    """Prompts wanted so that none repeats within one server's run, retries
    included; and the fewest that keep them from repeating when no level is
    retried (a model's text may yield fewer than wanted: the servers then
    cycle through them, and only retried levels see a prompt again)."""
    warm = 1 + max(settings.concurrency)
    measured = sum(
        c * settings.requests_per_client[c] * rounds_at(settings, c) for c in settings.concurrency
    )
    return warm + measured * (1 + settings.retries), warm + measured


def peer_setup(wanted: Sequence[str], args: argparse.Namespace) -> tuple[PeerSetup, dict[str, str]]:
    """vLLM's interpreter and llama.cpp's binaries for the ``wanted`` peers,
    and why a peer cannot run (by name; missing: it can)."""
    notes: dict[str, str] = {}
    vllm_python = args.vllm_python if Path(args.vllm_python).exists() else None
    for name in ("vllm", "vllm-eager-f32", "vllm-threads"):
        if name in wanted and vllm_python is None:
            notes[name] = f"no vLLM interpreter at {args.vllm_python} (--vllm-python)"
    llama_bin, version = None, ""
    if any(name.startswith("llama") for name in wanted):
        print("building llama.cpp (once; cached) ...", flush=True)
        try:
            llama_bin = llama_peer.build()
            version = llama_peer.version(llama_bin)
        except (subprocess.CalledProcessError, OSError) as error:
            for name in wanted:
                if name.startswith("llama"):
                    notes[name] = f"llama.cpp did not build: {error}"
    return PeerSetup(vllm_python, llama_bin, version), notes


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--engine",
        choices=["transformers", "mlx", "vllm", "both"],
        default="both",
        help="both: transformers and mlx; vllm: ours with --engine vllm against vLLM's own "
        "server, both from --vllm-python's environment",
    )
    parser.add_argument("--models", nargs="+", choices=["large", "tiny"], default=["large", "tiny"])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument(
        "--no-peers", action="store_true", help="only our server and the bare engine"
    )
    parser.add_argument(
        "--peers",
        nargs="+",
        choices=[*peers.ALL_PEERS, "mlx_lm.server"],
        default=None,
        help="the peers beside our transformers engine (default: "
        f"{' '.join(peers.DEFAULT_PEERS['transformers'])}); mlx's is mlx_lm.server",
    )
    parser.add_argument(
        "--vllm-python",
        default=os.environ.get("SLUICEWAY_VLLM_PYTHON", str(VLLM_PYTHON)),
        help="the interpreter of a vLLM environment, for vLLM's own server "
        "(default: $SLUICEWAY_VLLM_PYTHON, else .venv-vllm, which `make test-vllm` builds)",
    )
    parser.add_argument("--no-peer-setup", action="store_true", help="do not create the peer venv")
    parser.add_argument("--peers-venv", type=Path, default=PEERS_VENV)
    parser.add_argument("--no-openblas", action="store_true", help="mlx with its bundled BLAS")
    parser.add_argument("--worker-class", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument(
        "--busy",
        type=float,
        default=0.25,
        help="other processes' CPU (cores) above which a measurement waits and is repeated",
    )
    parser.add_argument("--retries", type=int, default=2, help="repeats of a busy measurement")
    parser.add_argument(
        "--paired-rounds",
        type=int,
        default=3,
        help="rounds of bare engine / our level / bare engine at concurrency 1, 4, 16, 64 "
        "(the median round is reported)",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="time our server's engine steps and CPU by thread (bench/trace_server.py)",
    )
    parser.add_argument(
        "--server-env",
        nargs="*",
        default=[],
        metavar="K=V",
        help="environment for our server only (the bare engine and peers do not get it)",
    )
    parser.add_argument(
        "--server-args",
        default="",
        metavar="'FLAGS'",
        help="extra flags for our server only, given with '=': --server-args='--engine-process'",
    )
    parser.add_argument(
        "--load",
        choices=sorted(LOADS),
        default="greedy",
        help="what every request asks for: greedy, sampled (temperature 1, seeded), "
        "or sampled with top-5 logprobs",
    )
    parser.add_argument(
        "--body", default="{}", metavar="JSON", help="more fields for every request (over --load's)"
    )
    parser.add_argument(
        "--keep-logs", action="store_true", help="keep each server's log (its path is noted)"
    )
    parser.add_argument(
        "--stagger",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="spread the clients' starts over this long, so that prompts arrive while "
        "other streams decode (default 0: a level's requests start and end together)",
    )
    parser.add_argument(
        "--bare-samples",
        action="store_true",
        help="the bare loop samples at temperature 1 (torch: inverse CDF; mlx: "
        "mx.random.categorical) instead of taking the argmax: the loop to compare a sampled "
        "--load with",
    )
    parser.add_argument(
        "--one-thread-bare",
        action="store_true",
        help="transformers: also measure a bare loop on one torch thread around each paired "
        "round, and report decode ÷ it (what the server costs on the threads the tuner "
        "gave its engine, where it gave one)",
    )
    parser.add_argument("--output", type=Path, default=HERE / "serve-results.md")
    args = parser.parse_args(argv)

    concurrency = tuple(sorted(set(args.concurrency)))
    per_client = {c: (1 if args.quick else REQUESTS_PER_CLIENT.get(c, 1)) for c in concurrency}
    settings = Settings(
        concurrency=concurrency,
        max_tokens=16 if args.quick else args.max_tokens,
        prompt_tokens=args.prompt_tokens,
        requests_per_client=per_client,
        bare_repeats=1 if args.quick else 2,
        openblas=None if args.no_openblas else find_openblas(),
        peers=not args.no_peers,
        worker_class=args.worker_class,
        busy=args.busy,
        retries=args.retries,
        trace=args.trace,
        server_env=tuple(tuple(item.split("=", 1)) for item in args.server_env),  # type: ignore[misc]
        server_args=tuple(shlex.split(args.server_args)),
        paired_rounds=1 if args.quick else max(1, args.paired_rounds),
        body=load_body(args.load, args.body),
        keep_logs=args.keep_logs,
        stagger=args.stagger,
        bare_samples=args.bare_samples,
        one_thread_bare=args.one_thread_bare,
    )
    engines = ["transformers", "mlx"] if args.engine == "both" else [args.engine]
    started = time.perf_counter()
    probes = 10 if args.quick else 30
    steady_before = steadiness(probes)
    load_before = os.getloadavg()
    print(f"host steadiness: {steady_before.line()}", flush=True)
    needed = prompts_per_server(settings)
    models = [make_model(key, settings, needed) for key in args.models]

    wanted = {
        "transformers": tuple(p for p in args.peers if p != "mlx_lm.server")
        if args.peers
        else peers.DEFAULT_PEERS["transformers"],
        "mlx": peers.DEFAULT_PEERS["mlx"],
        "vllm": tuple(p for p in args.peers or () if p.startswith("vllm"))
        or peers.DEFAULT_PEERS["vllm"],
    }
    needs = {p for engine in engines if settings.peers for p in wanted[engine]}
    setup, setup_notes = peer_setup((*needs, *(["vllm"] if "vllm" in engines else [])), args)
    if "vllm" in engines and setup.vllm_python is None:
        raise SystemExit(f"--engine vllm: {setup_notes['vllm']}")
    if "vllm" in engines and settings.trace:
        raise SystemExit("--trace times our own scheduler's steps: not with --engine vllm")
    peer_python, peer_note = None, ""
    if settings.peers and "transformers serve" in wanted["transformers"]:
        peer_python, peer_note = peers_python(args.peers_venv, not args.no_peer_setup)
        if peer_python is None:
            print(f"transformers serve will not run: {peer_note}", flush=True)
    mlx_note = (
        f"mlx runs with OpenBLAS preloaded ({settings.openblas})"
        if settings.openblas
        else "mlx runs with its bundled reference BLAS (slow on the CPU)"
    )
    print(mlx_note, flush=True)

    sections: list[Section] = []
    for engine in engines:
        for model in models:
            section = Section(engine, model)
            sections.append(section)
            print(f"\n== {engine} engine, {model.key} model ({model.label})", flush=True)
            bare = start_bare(section, settings)
            single = start_one_thread_bare(section, settings)
            names = [OURS, *(wanted[engine] if settings.peers else ())]
            setup_notes["transformers serve"] = peer_note
            servers = []
            for name in names:
                if setup_notes.get(name):
                    failure = f"not run: {setup_notes[name]}"
                    section.runs.append(ServerRun(peers.label(name), failure=failure))
                    continue
                servers.append(start_server(name, section, settings, peer_python, setup))
            try:
                for server in servers:
                    warm_up_server(server, settings)
                run_servers(servers, settings, bare, single)
            finally:
                for server in servers:
                    stop_server(server)
                    section.runs.append(server.run)
                for loop in (bare, single):
                    if loop is not None:
                        loop.close()

    elapsed = time.perf_counter() - started
    steady_after = steadiness(probes)
    load_after = os.getloadavg()
    header = (
        f"# sluiceway serving benchmark\n\n"
        f"{'Quick smoke run. ' if args.quick else ''}"
        f"Streaming `/v1/completions`, {describe_load(settings.body)}, "
        f"prompt {settings.prompt_tokens} tokens "
        f"(each request its own), max_tokens {settings.max_tokens} "
        f"(`ignore_eos` sent to every server that takes it: not to mlx_lm.server or "
        f"transformers serve, whose tokens are counted as received), concurrency {', '.join(map(str, concurrency))} with "
        f"{', '.join(f'{per_client[c]}' for c in concurrency)} requests per client per round"
        f"{f' (client starts spread over {settings.stagger:g} s)' if settings.stagger else ''}, "
        f"after a warm-up. Our levels at concurrency "
        f"{', '.join(str(c) for c in concurrency if c in BARE_BATCHES)} ran "
        f"{settings.paired_rounds} round(s) each, taking turns with the peers (bare engine, "
        f"our level, bare engine, each peer's level); shown: our round with the median "
        f"decode ÷ bare, a peer's with the median tok/s; ours ÷ a peer's is the median "
        f"of the per-round ratios. "
        f"Host: {os.cpu_count()} CPUs; {mlx_note}; Hypercorn worker "
        f"{settings.worker_class}. Run took {elapsed / 60:.1f} min, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average (1, 5, 15 min) "
        f"{' '.join(f'{x:.1f}' for x in load_before)} at the start, "
        f"{' '.join(f'{x:.1f}' for x in load_after)} at the end. Command: "
        f"`bench/serve.py {shlex.join(sys.argv[1:] if argv is None else argv)}`. "
        f"Host steadiness (nothing else of ours running): at the start, "
        f"{steady_before.line()}; at the end, {steady_after.line()}."
    )
    if settings.trace and "--engine-process" not in settings.server_args:
        header += (
            " Traced: our engine ran on the server's engine thread, not its default child process."
        )
    if settings.server_args or settings.server_env:
        extra = [*settings.server_args, *(f"{k}={v}" for k, v in settings.server_env)]
        header += f" Our server ran with `{' '.join(extra)}`."
    text = render(sections, settings, header)
    print("\n" + text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
