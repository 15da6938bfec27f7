"""``--stream-interval N``: the same frames as every-step streaming, in fewer writes.

A server started with ``--stream-interval 4`` is held to the shared scripted
server (interval 1) on every surface: the events of each stream must be the
same once ids and clock times are set aside, and the non-streamed replies
likewise. Then the body of a long stream must arrive in at most one read per
four steps (TCP may merge writes into one read, never split these small ones).
"""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import SETUPS
from tests.e2e.harness import RunningServer, ServerPool, sse_lines
from tests.e2e.test_anthropic import TOOLS as ANTHROPIC_TOOLS
from tests.e2e.test_parsing import TOOLS as CHAT_TOOLS
from tests.e2e.test_responses import WEATHER
from tests.fixtures.scripted_model import ScriptedModel

INTERVAL = 4
#: Fields that differ between two runs of one request. The prompt tokens
#: found in the prefix cache depend on what each server served before.
VOLATILE = frozenset(
    {
        "cached_tokens",
        "id",
        "call_id",
        "created",
        "created_at",
        "completed_at",
        "item_id",
        "request_id",
        "system_fingerprint",
    }
)


@pytest.fixture(scope="module", params=SETUPS)
def pair(
    request: pytest.FixtureRequest, scripted: ScriptedModel, servers: ServerPool
) -> tuple[RunningServer, RunningServer]:
    """The scripted model with ``--stream-interval``, and without it (the
    shared scripted server) on the same engine: logprobs differ a little
    between engines."""
    worker_class, engine = request.param
    flags = ["--engine", engine]
    plain = servers.get(scripted.path, worker_class=worker_class, name="scripted", extra_args=flags)
    paced = servers.get(
        scripted.path,
        worker_class=worker_class,
        name="scripted",
        extra_args=[*flags, "--stream-interval", str(INTERVAL)],
    )
    return paced, plain


def settled(value: Any) -> Any:
    """``value`` without the fields that differ between two runs (the
    Messages API's uncached input tokens summed back with the cached)."""
    if isinstance(value, dict):
        if "cache_read_input_tokens" in value:
            value = dict(value)
            value["input_tokens"] += value.pop("cache_read_input_tokens")
        return {k: settled(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [settled(item) for item in value]
    return value


def events(server: RunningServer, path: str, payload: dict[str, Any]) -> list[Any]:
    response = httpx.post(server.base_url + path, json={**payload, "stream": True}, timeout=60)
    assert response.status_code == 200, response.text
    return [
        settled(json.loads(line[6:])) if line.startswith("data: {") else line
        for line in sse_lines(response.text)
        if line.startswith(("data: ", "event: "))
    ]


def reply(server: RunningServer, path: str, payload: dict[str, Any]) -> Any:
    payload = {k: v for k, v in payload.items() if k != "stream_options"}
    response = httpx.post(server.base_url + path, json=payload, timeout=60)
    assert response.status_code == 200, response.text
    return settled(response.json())


def chat(scripted: ScriptedModel, script: str, **fields: Any) -> dict[str, Any]:
    return {
        "model": "scripted",
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": 60,
        "temperature": 0,
        "chat_template_kwargs": scripted.chat_kwargs(script),
        **fields,
    }


def cases(scripted: ScriptedModel) -> list[tuple[str, dict[str, Any]]]:
    """One request per surface and parser: text with a stop string across
    tokens and multi-byte characters, reasoning, tool calls, logprobs, and
    tokens in and out."""
    logprobs = {"logprobs": True, "top_logprobs": 2}
    return [
        ("/v1/chat/completions", chat(scripted, "bytes_stop", stop=["STOP"], **logprobs)),
        (
            "/v1/chat/completions",
            chat(scripted, "bytes_stop", stream_options={"include_usage": True}),
        ),
        ("/v1/chat/completions", chat(scripted, "reasoning", **logprobs)),
        ("/v1/chat/completions", chat(scripted, "tool_call", tools=CHAT_TOOLS)),
        (
            "/v1/completions",
            {
                "model": "scripted",
                "prompt": scripted.selector("bytes_stop"),
                "max_tokens": 30,
                "temperature": 0,
                "logprobs": 2,
                "n": 2,
                "stop": ["P!"],
            },
        ),
        (
            "/v1/messages",
            {**chat(scripted, "reasoning"), "thinking": {"type": "enabled", "budget_tokens": 1024}},
        ),
        ("/v1/messages", {**chat(scripted, "tool_call"), "tools": ANTHROPIC_TOOLS}),
        (
            "/inference/v1/generate",
            {
                "model": "scripted",
                "token_ids": [scripted.selector_ids["reasoning"]],
                "sampling_params": {"temperature": 0, "logprobs": 1, "max_tokens": 30},
            },
        ),
        (
            "/v1/responses",
            {
                "model": "scripted",
                "input": "go",
                "max_output_tokens": 60,
                "temperature": 0,
                "tools": [WEATHER],
                "chat_template_kwargs": scripted.chat_kwargs("tool_call"),
            },
        ),
    ]


def test_streams_and_replies_are_the_same_as_every_step(
    pair: tuple[RunningServer, RunningServer], scripted: ScriptedModel
) -> None:
    paced, plain = pair
    for path, payload in cases(scripted):
        expected = events(plain, path, payload)
        assert len(expected) > 8, (path, expected)
        assert events(paced, path, payload) == expected, (path, payload)
        assert reply(paced, path, payload) == reply(plain, path, payload), (path, payload)


def test_server_info_reports_the_interval(pair: tuple[RunningServer, RunningServer]) -> None:
    paced, plain = pair
    for server, interval in ((paced, INTERVAL), (plain, 1)):
        info = httpx.get(server.base_url + "/server_info", timeout=10).json()
        assert info["stream_interval"] == interval


def test_a_long_stream_arrives_in_fewer_reads(
    pair: tuple[RunningServer, RunningServer], scripted: ScriptedModel
) -> None:
    paced, plain = pair
    tokens = 41
    payload = {
        "model": "scripted",
        "prompt": scripted.selector("bytes_stop"),  # a script that loops
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    reads, body = 0, b""
    with httpx.stream(
        "POST", paced.base_url + "/v1/completions", json=payload, timeout=60
    ) as response:
        assert response.status_code == 200
        for piece in response.iter_raw():
            reads += 1
            body += piece
    frames = [
        settled(json.loads(line[6:]))
        for line in body.decode().split("\n\n")
        if line.startswith("data: {")
    ]
    assert len(frames) > tokens // 2
    assert frames == [e for e in events(plain, "/v1/completions", payload) if isinstance(e, dict)]
    # The first token alone, then a write per INTERVAL steps, then the end.
    assert reads <= 1 + math.ceil((tokens - 1) / INTERVAL) + 2, reads


def test_several_prompts_stream_each_choice_the_same(
    pair: tuple[RunningServer, RunningServer], scripted: ScriptedModel
) -> None:
    """A completion with several prompts merges one output task per prompt:
    the choices interleave as their batches come, so each choice's frames
    are compared in order."""
    paced, plain = pair
    payload = {
        "model": "scripted",
        "prompt": [scripted.selector("bytes_stop"), scripted.selector("reasoning")],
        "max_tokens": 25,
        "temperature": 0,
        "logprobs": 1,
    }

    def by_choice(server: RunningServer) -> dict[int, list[Any]]:
        choices: dict[int, list[Any]] = {}
        for event in events(server, "/v1/completions", payload):
            if isinstance(event, dict):
                for choice in event["choices"]:
                    choices.setdefault(choice["index"], []).append(choice)
        return choices

    expected = by_choice(plain)
    assert sorted(expected) == [0, 1]
    assert by_choice(paced) == expected
