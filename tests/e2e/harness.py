"""Starting the real server (``sluiceway serve`` under Hypercorn) on 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

STARTUP_SECONDS = 180
#: vLLM's engine core starts in ~1 min alone on a 2-core host, more under load.
VLLM_STARTUP_SECONDS = 600

#: ``--engine vllm`` (``SLUICEWAY_TEST_SETUPS=vllm``, ``make test-vllm``):
#: float32 as the reference forward passes (vLLM's auto serves a float32
#: checkpoint in bfloat16 on a CPU), and no compilation (it only lengthens
#: the start); its CPU backend needs a KV-cache size and no thread binding
#: on a small shared host. Its request log says when it aborts a request,
#: which tests/e2e/test_vllm.py counts on the shared server.
VLLM_FLAGS = (
    "--enforce-eager",
    "--dtype",
    "float32",
    "--vllm-engine-args",
    '{"enable_log_requests": true}',
)
#: What a transformers test server runs with unless its test gives a --dtype
#: (mlx takes the checkpoint's, float32 here, and warns about the flag).
EXACT_FLAGS = ("--dtype", "float32")
VLLM_ENVIRONMENT = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
#: vLLM's imports warn of deprecations of their own dependencies, which the
#: -W error of SERVER_COMMAND would turn into a failed start.
VLLM_COMMAND = (sys.executable, "-m", "sluiceway")

#: The server as the tests start it: deprecations are errors there too, as in
#: the suite itself, so that a registry release deprecating an API we call
#: fails here (start-up or the request that makes the call) and not silently.
SERVER_COMMAND = (
    sys.executable,
    "-W",
    "error::DeprecationWarning",
    "-W",
    "error::FutureWarning",
    "-m",
    "sluiceway",
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class RunningServer:
    base_url: str
    model: str
    worker_class: str
    process: subprocess.Popen[bytes]
    log_path: Path
    engine: str = "auto"
    #: The server's --api-key, which the helpers below then send.
    api_key: str | None = None
    #: Fields that make the pace stream (seconds_per_token) write text: a
    #: scripted model needs its script chosen.
    pace_fields: dict[str, object] = field(default_factory=dict)

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"

    @property
    def auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> dict[str, object]:
        response = httpx.get(self.base_url + "/health", timeout=10)
        response.raise_for_status()
        body: dict[str, object] = response.json()
        return body

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_server(
    model: Path,
    *,
    worker_class: str,
    log_dir: Path,
    name: str = "test-model",
    extra_args: Sequence[str] = (),
    through_hypercorn_cli: bool = False,
    launcher: Sequence[str] = SERVER_COMMAND,
) -> RunningServer:
    """Start ``sluiceway serve`` (through ``launcher``, a command that takes the
    CLI's arguments); or, with ``through_hypercorn_cli``, the ``hypercorn``
    command on the app factory configured by environment."""
    port = free_port()
    log_path = log_dir / f"server-{worker_class}-{port}.log"
    # The tests compare logprobs with a float32 forward: float32 unless a test
    # says otherwise, since --dtype auto is bfloat16 on a CPU with AVX512-BF16
    # or AMX (the environment variable for the app factory, the flag for
    # `sluiceway serve`).
    # Eager unless a test asks: --compile auto (the default) would time and
    # compile the decode step at every start, seconds to minutes of CPU that
    # the suite's servers cannot spare (tests/engines covers the compiled step).
    env = {
        "SLUICEWAY_DTYPE": "float32",
        "SLUICEWAY_COMPILE": "off",
        **os.environ,
        "PYTHONUNBUFFERED": "1",
    }
    if not any(a.startswith("--compile") for a in extra_args):
        extra_args = (*extra_args, "--compile", "off")
    if _engine_of(extra_args) == "vllm":
        env = {**VLLM_ENVIRONMENT, **env}
        extra_args = (*extra_args, *VLLM_FLAGS)
        launcher = VLLM_COMMAND if launcher == SERVER_COMMAND else launcher
    elif _engine_of(extra_args) != "mlx" and not any(a.startswith("--dtype") for a in extra_args):
        extra_args = (*extra_args, *EXACT_FLAGS)
    if through_hypercorn_cli:
        command = [
            str(Path(sys.executable).parent / "hypercorn"),
            "sluiceway.server:create_app()",
            "--bind",
            f"127.0.0.1:{port}",
            "--worker-class",
            worker_class,
        ]
        env |= {"SLUICEWAY_MODEL": str(model), "SLUICEWAY_SERVED_MODEL_NAME": name}
        return _wait_for(command, env, port, name, worker_class, log_path)
    command = [
        *launcher,
        "serve",
        "--model",
        str(model),
        "--served-model-name",
        name,
        "--port",
        str(port),
        "--worker-class",
        worker_class,
        *extra_args,
    ]
    return _wait_for(command, env, port, name, worker_class, log_path)


def _wait_for(
    command: list[str],
    env: dict[str, str],
    port: int,
    name: str,
    worker_class: str,
    log_path: Path,
) -> RunningServer:
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    engine = _engine_of(command)
    server = RunningServer(
        f"http://127.0.0.1:{port}", name, worker_class, process, log_path, engine
    )
    deadline = time.monotonic() + (VLLM_STARTUP_SECONDS if engine == "vllm" else STARTUP_SECONDS)
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited during start-up:\n{server.log()}")
        try:
            if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"the server did not start in time:\n{server.log()}")


def _engine_of(arguments: Sequence[str]) -> str:
    return arguments[list(arguments).index("--engine") + 1] if "--engine" in arguments else "auto"


@contextlib.contextmanager
def serving(
    model: Path, log_dir: Path, *extra_args: str, worker_class: str = "asyncio"
) -> Iterator[RunningServer]:
    """A server with extra flags, stopped on exit (for module-scoped fixtures)."""
    running = start_server(model, worker_class=worker_class, log_dir=log_dir, extra_args=extra_args)
    try:
        yield running
    finally:
        running.stop()


#: Where the SSE specification ends a line: CRLF, CR or LF, and nowhere else.
_SSE_EOL = re.compile(r"\r\n|\r|\n")


def sse_lines(stream: str | bytes) -> list[str]:
    """An event stream's lines, cut where the SSE specification cuts them.
    ``str.splitlines()`` also cuts at U+2028, U+2029, U+0085 and the
    separators U+001C-U+001E; JSON escapes the last three but not the first
    three, so a streamed token holding one (a model may write any of them)
    would split its ``data:`` line in two."""
    text = stream.decode("utf-8") if isinstance(stream, bytes) else stream
    return _SSE_EOL.split(text)


class ServerPool:
    """Servers started when first asked for and kept until :meth:`close`, one
    per configuration: the modules that ask for the same model, worker class,
    name and flags share it. A start costs seconds (an mlx engine in its child
    process about 15 on a loaded 2-core host), and pytest keeps only one
    parameter of a parametrized session fixture alive at a time, so modules
    that alternate setups used to start the same servers again and again.

    A shared server sees the requests of every module before it: a test on one
    reads deltas or its own prompts, never counters it assumes start at zero
    (a test that needs a fresh server starts its own)."""

    def __init__(self, log_dir: Path) -> None:
        self._log_dir = log_dir
        self._started: dict[tuple[str, ...], RunningServer] = {}

    def get(
        self,
        model: Path,
        *,
        worker_class: str,
        name: str = "test-model",
        extra_args: Sequence[str] = (),
    ) -> RunningServer:
        key = (str(model), worker_class, name, *extra_args)
        running = self._started.get(key)
        if running is None:
            running = start_server(
                model,
                worker_class=worker_class,
                log_dir=self._log_dir,
                name=name,
                extra_args=extra_args,
            )
            self._started[key] = running
        elif running.process.poll() is not None:
            # Not replaced: a crash is a fault to see, not to start over from.
            raise RuntimeError(f"the shared server exited earlier:\n{running.log()}")
        return running

    def close(self) -> None:
        for running in self._started.values():
            running.stop()
        self._started.clear()


#: Per engine, the flags of the placement its default is not: on the CPU
#: both engines run in a child process by default, so the other placement
#: is the engine thread. The modules that ask for it share the server.
OTHER_PLACEMENT = {
    "transformers": ("--no-engine-process",),
    "mlx": ("--no-engine-process",),
}

#: Streamed tokens timed to learn a server's decode pace.
PACE_TOKENS = 200
_paces: dict[str, float] = {}


def seconds_per_token(server: RunningServer) -> float:
    """How long the server takes per token of one lone greedy stream (timed
    once per server), so that a test can tell "stopped at once" from "ran to
    the end" on any machine."""
    if server.base_url not in _paces:
        body = {
            "model": server.model,
            "messages": [{"role": "user", "content": "pace"}],
            "max_tokens": PACE_TOKENS + 1,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            **server.pace_fields,
        }
        stamps: list[float] = []
        with (
            httpx.Client(timeout=120) as client,
            client.stream(
                "POST", server.base_url + "/v1/chat/completions", json=body, headers=server.auth
            ) as reply,
        ):
            for line in reply.iter_lines():
                if line.startswith("data: {") and '"content":' in line:
                    stamps.append(time.monotonic())
        assert len(stamps) > PACE_TOKENS // 2, "the pace stream produced too few chunks"
        _paces[server.base_url] = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    return _paces[server.base_url]


def scheduler_state(server: RunningServer) -> dict[str, int]:
    state: dict[str, int] = server.health()["scheduler"]  # type: ignore[assignment]
    return state


def context_room(server: RunningServer, prompt: int = 64) -> int:
    """Tokens a request with a prompt of at most ``prompt`` tokens may
    generate: leaving out ``max_tokens`` asks for all of them."""
    reply = httpx.get(f"{server.api_url}/models/{server.model}", headers=server.auth, timeout=10)
    return int(reply.json()["max_model_len"]) - prompt


def assert_freed_promptly(server: RunningServer, left: int, since: float) -> float:
    """Wait until no request runs, and check that this came far sooner than
    generating the ``left`` tokens the abandoned request still had would
    take: a server that ignored the disconnect and ran to ``max_tokens``
    fails. Returns the seconds it took."""
    would_take = left * seconds_per_token(server)
    deadline = since + max(would_take * 1.5, 5.0)
    while True:
        state = scheduler_state(server)
        if state["running_requests"] == 0 and state["running_sequences"] == 0:
            break
        assert time.monotonic() < deadline, f"still running: {state}"
        time.sleep(0.02)
    took = time.monotonic() - since
    assert took < 0.25 * would_take, (
        f"freed after {took:.2f} s; generating the {left} tokens left takes ~{would_take:.2f} s"
    )
    return took


def same_entries(left: list[dict[str, Any]], right: list[dict[str, Any]]) -> bool:
    """Logprob entries of two requests alike: tokens, bytes and alternatives
    exactly, logprobs within 1e-4 (docs/architecture.md, "Exactness"). The
    second request restores the prompt from the prefix cache, and the
    engine's thread count may change between the two (the tuner times both),
    so their sums can round apart in float32's last bits."""

    def shape(entries: list[dict[str, Any]]) -> list[Any]:
        return [
            (e["token"], e["bytes"], [(t["token"], t["bytes"]) for t in e["top_logprobs"]])
            for e in entries
        ]

    def numbers(entries: list[dict[str, Any]]) -> list[float]:
        return [
            x for e in entries for x in (e["logprob"], *(t["logprob"] for t in e["top_logprobs"]))
        ]

    return shape(left) == shape(right) and numbers(left) == pytest.approx(numbers(right), abs=1e-4)
