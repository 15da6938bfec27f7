"""Starting the real server (``sluiceway serve`` under Hypercorn) on 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

STARTUP_SECONDS = 180


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

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"

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
    launcher: Sequence[str] = (sys.executable, "-m", "sluiceway"),
) -> RunningServer:
    """Start ``sluiceway serve`` (through ``launcher``, a command that takes the
    CLI's arguments); or, with ``through_hypercorn_cli``, the ``hypercorn``
    command on the app factory configured by environment."""
    port = free_port()
    log_path = log_dir / f"server-{worker_class}-{port}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
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
    engine = command[command.index("--engine") + 1] if "--engine" in command else "auto"
    server = RunningServer(
        f"http://127.0.0.1:{port}", name, worker_class, process, log_path, engine
    )
    deadline = time.monotonic() + STARTUP_SECONDS
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
    raise RuntimeError(f"the server did not start in {STARTUP_SECONDS} s:\n{server.log()}")


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
