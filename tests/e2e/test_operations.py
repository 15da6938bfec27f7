"""Operating the server, end to end: malformed input is a 4xx, a stalled
reader pauses only its own request (then ends, its slot freed), a paused
stream resumes unchanged, a burst of faulty clients (the load-and-fault
bench's, shorter), deadlines, metrics, request ids, CORS and the API key."""

from __future__ import annotations

import json
import re
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.harness import RunningServer, serving, sse_lines, start_server
from tests.e2e.ops import SilentReader, Stream, chat, load, wait_for

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
from faults import Burst, run_burst, seconds_to_idle

pytestmark = pytest.mark.e2e

KEY = "ops-key"
ORIGIN = "https://app.example"
#: Long enough that a stalled reader's request pauses (its mailbox fills,
#: 64 steps after its writes start to wait) before its writes time out, on a
#: loaded host too.
STALL = 20.0
DEADLINE = 3.0


@pytest.fixture(scope="module")
def ops_server(
    default_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    logs = tmp_path_factory.mktemp("ops")
    key_file = logs / "key"
    key_file.write_text(KEY + "\n")
    server = start_server(
        default_model,
        worker_class="asyncio",
        log_dir=logs,
        extra_args=[
            "--engine",
            "transformers",
            "--api-key-file",
            str(key_file),
            "--allowed-origins",
            ORIGIN,
            "--stall-timeout",
            str(STALL),
        ],
    )
    server.api_key = KEY
    yield server
    server.stop()
    assert "Traceback" not in server.log()


def post(server: RunningServer, body: Any, timeout: float = 30, **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        server.api_url + "/chat/completions",
        content=content,
        headers={"content-type": "application/json", **server.auth, **headers},
        timeout=timeout,
    )


def test_the_api_key_comes_from_its_file_and_a_401_names_bearer(ops_server: RunningServer) -> None:
    assert post(ops_server, chat(ops_server, max_tokens=2)).status_code == 200
    refused = httpx.get(ops_server.api_url + "/models", headers={"authorization": "Bearer no"})
    assert refused.status_code == 401
    assert refused.headers["www-authenticate"] == "Bearer"
    # Probes and scrapers need no key.
    for path in ("/health", "/ready", "/metrics", "/version", "/openapi.json"):
        assert httpx.get(ops_server.base_url + path).status_code == 200, path
    assert httpx.get(ops_server.base_url + "/v1/loads").status_code == 401


def test_a_non_ascii_authorization_header_is_a_401(ops_server: RunningServer) -> None:
    for value in (b"Bearer \xe9t\xe9", b"Bearer \xff\xfe", "Bearer ops-këy".encode()):
        reply = httpx.get(ops_server.api_url + "/models", headers={b"authorization": value})
        assert reply.status_code == 401, value
        assert reply.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 50_000 + b"]" * 50_000,
        b'{"model": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5001,
        b'{"max_tokens": ' + b"9" * 5000 + b"}",
        b'{"messages": "\xff\xfe"}',
        b'{"temperature": NaN}',
    ],
    ids=["deep-array", "deep-object", "huge-int", "bad-utf8", "nan"],
)
def test_malformed_bodies_are_400s(ops_server: RunningServer, body: bytes) -> None:
    reply = post(ops_server, body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["type"] == "invalid_request_error"


# Empty containers are leaves: an extension that may draw no child at all
# trips hypothesis's "can't actually recurse" check (an error here).
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.floats()
    | st.integers()
    | st.text(max_size=50)
    | st.just([])
    | st.just({}),
    lambda children: (
        st.lists(children, min_size=1, max_size=4)
        | st.dictionaries(st.text(max_size=10), children, min_size=1, max_size=4)
    ),
    max_leaves=30,
)
FIELDS = st.sampled_from(
    ["model", "messages", "max_tokens", "temperature", "n", "stop", "logprobs", "tools", "seed"]
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fields=st.dictionaries(FIELDS, JSON, max_size=5),
    raw=st.binary(max_size=200),
    as_raw=st.booleans(),
)
def test_random_bodies_never_get_a_5xx(
    ops_server: RunningServer, fields: dict[str, Any], raw: bytes, as_raw: bool
) -> None:
    # max_completion_tokens, which no drawn field overrides, bounds every
    # valid request: a drawn "max_tokens": null asks for the whole context
    # (8k tokens), which is valid and only slow; it timed this test out.
    base = {**chat(ops_server, max_tokens=2), "max_completion_tokens": 4}
    body = raw if as_raw else json.dumps({**base, **fields}, allow_nan=True).encode()
    reply = post(ops_server, body)
    assert reply.status_code < 500, (body[:300], reply.text)


def test_a_request_id_is_taken_or_minted_and_logged_without_secrets(
    ops_server: RunningServer,
) -> None:
    secret_prompt = "the password is swordfish"
    mine = post(
        ops_server,
        {
            **chat(ops_server, max_tokens=3),
            "messages": [{"role": "user", "content": secret_prompt}],
        },
        **{"x-request-id": "trace-42"},
    )
    assert mine.headers["x-request-id"] == "trace-42"
    minted = post(ops_server, chat(ops_server, max_tokens=3), **{"x-request-id": "bad id\x01"})
    assert re.fullmatch(r"[0-9a-f]{32}", minted.headers["x-request-id"])
    log = ops_server.log()
    line = next(line for line in log.splitlines() if "trace-42" in line)
    assert '"POST /v1/chat/completions" 200 prompt_tokens=' in line
    assert "completion_tokens=3" in line
    assert re.search(r" ttft=\d+\.\d{3} ", line)
    assert secret_prompt not in log
    assert KEY not in log


def test_a_stream_that_fails_raises_in_wait() -> None:
    """The helper's thread keeps a stream's error; the test that waits gets it."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    server = cast(RunningServer, SimpleNamespace(api_url=f"http://127.0.0.1:{port}/v1", auth={}))
    stream = Stream(server, {"model": "m"}).start()
    with pytest.raises(AssertionError, match="the stream failed: ConnectError"):
        stream.wait(30)


HISTOGRAMS = (
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
)


def scrape(server: RunningServer) -> dict[str, float]:
    """Every sample of /metrics by its name (labels dropped: one model, and
    the tests read only series with one label set, or sum them)."""
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if family.name != "sluiceway:http_requests":
                values[sample.name] = sample.value
    return values


def test_metrics_record_a_streamed_request_and_read_it_running(
    ops_server: RunningServer,
) -> None:
    """One streamed request adds one observation to TTFT, end-to-end and
    queue time, and one inter-token gap per delta after its first; while a
    stream runs, the running gauge reads it; then the gauges go back to 0."""
    post(ops_server, chat(ops_server, max_tokens=5))
    before = scrape(ops_server)
    stream = Stream(ops_server, chat(ops_server, max_tokens=8, ignore_eos=True)).start().wait(60)
    assert stream.ended_well
    deltas = sum(
        1 for c in stream.chunks if c.get("choices") and c["choices"][0]["delta"].get("content")
    )
    assert deltas >= 2, stream.lines
    after = scrape(ops_server)
    counts = {name: after[name + "_count"] - before[name + "_count"] for name in HISTOGRAMS}
    gaps = counts.pop("vllm:inter_token_latency_seconds")
    assert counts == dict.fromkeys(counts, 1.0), counts
    # Deltas that wait together go out in one write, each still noted.
    assert 1 <= gaps <= 7, gaps
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 8
    # A stream long enough not to end by itself is running while it is read.
    endless = Stream(ops_server, chat(ops_server, max_tokens=100_000, ignore_eos=True)).start()
    assert endless.first.wait(60)
    running = scrape(ops_server)
    assert running["vllm:num_requests_running"] == 1.0, running
    assert running["vllm:kv_cache_usage_perc"] > 0.0, running
    endless.hang_up(60)
    wait_for(lambda: load(ops_server)["running_requests"] == 0, 30, "the hung-up stream to end")
    idle = scrape(ops_server)
    assert idle["vllm:num_requests_running"] == 0.0
    assert idle["vllm:num_requests_waiting"] == 0.0
    text = httpx.get(ops_server.base_url + "/metrics").text
    assert re.search(
        r'sluiceway:http_requests_total\{route="/v1/chat/completions",status="200",'
        r'surface="openai"\} [1-9]',
        text,
    )
    loads = httpx.get(ops_server.base_url + "/v1/loads", headers=ops_server.auth).json()
    assert loads["loads"][0]["num_running_reqs"] == 0


def test_cors_answers_an_allowed_origin_only(ops_server: RunningServer) -> None:
    preflight = httpx.options(
        ops_server.api_url + "/chat/completions",
        headers={
            "origin": ORIGIN,
            "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type",
        },
    )
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in preflight.headers["access-control-allow-headers"]
    reply = post(ops_server, chat(ops_server, max_tokens=2), origin=ORIGIN)
    assert reply.headers["access-control-allow-origin"] == ORIGIN
    other = post(ops_server, chat(ops_server, max_tokens=2), origin="https://evil.example")
    assert "access-control-allow-origin" not in other.headers


#: A stream that writes ~1.5 kB a step: the server's send buffers fill in
#: about a hundred steps, then the request's mailbox in 64 more.
HEAVY = {"logprobs": True, "top_logprobs": 20, "ignore_eos": True}
#: Tokens of the stream that pauses and resumes: more than it takes to pause.
RESUMED = 300


def dechunk(raw: bytes) -> bytes:
    """The body of a chunked HTTP/1.1 response (as far as it arrived)."""
    _, _, rest = raw.partition(b"\r\n\r\n")
    body = []
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        if not size or int(size, 16) == 0:
            break
        body.append(rest[: int(size, 16)])
        rest = rest[int(size, 16) + 2 :]
    return b"".join(body)


def texts_of(sse: bytes) -> dict[int, str]:
    """Each choice's content, from a stream's SSE bytes."""
    texts: dict[int, str] = {}
    for line in sse_lines(sse):
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                content = choice["delta"].get("content") or ""
                texts[choice["index"]] = texts.get(choice["index"], "") + content
    return texts


def kv_used(server: RunningServer) -> tuple[int, float]:
    """The KV cache in use, as /v1/loads counts it (tokens) and as the
    Prometheus gauge reads it (utilisation, 0 to 1)."""
    loads = httpx.get(server.base_url + "/v1/loads", headers=server.auth, timeout=10).json()
    return loads["loads"][0]["num_used_tokens"], scrape(server)["vllm:kv_cache_usage_perc"]


def test_a_stalled_reader_pauses_alone_and_resumes_where_it_left_off(
    ops_server: RunningServer,
) -> None:
    """A stalled reader's request leaves the batch (its KV cache freed) while
    others run; once read, it is rebuilt from the prompt and the tokens so
    far, and its greedy text is the same as unpaused."""
    beside_body = chat(ops_server, max_tokens=10, ignore_eos=True)
    prompt = post(ops_server, beside_body).json()["usage"]["prompt_tokens"]
    reader = SilentReader(ops_server, chat(ops_server, max_tokens=RESUMED, **HEAVY))
    try:
        wait_for(lambda: load(ops_server)["paused_requests"] == 1, 120, "the request to pause")
        # Paused, it holds no KV cache: its rows left the batch and were freed.
        assert kv_used(ops_server) == (0, 0.0)
        # It stays out of the batch while another stream runs (which ends
        # well), and the KV held is only that stream's: its prompt and its
        # tokens so far.
        beside = Stream(ops_server, beside_body).start()
        seen, held = [load(ops_server)], [kv_used(ops_server)]
        while not beside.done.wait(0.05):
            seen.append(load(ops_server))
            held.append(kv_used(ops_server))
        assert beside.ended_well
        assert all(s["paused_requests"] == 1 and s["running_sequences"] <= 1 for s in seen), seen
        assert max(tokens for tokens, _ in held) <= prompt + 10, (prompt, held)
        assert kv_used(ops_server) == (0, 0.0)
        got = texts_of(dechunk(reader.read_all(120)))
    finally:
        reader.close()
    unpaused = chat(ops_server, max_tokens=RESUMED, ignore_eos=True)
    expected = post(ops_server, unpaused, timeout=120).json()["choices"][0]["message"]["content"]
    assert got == {0: expected}


def test_a_stalled_reader_is_cut_off_after_the_stall_timeout(ops_server: RunningServer) -> None:
    stalled = SilentReader(ops_server, chat(ops_server, max_tokens=7000, **HEAVY))
    try:
        wait_for(lambda: load(ops_server)["paused_requests"] == 1, 120, "the request to pause")
        wait_for(lambda: load(ops_server)["running_requests"] == 0, STALL + 10, "the cut-off")
        assert load(ops_server)["paused_requests"] == 0
    finally:
        stalled.close()
    # The write's watchdog (which also closes the connection) or the
    # scheduler's pause timer, whichever comes first; each alone frees it.
    assert re.search(
        r"a client stopped reading|stalled: its client stopped reading", ops_server.log()
    )


def test_a_burst_of_faulty_clients_gets_no_5xx_and_every_stream_ends_well(
    ops_server: RunningServer,
) -> None:
    """bench/loadfault.py's burst, shorter: 40 streaming clients on four
    surfaces for a few seconds, 30 % hanging up at random points, 10 % bad
    requests, two stalled readers."""
    burst = Burst(
        base_url=ops_server.base_url,
        model=ops_server.model,
        clients=40,
        seconds=4.0,
        stalled=2,
        max_tokens=16,
        headers=tuple(ops_server.auth.items()),
        seed=int(time.time()),
    )
    tally = run_burst(burst)
    assert tally.server_errors == 0, tally.statuses
    assert not tally.problems, tally.problems[:5]
    assert not tally.timed_out, "a request hung"
    assert sum(tally.completed.values()) >= 10, tally.sent
    assert sum(tally.refused.values()) >= 1, tally.sent
    # The gauges read 0 soon after the last client (stalled readers included).
    assert seconds_to_idle(ops_server.base_url, within=30) < 30
    assert load(ops_server)["running_sequences"] == 0


def test_a_request_past_its_deadline_ends_with_the_surfaces_error(
    default_model: Path, tmp_path: Path
) -> None:
    with serving(
        default_model, tmp_path, "--engine", "transformers", "--request-timeout", str(DEADLINE)
    ) as server:
        started = time.monotonic()
        stream = Stream(server, chat(server, max_tokens=100_000, ignore_eos=True)).start()
        stream.wait(DEADLINE + 10)
        assert stream.failed_with_event is not None
        assert "limit" in stream.failed_with_event
        assert DEADLINE - 0.1 < time.monotonic() - started < DEADLINE + 5
        whole = post(server, chat(server, max_tokens=100_000, ignore_eos=True))
        assert whole.status_code == 504
        assert whole.json()["error"]["type"] == "server_error"
        wait_for(lambda: load(server)["running_requests"] == 0, 5, "the slots to be freed")


def test_openapi_describes_every_surface_route(ops_server: RunningServer) -> None:
    spec = httpx.get(ops_server.base_url + "/openapi.json").json()
    assert spec["openapi"].startswith("3.1")
    chat_op = spec["paths"]["/v1/chat/completions"]["post"]
    assert chat_op["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatRequest"
    }
    assert "ChatCompletion" in spec["components"]["schemas"]
    assert "text/event-stream" in chat_op["responses"]["200"]["content"]
    for path in ("/v1/completions", "/v1/models", "/v1/models/{model}", "/health", "/metrics"):
        assert path in spec["paths"], path


# --- schemathesis: every route of /openapi.json, fuzzed -----------------------

#: The length fields of the generating routes, and where a missing one means
#: "the whole context" (slow, not faulty) rather than a small default.
LENGTHS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
OPEN_ENDED = {"/v1/chat/completions": "max_completion_tokens", "/v1/responses": "max_output_tokens"}
MOST_TOKENS = 4


def bounded(body: object) -> None:
    """Keep every valid request short: an absent, null or large length
    becomes MOST_TOKENS (a wrong type or a negative stays, for the 4xx)."""
    if isinstance(body, dict):
        for key, value in body.items():
            if key in LENGTHS and (value is None or (type(value) is int and value > MOST_TOKENS)):
                body[key] = MOST_TOKENS
            else:
                bounded(value)
    elif isinstance(body, list):
        for item in body:
            bounded(item)


@pytest.mark.parametrize(
    "mode", [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE], ids=str
)
def test_openapi_fuzzing_never_gets_a_5xx(
    ops_server: RunningServer, mode: schemathesis.GenerationMode
) -> None:
    """Requests drawn from /openapi.json's own schemas, valid ones and
    invalid ones, over every route: none gets a 5xx or hangs."""
    schema = schemathesis.openapi.from_url(ops_server.base_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) > 20

    def call(case: schemathesis.Case) -> None:
        if isinstance(case.body, dict):
            bounded(case.body)
            if (length := OPEN_ENDED.get(case.path)) is not None:
                case.body.setdefault(length, MOST_TOKENS)
        reply = case.call(headers={"authorization": f"Bearer {KEY}"}, timeout=60)
        assert reply.status_code < 500, (case.method, case.path, case.body, reply.text[:500])

    # A few examples of each route (one strategy over all of them could skip some).
    for operation in operations:
        fuzz = settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))(
            given(case=operation.as_strategy(mode))(call)
        )
        try:
            fuzz()
        except Unsatisfiable:
            # A route with no parameters and no body has no invalid request.
            assert mode is schemathesis.GenerationMode.NEGATIVE, operation.label
