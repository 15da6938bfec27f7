"""Two replicas behind Shepherd Model Gateway (``smg launch --policy
cache_aware``, the Rust binary of the ``smg`` wheel): it identifies both
workers (model, context length) and reads their load from ``/v1/loads``;
requests pass through; two families of requests with different long shared
prefixes settle on different replicas (visible in each one's /metrics)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.harness import RunningServer, free_port, start_server
from tests.e2e.ops import wait_for

pytestmark = pytest.mark.e2e

SMG = Path(sys.executable).parent / "smg"


@pytest.fixture(scope="module")
def replicas(
    default_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[RunningServer]]:
    logs = tmp_path_factory.mktemp("replicas")
    servers = [
        start_server(
            default_model,
            worker_class="asyncio",
            log_dir=logs,
            extra_args=["--engine", "transformers"],
        )
        for _ in range(2)
    ]
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def gateway(
    replicas: list[RunningServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    if not SMG.exists() and shutil.which("smg") is None:
        pytest.fail("smg is in the test extra and should be installed")
    port = free_port()
    log = (tmp_path_factory.mktemp("smg") / "smg.log").open("wb")
    command = [str(SMG), "launch", "--port", str(port), "--policy", "cache_aware"]
    process = subprocess.Popen(
        [*command, "--prometheus-port", str(free_port()), "--worker-urls"]
        + [server.base_url for server in replicas],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def both_ready() -> bool:
        try:
            workers = httpx.get(url + "/workers", timeout=5).json()["workers"]
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        return len(workers) == 2 and all(w["is_healthy"] and "engine_load" in w for w in workers)

    try:
        wait_for(both_ready, 60, "smg to take both workers and read their load")
        yield url
    finally:
        process.terminate()
        process.wait(10)
        log.close()


def test_smg_identifies_both_workers_and_reads_their_load(
    gateway: str, replicas: list[RunningServer]
) -> None:
    workers = httpx.get(gateway + "/workers", timeout=10).json()["workers"]
    assert sorted(w["url"] for w in workers) == sorted(r.base_url for r in replicas)
    for worker in workers:
        assert worker["models"][0]["context_length"] > 0
        assert worker["labels"]["version"]
        load = worker["engine_load"]["loads"][0]
        assert load["max_running_requests"] == 32
        assert load["max_total_num_tokens"] > 0


def family(name: str, question: int, model: str) -> dict[str, object]:
    prefix = f"{name} family shared document. " * 120
    return {
        "model": model,
        "messages": [{"role": "user", "content": f"{prefix} question {question}"}],
        "max_tokens": 2,
    }


def hits(server: RunningServer) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    found = re.search(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)", text, re.M)
    return float(found.group(1)) if found else 0.0


def chats(server: RunningServer) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    found = re.search(
        r'^sluiceway:http_requests_total\{route="/v1/chat/completions",status="200"[^}]*\} (\S+)',
        text,
        re.M,
    )
    return float(found.group(1)) if found else 0.0


def test_requests_pass_and_prefix_families_settle_on_different_replicas(
    gateway: str, replicas: list[RunningServer]
) -> None:
    model = replicas[0].model
    completion = httpx.post(
        gateway + "/v1/completions",
        json={"model": model, "prompt": "hello", "max_tokens": 2},
        timeout=60,
    )
    assert completion.status_code == 200, completion.text
    before = [chats(r) for r in replicas]
    for name in ("alpha", "beta"):
        for question in range(3):
            reply = httpx.post(
                gateway + "/v1/chat/completions", json=family(name, question, model), timeout=60
            )
            assert reply.status_code == 200, reply.text
    served = [chats(r) - b for r, b in zip(replicas, before, strict=True)]
    # Each family's three requests went to one replica, and not the same one.
    assert sorted(served) == [3, 3], served
    assert all(hits(r) > 0 for r in replicas)
