"""Chat completions end to end: real Hypercorn, real clients, both worker classes."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest
from httpx_sse import connect_sse

from tests.e2e import schemas
from tests.e2e.conftest import DEFAULT_ENGINE_ONLY
from tests.e2e.harness import (
    RunningServer,
    assert_freed_promptly,
    context_room,
    scheduler_state,
    seconds_per_token,
    serving,
    start_server,
)

MESSAGES = [{"role": "user", "content": "Tell me about rivers."}]


def chat_body(server: RunningServer, **fields: Any) -> dict[str, Any]:
    return {"model": server.model, "messages": MESSAGES, "max_tokens": 12, **fields}


def sse_events(server: RunningServer, body: dict[str, Any]) -> list[str]:
    with (
        httpx.Client(timeout=60) as client,
        connect_sse(client, "POST", server.api_url + "/chat/completions", json=body) as source,
    ):
        assert source.response.status_code == 200
        assert source.response.headers["content-type"].startswith("text/event-stream")
        return [event.data for event in source.iter_sse()]


def test_models_and_health(server: RunningServer) -> None:
    models = httpx.get(server.api_url + "/models").json()
    schemas.check(models, schemas.MODEL_LIST)
    assert [m["id"] for m in models["data"]] == [server.model]
    one = httpx.get(server.api_url + f"/models/{server.model}")
    assert one.status_code == 200
    assert one.json()["id"] == server.model
    health = server.health()
    assert health["status"] == "ok"
    engine = health["engine"]["name"]  # type: ignore[index]
    assert engine == server.engine
    assert models["data"][0]["engine"] == engine


def test_sdk_non_streaming(server: RunningServer) -> None:
    with openai.OpenAI(base_url=server.api_url, api_key="unused") as client:
        raw = client.chat.completions.with_raw_response.create(
            model=server.model,
            messages=MESSAGES,
            max_tokens=8,
            temperature=0,  # type: ignore[arg-type]
        )
    schemas.check(json.loads(raw.text), schemas.CHAT_COMPLETION)
    completion = raw.parse()
    choice = completion.choices[0]
    assert completion.object == "chat.completion"
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.logprobs is None
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 8
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 8


def test_sdk_streaming_matches_non_streaming(server: RunningServer) -> None:
    with openai.OpenAI(base_url=server.api_url, api_key="unused") as client:
        whole = client.chat.completions.create(
            model=server.model,
            messages=MESSAGES,
            max_tokens=16,
            temperature=0,  # type: ignore[arg-type]
        )
        chunks = list(
            client.chat.completions.create(
                model=server.model,
                messages=MESSAGES,  # type: ignore[arg-type]
                max_tokens=16,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
    assert len({(c.id, c.created, c.model, c.object) for c in chunks}) == 1
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["length"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.anyio
async def test_async_sdk_streams(server: RunningServer) -> None:
    async with openai.AsyncOpenAI(base_url=server.api_url, api_key="unused") as client:
        stream = await client.chat.completions.create(
            model=server.model,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=10,
            stream=True,
            seed=3,
        )
        async with stream:
            pieces = [chunk async for chunk in stream]
        whole = await client.chat.completions.create(
            model=server.model,
            messages=MESSAGES,
            max_tokens=10,
            seed=3,  # type: ignore[arg-type]
        )
    text = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    assert text == whole.choices[0].message.content


def test_raw_sse_framing(server: RunningServer) -> None:
    # Sampled at the default temperature, so only ignore_eos makes "length" certain.
    body = chat_body(server, stream=True, stream_options={"include_usage": True}, ignore_eos=True)
    with httpx.Client(timeout=60) as client:
        response = client.post(server.api_url + "/chat/completions", json=body)
    raw = response.content
    assert raw.endswith(b"data: [DONE]\n\n")
    frames = raw.split(b"\n\n")
    assert frames[-1] == b""
    assert all(frame.startswith(b"data: ") for frame in frames[:-1])
    events = sse_events(server, body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(data) for data in events[:-1]]
    for chunk in chunks:
        schemas.check(chunk, schemas.CHAT_CHUNK)
        assert "usage" in chunk  # include_usage: null on every chunk but the last
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}
    assert chunks[-1]["choices"] == []
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_seeded_sampling_is_reproducible(server: RunningServer) -> None:
    body = chat_body(server, temperature=1.0, top_p=0.9, seed=1234, max_tokens=20)
    first = httpx.post(server.api_url + "/chat/completions", json=body, timeout=60).json()
    second = httpx.post(server.api_url + "/chat/completions", json=body, timeout=60).json()
    assert first["choices"][0]["message"] == second["choices"][0]["message"]


def test_eos_finishes_with_stop(server: RunningServer) -> None:
    eos = 2  # <|im_end|> in the default model's vocabulary
    body = chat_body(server, temperature=0, logit_bias={str(eos): 100})
    reply = httpx.post(server.api_url + "/chat/completions", json=body, timeout=60).json()
    schemas.check(reply, schemas.CHAT_COMPLETION)
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert reply["choices"][0]["message"]["content"] == ""
    assert reply["usage"]["completion_tokens"] == 1


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    schemas.check(body, schemas.ERROR)
    return body["error"]


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"temperature": 3}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"top_p": 1.5}, "top_p"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0]"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"stop": "x", "n": 200}, "n"),
    ],
)
def test_bad_requests_name_their_param(
    server: RunningServer, change: dict[str, Any], param: str
) -> None:
    body = {**chat_body(server), **change}
    error = error_of(httpx.post(server.api_url + "/chat/completions", json=body), 400)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


def test_missing_field_and_bad_json(server: RunningServer) -> None:
    url = server.api_url + "/chat/completions"
    missing = error_of(httpx.post(url, json={"model": server.model}), 400)
    assert missing["param"] == "messages"
    bad = error_of(httpx.post(url, content=b"{not json"), 400)
    assert "JSON" in bad["message"]
    not_object = error_of(httpx.post(url, json=[1, 2]), 400)
    assert not_object["param"] is None


def test_unknown_model_route_and_method(server: RunningServer) -> None:
    body = {**chat_body(server), "model": "nope"}
    model = error_of(httpx.post(server.api_url + "/chat/completions", json=body), 404)
    assert model["code"] == "model_not_found"
    assert model["param"] == "model"
    error_of(httpx.get(server.api_url + "/nowhere"), 404)
    error_of(httpx.get(server.api_url + "/models/nope"), 404)
    wrong = httpx.get(server.api_url + "/chat/completions")
    error_of(wrong, 405)
    assert wrong.headers["allow"] == "POST"


def test_oversized_body_is_refused(server: RunningServer) -> None:
    body = {**chat_body(server), "user": "x" * 70_000}
    error_of(httpx.post(server.api_url + "/chat/completions", json=body), 413)


def test_bad_requests_do_not_disturb_a_running_stream(server: RunningServer) -> None:
    reference = httpx.post(
        server.api_url + "/chat/completions",
        json=chat_body(server, temperature=0, max_tokens=40),
        timeout=60,
    ).json()["choices"][0]["message"]["content"]

    async def main() -> str:
        async with httpx.AsyncClient(timeout=60) as client:
            streamed: list[str] = []

            async def stream() -> None:
                body = chat_body(server, temperature=0, max_tokens=40, stream=True)
                async with client.stream(
                    "POST", server.api_url + "/chat/completions", json=body
                ) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            chunk = json.loads(line[6:])
                            if chunk["choices"]:
                                streamed.append(chunk["choices"][0]["delta"].get("content") or "")

            async def pester() -> None:
                for _ in range(10):
                    await client.post(server.api_url + "/chat/completions", content=b"{")
                    await client.post(
                        server.api_url + "/chat/completions", json={"model": server.model}
                    )

            async with anyio.create_task_group() as group:
                group.start_soon(stream)
                group.start_soon(pester)
            return "".join(streamed)

    assert anyio.run(main) == reference


def wait_until_running(server: RunningServer, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while scheduler_state(server)["running_sequences"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)


def test_disconnect_mid_stream_frees_the_slot(server: RunningServer) -> None:
    seconds_per_token(server)  # timed before, on an idle server
    body = chat_body(server, ignore_eos=True, stream=True)
    del body["max_tokens"]  # the whole context: far more than the test waits for
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", server.api_url + "/chat/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        seen = 0
        while seen < 3:
            seen += next(lines).startswith("data: ")
        # Leaving the block closes the connection mid-reply.
    closed = time.monotonic()
    assert_freed_promptly(server, left=context_room(server), since=closed)


def test_disconnect_while_waiting_for_a_whole_reply_frees_the_slot(server: RunningServer) -> None:
    seconds_per_token(server)
    body = chat_body(server, ignore_eos=True)
    del body["max_tokens"]
    payload = json.dumps(body).encode()
    host, port = server.base_url.removeprefix("http://").split(":")
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port))) as connection:
        connection.sendall(head + payload)
        wait_until_running(server)
    closed = time.monotonic()
    assert_freed_promptly(server, left=context_room(server), since=closed)


@DEFAULT_ENGINE_ONLY
@pytest.mark.parametrize("worker_class", ["asyncio", "trio"])
def test_app_factory_under_the_hypercorn_command(
    default_model: Path, tmp_path: Path, worker_class: str
) -> None:
    running = start_server(
        default_model,
        worker_class=worker_class,
        log_dir=tmp_path,
        name="factory",
        through_hypercorn_cli=True,
    )
    try:
        events = sse_events(running, chat_body(running, stream=True, max_tokens=3))
        assert events[-1] == "[DONE]"
        assert json.loads(events[0])["model"] == "factory"
        # Hypercorn's worker is a daemonic process: no child for the engine.
        assert "the engine runs on a thread: a daemonic worker" in running.log()
    finally:
        running.stop()


@DEFAULT_ENGINE_ONLY
def test_api_key_is_read_the_openai_way(default_model: Path, tmp_path: Path) -> None:
    """With ``--api-key``, the OpenAI routes take ``Authorization: Bearer``
    (the OpenAI SDK's way); /health needs none; errors keep OpenAI's shape."""
    with serving(default_model, tmp_path, "--api-key", "k3y") as running:
        assert httpx.get(running.base_url + "/health").status_code == 200
        missing = error_of(httpx.get(running.api_url + "/models"), 401)
        assert (missing["type"], missing["code"]) == ("authentication_error", "invalid_api_key")
        error_of(httpx.get(running.api_url + "/nowhere"), 401)
        wrong = {"x-api-key": "k3y", "authorization": "Bearer nope"}
        error_of(httpx.get(running.api_url + "/models", headers=wrong), 401)
        with openai.OpenAI(base_url=running.api_url, api_key="k3y") as client:
            assert [card.id for card in client.models.list()] == [running.model]
            reply = client.chat.completions.create(
                model=running.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            assert reply.choices[0].finish_reason in {"stop", "length"}
        bearer = {"authorization": "Bearer k3y"}
        error_of(httpx.get(running.api_url + "/nowhere", headers=bearer), 404)
        # The tokens surface and the tokenizer routes take the key the same way.
        generate = running.base_url + "/inference/v1/generate"
        refused = error_of(httpx.post(generate, json={"token_ids": [1]}), 401)
        assert refused["type"] == "authentication_error"
        error_of(httpx.post(running.base_url + "/tokenize", json={"prompt": "x"}), 401)
        body = {"token_ids": [1], "sampling_params": {"max_tokens": 1}}
        assert httpx.post(generate, json=body, headers=bearer, timeout=60).status_code == 200
