"""Scheduling end to end: batching invariance, n > 1, queue limits, keepalive,
chunked prefill and cancellation of waiting requests."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from tests.e2e import schemas
from tests.e2e.harness import (
    OTHER_PLACEMENT,
    RunningServer,
    ServerPool,
    assert_freed_promptly,
    context_room,
    scheduler_state,
    seconds_per_token,
    serving,
    sse_lines,
)

LONG_PROMPT = [{"role": "user", "content": "Tell me everything about the rivers of Europe. " * 3}]


def body(server: RunningServer, content: str = "hi", **fields: Any) -> dict[str, Any]:
    return {
        "model": server.model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 20,
        "temperature": 0,
        **fields,
    }


def reply_text(server: RunningServer, payload: dict[str, Any]) -> str:
    response = httpx.post(server.api_url + "/chat/completions", json=payload, timeout=120)
    assert response.status_code == 200, response.text
    content: str = response.json()["choices"][0]["message"]["content"]
    return content


async def concurrently(server: RunningServer, payloads: list[dict[str, Any]]) -> list[str]:
    results = [""] * len(payloads)
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(index: int) -> None:
            response = await client.post(server.api_url + "/chat/completions", json=payloads[index])
            assert response.status_code == 200, response.text
            results[index] = response.json()["choices"][0]["message"]["content"]

        async with anyio.create_task_group() as group:
            for index in range(len(payloads)):
                group.start_soon(one, index)
    return results


def test_output_does_not_depend_on_the_batch(server: RunningServer) -> None:
    target = body(server, "Where does the Danube flow?", max_tokens=30)
    seeded = body(server, "Sing", max_tokens=30, temperature=1.0, seed=99)
    alone = reply_text(server, target)
    alone_seeded = reply_text(server, seeded)
    others = [body(server, "x" * (7 * i + 1), max_tokens=10 + 5 * i) for i in range(5)]
    together = anyio.run(concurrently, server, [*others[:2], target, seeded, *others[2:]])
    assert together[2] == alone
    assert together[3] == alone_seeded


@pytest.mark.parametrize("sampling", [{}, {"top_p": 0.9, "top_k": 50}])
def test_seeded_requests_started_together_read_as_they_do_alone(
    server: RunningServer, sampling: dict[str, Any]
) -> None:
    """Seeded requests admitted while others decode: each one's first token
    is drawn in a step that is still in flight when the next is planned,
    and its seeded stream must go on from there, not start over."""
    seeded = [
        body(server, f"Sing {i}", max_tokens=16, temperature=1.0, seed=10 + i, **sampling)
        for i in range(6)
    ]
    alone = [reply_text(server, payload) for payload in seeded]
    together = anyio.run(concurrently, server, seeded)
    assert together == alone


def test_n_choices_stream_with_their_indices(server: RunningServer) -> None:
    payload = body(server, max_tokens=8, n=3, temperature=1.0, seed=5, stream=True)
    with httpx.Client(timeout=120) as client:
        response = client.post(server.api_url + "/chat/completions", json=payload)
    chunks = [
        json.loads(line[6:]) for line in sse_lines(response.text) if line.startswith("data: {")
    ]
    for chunk in chunks:
        schemas.check(chunk, schemas.CHAT_CHUNK)
    texts = {0: "", 1: "", 2: ""}
    finishes = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert finishes == {0: "length", 1: "length", 2: "length"}
    whole = httpx.post(
        server.api_url + "/chat/completions", json={**payload, "stream": False}, timeout=120
    ).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in whole["choices"]] == [texts[0], texts[1], texts[2]]
    assert len(set(texts.values())) > 1  # seeded per choice, not one stream copied
    assert whole["usage"]["completion_tokens"] == 24


@pytest.fixture(scope="module")
def tight_server(
    default_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """Two rows, one waiting place, tiny prefill chunks, fast keepalives."""
    with serving(
        default_model,
        tmp_path_factory.mktemp("logs"),
        "--max-num-seqs", "2",
        "--max-queued-requests", "1",
        "--prefill-chunk-tokens", "5",
        "--keepalive-seconds", "0.2",
        worker_class="trio",
    ) as running:  # fmt: skip
        yield running


def test_chunked_prefill_gives_the_same_reply(
    server: RunningServer, tight_server: RunningServer
) -> None:
    payload = {"messages": LONG_PROMPT, "max_tokens": 12, "temperature": 0, "prompt_logprobs": 2}
    replies = [
        httpx.post(
            s.api_url + "/chat/completions", json={**payload, "model": s.model}, timeout=120
        ).json()
        for s in (server, tight_server)
    ]
    assert replies[0]["choices"][0]["message"] == replies[1]["choices"][0]["message"]
    first, second = (r["prompt_logprobs"] for r in replies)
    assert len(first) == len(second) == replies[0]["usage"]["prompt_tokens"]
    for a, b in zip(first[1:], second[1:], strict=True):
        assert abs(a["logprob"] - b["logprob"]) < 1e-4


def wait_for(predicate: Any, seconds: float = 15.0, show: Any = None) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out: {show() if show else ''}"
        time.sleep(0.02)


def content_of(lines: list[str]) -> str:
    """The content deltas of a stream's ``data:`` lines."""
    text = ""
    for line in lines:
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                text += choice["delta"].get("content") or ""
    return text


def test_full_queue_answers_429_and_waiting_streams_keep_alive(tight_server: RunningServer) -> None:
    server = tight_server
    seconds_per_token(server)  # timed before, on an idle server
    # No max_tokens: the whole context, far more than the test waits for.
    long = body(server, ignore_eos=True, stream=True)
    del long["max_tokens"]
    room = context_room(server)

    def scheduler() -> dict[str, int]:
        return scheduler_state(server)

    async def main() -> None:
        async with httpx.AsyncClient(timeout=60) as client, anyio.create_task_group() as group:
            # Two streams fill both rows.
            for _ in range(2):
                group.start_soon(drain, client, long)
            await anyio.to_thread.run_sync(
                wait_for, lambda: scheduler()["running_sequences"] == 2, 15.0, scheduler
            )
            # A third waits in the queue, receiving keepalives.
            waiting_lines: list[str] = []
            group.start_soon(collect, client, long, waiting_lines)
            await anyio.to_thread.run_sync(wait_for, lambda: scheduler()["queued_requests"] == 1)
            # A fourth finds the queue full.
            refused = await client.post(server.api_url + "/chat/completions", json=long)
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == "1"
            error = refused.json()
            schemas.check(error, schemas.ERROR)
            assert error["error"]["type"] == "rate_limit_error"
            await anyio.sleep(0.7)
            assert ": keepalive" in waiting_lines
            assert any(line.startswith("data: {") for line in waiting_lines)  # its first chunk
            assert content_of(waiting_lines) == ""
            group.cancel_scope.cancel()

    async def drain(client: httpx.AsyncClient, payload: dict[str, Any]) -> None:
        async with client.stream("POST", server.api_url + "/chat/completions", json=payload) as r:
            assert r.status_code == 200
            async for _ in r.aiter_lines():
                pass

    async def collect(client: httpx.AsyncClient, payload: dict[str, Any], lines: list[str]) -> None:
        async with client.stream("POST", server.api_url + "/chat/completions", json=payload) as r:
            async for line in r.aiter_lines():
                if line:
                    lines.append(line)

    anyio.run(main)
    # Every stream went away: the queued one left the queue, the rows are
    # free, long before the streams could have run to their ends.
    assert_freed_promptly(server, left=room, since=time.monotonic())
    assert scheduler()["queued_requests"] == 0


CHILD_LOG_LINE = "the engine runs in a child process"


@pytest.fixture(scope="module")
def other_placement(default_model: Path, servers: ServerPool) -> Callable[[str], RunningServer]:
    """Per engine, a server whose engine runs where that engine's default does
    not (``OTHER_PLACEMENT``)."""

    def other(engine: str) -> RunningServer:
        flags = ["--engine", engine, *OTHER_PLACEMENT[engine]]
        return servers.get(default_model, worker_class="asyncio", extra_args=flags)

    return other


def test_engine_in_a_child_process_replies_the_same(
    server: RunningServer, other_placement: Callable[[str], RunningServer]
) -> None:
    """Greedy and seeded replies, with logprobs, batched or not, match the
    engine on a thread; and the child's scheduler goes idle afterwards. On
    the CPU both engines run in a child process by default."""
    thread_server, process_server = other_placement(server.engine), server
    assert CHILD_LOG_LINE in process_server.log()
    assert CHILD_LOG_LINE not in thread_server.log()
    if server.engine == "transformers":
        # Given no thread count, the child picks one by timing its steps
        # (from 2 cores up): the count reported is the most it uses.
        info = httpx.get(process_server.base_url + "/server_info", timeout=10).json()
        threads = len(os.sched_getaffinity(0))
        assert info["engine_threads"] == threads
        assert info["engine_threads_tuned"] is (threads >= 2)
    payloads = [
        {
            **body(s, "Where does the Danube flow?", max_tokens=24),
            "logprobs": True,
            "top_logprobs": 2,
        }
        for s in (thread_server, process_server)
    ]
    seeded = [
        body(s, "Sing", max_tokens=16, temperature=1.0, seed=7)
        for s in (thread_server, process_server)
    ]
    replies = []
    for s, payload in zip((thread_server, process_server), payloads, strict=True):
        response = httpx.post(s.api_url + "/chat/completions", json=payload, timeout=120)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        replies.append((choice["message"]["content"], choice["logprobs"]["content"]))
    (text, entries), (child_text, child_entries) = replies
    assert child_text == text
    assert [e["token"] for e in child_entries] == [e["token"] for e in entries]
    for mine, theirs in zip(child_entries, entries, strict=True):
        assert abs(mine["logprob"] - theirs["logprob"]) < 1e-4
    batch = [body(process_server, "x" * (5 * i + 1), max_tokens=8 + 3 * i) for i in range(4)]
    together = anyio.run(concurrently, process_server, [*batch[:2], seeded[1], *batch[2:]])
    assert together[2] == reply_text(thread_server, seeded[0])
    health = httpx.get(process_server.base_url + "/health", timeout=10).json()
    assert health["scheduler"] == {
        "running_requests": 0,
        "running_sequences": 0,
        "queued_requests": 0,
        "paused_requests": 0,
    }
