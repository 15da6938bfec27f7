"""A replica drained behind Shepherd Model Gateway (``smg launch``), end to
end: two replicas, streaming load through smg, SIGTERM to one of them. No
client sees an error or a cut stream (smg retries the draining replica's 503
on the other), and with its health checks on ``/ready`` smg stops sending to
the draining replica once a probe has failed. The test prints the figures
docs/deployment.md quotes, from the draining replica's access log: the
requests it refused (each one retried by smg) and when, and when smg's
probes of ``/ready`` failed; under smg's defaults (``/health`` every 60 s)
too."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.e2e.harness import RunningServer, free_port, start_server
from tests.e2e.ops import Stream, chat, wait_for
from tests.e2e.test_scale_out import SMG

pytestmark = pytest.mark.e2e

#: Long enough that the draining replica still listens (and reports its
#: refusals) for the whole measurement: a stream sent to it directly keeps
#: it draining.
GRACE = 30
CLIENTS = 8
#: How long the load goes on after the signal.
AFTER_SIGNAL = 8.0


@dataclass
class Load:
    """Streaming clients through the gateway, each one request after another."""

    gateway: str
    model: str
    ok: int = 0
    bad: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Load:
        for _ in range(CLIENTS):
            thread = threading.Thread(target=self._client, daemon=True)
            thread.start()
            self.threads.append(thread)
        return self

    def _client(self) -> None:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": "drain"}],
            "max_tokens": 4,
            "temperature": 0,
            "stream": True,
        }
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                try:
                    self._one(client, body)
                except httpx.HTTPError as error:
                    self.bad.append(f"{type(error).__name__}: {error}")

    def _one(self, client: httpx.Client, body: dict[str, object]) -> None:
        lines = []
        with client.stream("POST", self.gateway + "/v1/chat/completions", json=body) as reply:
            status = reply.status_code
            lines = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
        chunks = [json.loads(line) for line in lines if line != "[DONE]"]
        reasons = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
        if status != 200 or not lines or lines[-1] != "[DONE]" or not reasons or not reasons[-1]:
            self.bad.append(f"status {status}, ended with {lines[-2:]}")
        elif any("error" in c for c in chunks):
            self.bad.append(f"an error event: {lines[-2:]}")
        else:
            self.ok += 1

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(120)


def refusals(server: RunningServer) -> list[float]:
    """When the replica refused a chat request (503), in seconds after it
    logged the SIGTERM, from its access log."""
    return _after_signal(server, r'"POST /v1/chat/completions" 503')


def _after_signal(server: RunningServer, pattern: str) -> list[float]:
    stamp = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) "
    log = server.log()
    signalled = re.search(stamp + r".*SIGTERM received", log, re.M)
    if signalled is None:
        return []
    start = _seconds(signalled.group(1))
    return [_seconds(at) - start for at in re.findall(stamp + ".*" + pattern, log, re.M)]


def _seconds(stamp: str) -> float:
    clock, millis = stamp.split(" ")[1].split(",")
    hours, minutes, seconds = (int(part) for part in clock.split(":"))
    return hours * 3600 + minutes * 60 + seconds + int(millis) / 1000


@pytest.fixture
def replicas(default_model: Path, tmp_path: Path) -> Iterator[list[RunningServer]]:
    servers = [
        start_server(
            default_model,
            worker_class="asyncio",
            log_dir=tmp_path,
            extra_args=[
                "--engine",
                "transformers",
                "--no-engine-process",
                "--shutdown-timeout",
                str(GRACE),
            ],
        )
        for _ in range(2)
    ]
    yield servers
    for server in servers:
        server.stop()


#: smg's health checks: on /ready every second, one failure enough
#: (docs/deployment.md's advice), or smg's defaults (/health every 60 s).
PROBES = {
    "ready": (
        *("--health-check-endpoint", "/ready", "--health-check-interval-secs", "1"),
        *("--health-failure-threshold", "1"),
    ),
    "defaults": (),
}


@pytest.fixture(params=sorted(PROBES))
def gateway(
    replicas: list[RunningServer], tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[str, str]]:
    """smg in front of both replicas, round robin so that both take requests."""
    port = free_port()
    log = (tmp_path / "smg.log").open("wb")
    command = [
        *(str(SMG), "launch", "--port", str(port), "--policy", "round_robin"),
        *("--prometheus-port", str(free_port())),
        *PROBES[request.param],
        *("--worker-urls", *(server.base_url for server in replicas)),
    ]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def both_healthy() -> bool:
        try:
            workers = httpx.get(url + "/workers", timeout=5).json()["workers"]
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        return len(workers) == 2 and all(w["is_healthy"] for w in workers)

    try:
        wait_for(both_healthy, 60, "smg to take both workers")
        yield url, request.param
    finally:
        process.terminate()
        process.wait(10)
        log.close()


def test_a_replica_drained_behind_smg_costs_no_client_an_error(
    gateway: tuple[str, str], replicas: list[RunningServer]
) -> None:
    url, probe = gateway
    draining, other = replicas
    # Keeps the draining replica alive (and logging its refusals) through
    # the measurement; sent to it directly, so no client of smg's.
    anchor = Stream(draining, chat(draining, max_tokens=100_000, ignore_eos=True)).start()
    assert anchor.first.wait(60)
    load = Load(url, draining.model).start()
    try:
        wait_for(lambda: load.ok >= 2 * CLIENTS, 120, "the load to get going")
        draining.process.send_signal(signal.SIGTERM)
        served_before = load.ok
        time.sleep(AFTER_SIGNAL)
        refused = refusals(draining)
        time.sleep(1.0)
        late = refusals(draining)[len(refused) :]
    finally:
        load.finish()
    assert load.bad == [], load.bad[:5]
    assert load.ok > served_before, "nothing was served after the signal"
    assert other.process.poll() is None
    unready = probes_failed(draining)
    print(
        f"\nsmg drain ({probe}): {len(refused) + len(late)} requests refused by the draining"
        f" replica and retried by smg (at {_list(refused + late)} s after SIGTERM);"
        f" its /ready probes failed at {_list(unready[:3])} s; {load.ok} streams ended well"
    )
    if probe == "ready":
        # smg probes /ready once a second and takes one failure: once a probe
        # has failed, and smg had a second to see it, nothing more comes.
        assert len(unready) >= 2, "smg does not probe /ready"
        assert all(at < unready[1] for at in refused + late), "smg kept picking it"


def probes_failed(server: RunningServer) -> list[float]:
    """When smg's /ready probes of the replica got 503, after the SIGTERM."""
    return _after_signal(server, r'"GET /ready" 503')


def _list(seconds: list[float]) -> str:
    return ", ".join(f"{at:.2f}" for at in seconds) or "-"
