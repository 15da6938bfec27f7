"""``--engine vllm`` end to end, beside the shared suites that run on it
(``make test-vllm``: SLUICEWAY_TEST_SETUPS=vllm): what is vLLM's own here —
its figures on /metrics and /health, its prefix cache as ``cached_tokens``,
the fields it cannot honour refused by name, a stop string or a client that
goes away aborting its vLLM request, and its engine core dying mid-stream.

On the default model's shared vLLM server (the ``server`` fixture's, started
once for every module of the run; a start costs minutes here). The harness
turns vLLM's request log on for every vLLM server: it says when a request is
aborted. The engine core is killed last in the module, and the test waits
until it serves again, so the modules after it find the server whole."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import ON_VLLM, default_args
from tests.e2e.harness import RunningServer, ServerPool
from tests.e2e.ops import SilentReader, Stream, chat, child_running, children, load, wait_for
from tests.e2e.test_operations import dechunk, texts_of

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not ON_VLLM, reason="vLLM runs in .venv-vllm: make test-vllm"),
]


@pytest.fixture(scope="module")
def vllm_server(default_model: Path, servers: ServerPool) -> RunningServer:
    """The ``server`` fixture's vLLM server, without its parameters: under
    ``make test`` this module is skipped once per test, not once per setup."""
    return servers.get(default_model, worker_class="asyncio", extra_args=default_args("vllm"))


def metric(server: RunningServer, name: str) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    found = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert found, f"{name} missing from /metrics"
    return float(found.group(1))


def aborts(server: RunningServer) -> int:
    return server.log().count("Aborted request(s)")


def endless(server: RunningServer) -> Stream:
    return Stream(server, chat(server, max_tokens=100_000, ignore_eos=True)).start()


@contextlib.contextmanager
def streaming(server: RunningServer) -> Iterator[None]:
    """An endless stream, its first event read; leaving disconnects it."""
    body = chat(server, max_tokens=100_000, ignore_eos=True, stream=True)
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", server.api_url + "/chat/completions", json=body) as reply,
    ):
        assert reply.status_code == 200
        # Kept: a line iterator dropped half-read closes the connection.
        lines = reply.iter_lines()
        next(lines)
        yield


def test_health_names_the_engine(vllm_server: RunningServer) -> None:
    health = vllm_server.health()
    assert health["engine"]["name"] == "vllm"  # type: ignore[index]


def test_the_gauges_read_vllms_figures(vllm_server: RunningServer) -> None:
    with streaming(vllm_server):
        # vLLM's stats come with its steps: running, and its KV cache in use.
        wait_for(
            lambda: (
                metric(vllm_server, "sluiceway:num_sequences_running") == 1
                and metric(vllm_server, "vllm:kv_cache_usage_perc") > 0
            ),
            30,
            "vLLM's figures",
        )
        assert metric(vllm_server, "vllm:num_requests_running") == 1
        loads = httpx.get(vllm_server.base_url + "/v1/loads", timeout=10)
        assert loads.status_code == 200, loads.text
    wait_for(
        lambda: metric(vllm_server, "vllm:num_requests_running") == 0,
        30,
        "nothing running once the client left",
    )


def test_a_client_that_goes_away_aborts_its_vllm_request(vllm_server: RunningServer) -> None:
    before = aborts(vllm_server)
    with streaming(vllm_server):
        with streaming(vllm_server):
            wait_for(
                lambda: metric(vllm_server, "sluiceway:num_sequences_running") == 2,
                30,
                "both sequences running in vLLM",
            )
        # One client went away: vLLM's own count (its stats come with the
        # steps of the stream still running) drops to one.
        wait_for(
            lambda: metric(vllm_server, "sluiceway:num_sequences_running") == 1,
            30,
            "vLLM to drop the aborted sequence",
        )
        assert aborts(vllm_server) > before
    wait_for(lambda: aborts(vllm_server) > before + 1, 30, "the second abort")
    assert metric(vllm_server, "vllm:num_requests_running") == 0


def test_a_stop_string_aborts_the_vllm_request(vllm_server: RunningServer) -> None:
    greedy = chat(vllm_server, max_tokens=40, ignore_eos=True)
    text = httpx.post(vllm_server.api_url + "/chat/completions", json=greedy, timeout=60).json()[
        "choices"
    ][0]["message"]["content"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    before = aborts(vllm_server)
    stopped = httpx.post(
        vllm_server.api_url + "/chat/completions", json={**greedy, "stop": [stop]}, timeout=60
    ).json()
    choice = stopped["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == text[: text.index(stop)]
    wait_for(lambda: aborts(vllm_server) > before, 10, "vLLM's abort")


def test_a_stalled_reader_pauses_and_its_stream_resumes_whole(vllm_server: RunningServer) -> None:
    """A reader that stops reading: once its mailbox fills, its request stops
    taking vLLM's outputs (vLLM merges them meanwhile) and counts as paused;
    read again, its stream carries every token, in order: the greedy text of
    the same request unpaused."""
    body = chat(vllm_server, max_tokens=300, ignore_eos=True, logprobs=True, top_logprobs=20)
    reader = SilentReader(vllm_server, body)
    try:
        wait_for(lambda: load(vllm_server)["paused_requests"] == 1, 120, "the request to pause")
        got = texts_of(dechunk(reader.read_all(120)))
    finally:
        reader.close()
    whole = {k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs")}
    reply = httpx.post(vllm_server.api_url + "/chat/completions", json=whole, timeout=120).json()
    assert got == {0: reply["choices"][0]["message"]["content"]}


def test_its_prefix_cache_shows_as_cached_tokens(vllm_server: RunningServer) -> None:
    hits = metric(vllm_server, "vllm:prefix_cache_hits_total")
    queued = metric(vllm_server, "vllm:request_queue_time_seconds_count")
    long = [{"role": "user", "content": "tell me a story about rivers and sluices " * 12}]
    first = httpx.post(
        vllm_server.api_url + "/chat/completions",
        json=chat(vllm_server, messages=long, max_tokens=2),
        timeout=60,
    ).json()
    again = httpx.post(
        vllm_server.api_url + "/chat/completions",
        json=chat(vllm_server, messages=long, max_tokens=2),
        timeout=60,
    ).json()
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < again["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens"] == again["usage"]["prompt_tokens"]
    # vLLM's own figures, summed from its steps (which may come after the
    # reply): the reuse in its prefix-cache counter, both requests' queue times.
    wait_for(
        lambda: (
            metric(vllm_server, "vllm:prefix_cache_hits_total") >= hits + cached
            and metric(vllm_server, "vllm:request_queue_time_seconds_count") >= queued + 2
        ),
        30,
        "vLLM's prefix-cache and queue-time figures on /metrics",
    )


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logprobs": True, "top_logprobs": 2, "logprob_token_ids": [5]}, "logprob_token_ids"),
        ({"logprobs": True, "response_format": {"type": "json_object"}}, "logprobs"),
    ],
)
def test_what_vllm_cannot_honour_is_a_400_naming_it(
    vllm_server: RunningServer, fields: dict[str, object], param: str
) -> None:
    reply = httpx.post(
        vllm_server.api_url + "/chat/completions", json=chat(vllm_server, **fields), timeout=60
    )
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def engine_core(server: RunningServer) -> int:
    return child_running(server, b"EngineCore", "vLLM engine core process")


def test_vllms_cpu_workers_leave_a_core_free(vllm_server: RunningServer) -> None:
    """With ``nobind`` (the harness's setting, as a small host needs) vLLM
    sets no thread count; ours gives its worker the cores but one, and says so."""
    expected = max(1, len(os.sched_getaffinity(0)) - 1)
    core = engine_core(vllm_server)
    workers = [
        pid for pid in children(core) if b"Worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert workers, "the engine core has no worker process"
    environ = Path(f"/proc/{workers[0]}/environ").read_bytes().split(b"\0")
    assert f"OMP_NUM_THREADS={expected}".encode() in environ
    info = httpx.get(vllm_server.base_url + "/server_info", timeout=10).json()
    assert info["engine_threads"] == expected


def test_the_engine_core_killed_mid_stream(vllm_server: RunningServer) -> None:
    """Last in the module: the engine core dies, every stream ends with an
    error event, new requests get 503 while a new engine starts, then it serves."""
    stream = endless(vllm_server)
    assert stream.first.wait(60)
    os.kill(engine_core(vllm_server), signal.SIGKILL)
    stream.wait(60)
    assert stream.failed_with_event is not None, stream.lines[-3:]
    wait_for(
        lambda: httpx.get(vllm_server.base_url + "/health", timeout=5).status_code == 503,
        10,
        "/health to say 503",
    )
    started = time.monotonic()
    refused = httpx.post(
        vllm_server.api_url + "/chat/completions", json=chat(vllm_server), timeout=10
    )
    assert time.monotonic() - started < 2
    assert refused.status_code == 503, refused.text
    wait_for(
        lambda: httpx.get(vllm_server.base_url + "/health", timeout=5).status_code == 200,
        600,
        "the engine to come back",
    )
    again = httpx.post(
        vllm_server.api_url + "/chat/completions", json=chat(vllm_server), timeout=60
    )
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["completion_tokens"] == 20
    assert "restarting it (attempt 1)" in vllm_server.log()
