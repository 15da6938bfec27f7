"""Shutdown and engine loss, end to end: SIGTERM drains (503s in the
surface's shape, running streams finish or end with an error event and
``[DONE]``, exit 0, no traceback); a killed engine process is restarted,
with 503s and never a hang meanwhile."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.harness import start_server
from tests.e2e.ops import Stream, chat, engine_child, wait_for

pytestmark = pytest.mark.e2e

GRACE = 4.0


@pytest.mark.parametrize("worker_class", ["asyncio", "trio"])
def test_sigterm_drains_then_ends_what_runs_with_an_error_event(
    worker_class: str, default_model: Path, tmp_path: Path
) -> None:
    server = start_server(
        default_model,
        worker_class=worker_class,
        log_dir=tmp_path,
        extra_args=["--engine", "transformers", "--shutdown-timeout", str(GRACE)],
    )
    try:
        endless = Stream(server, chat(server, max_tokens=100_000, ignore_eos=True)).start()
        assert endless.first.wait(60)
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        # Still listening while it drains: not ready, and new work is refused
        # in the OpenAI shape with a Retry-After.
        wait_for(
            lambda: httpx.get(server.base_url + "/ready", timeout=5).status_code == 503,
            2,
            "/ready to say 503",
        )
        refused = httpx.post(server.api_url + "/chat/completions", json=chat(server), timeout=10)
        assert refused.status_code == 503
        assert refused.json()["error"]["type"] == "server_error"
        assert refused.headers["retry-after"] == "1"
        short = Stream(server, chat(server, max_tokens=10)).start().wait(10)
        assert short.status == 503
        endless.wait(GRACE + 10)
        ended = time.monotonic() - signalled
        assert endless.failed_with_event == "the server is shutting down", endless.lines[-3:]
        assert GRACE - 0.5 < ended < GRACE + 6
        assert server.process.wait(20) == 0
    finally:
        server.stop()
    log = server.log()
    assert "Traceback" not in log, log
    assert "draining: 1 request(s) running" in log


def test_sigterm_lets_a_stream_that_ends_in_time_finish(
    default_model: Path, tmp_path: Path
) -> None:
    server = start_server(
        default_model,
        worker_class="asyncio",
        log_dir=tmp_path,
        extra_args=["--engine", "transformers", "--shutdown-timeout", "30"],
    )
    try:
        stream = Stream(server, chat(server, max_tokens=300, ignore_eos=True)).start()
        assert stream.first.wait(60)
        server.process.send_signal(signal.SIGTERM)
        assert stream.wait(30).ended_well
        assert len(stream.chunks) > 250
        # Nothing left to wait for: it exits well before the grace period ends.
        assert server.process.wait(15) == 0
    finally:
        server.stop()
    assert "Traceback" not in server.log()


def test_a_killed_engine_process_is_restarted(default_model: Path, tmp_path: Path) -> None:
    server = start_server(
        default_model,
        worker_class="asyncio",
        log_dir=tmp_path,
        extra_args=["--engine", "transformers", "--engine-process"],
    )
    try:
        stream = Stream(server, chat(server, max_tokens=100_000, ignore_eos=True)).start()
        assert stream.first.wait(60)
        os.kill(engine_child(server), signal.SIGKILL)
        stream.wait(10)
        assert stream.failed_with_event is not None, stream.lines[-3:]
        # While it restarts: 503s, promptly, in the surface's shape.
        wait_for(
            lambda: httpx.get(server.base_url + "/health", timeout=5).status_code == 503,
            5,
            "/health to say 503",
        )
        assert httpx.get(server.base_url + "/ready", timeout=5).status_code == 503
        started = time.monotonic()
        refused = httpx.post(server.api_url + "/chat/completions", json=chat(server), timeout=10)
        assert time.monotonic() - started < 2
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "unavailable"
        # Then it is back, and serves.
        wait_for(
            lambda: httpx.get(server.base_url + "/health", timeout=5).status_code == 200,
            120,
            "the engine to come back",
        )
        again = httpx.post(server.api_url + "/chat/completions", json=chat(server), timeout=60)
        assert again.status_code == 200, again.text
        assert again.json()["usage"]["completion_tokens"] == 20
    finally:
        server.stop()
    assert "restarting it (attempt 1 of 3)" in server.log()
