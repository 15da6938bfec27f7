"""Tokens in, tokens out, end to end: ``/inference/v1/generate``,
``return_token_ids`` on chat and completions, ``/tokenize`` and friends."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import numpy as np
import pytest
from httpx_sse import connect_sse

from tests.e2e.harness import RunningServer, assert_freed_promptly, context_room, same_entries
from tests.e2e.test_logprobs import PROMPT_IDS, TOLERANCE, log_softmax_of
from tests.e2e.test_parsing import TOOLS
from tests.fixtures.scripted_model import ScriptedModel

GENERATE = "/inference/v1/generate"
MESSAGES = [{"role": "user", "content": "What now?"}]


def post(server: RunningServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(server.base_url + path, json=body, timeout=120)
    assert response.status_code == 200, response.text
    reply: dict[str, Any] = response.json()
    return reply


def events(server: RunningServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with (
        httpx.Client(timeout=120) as client,
        connect_sse(client, "POST", server.base_url + path, json={**body, "stream": True}) as src,
    ):
        data = [event.data for event in src.iter_sse()]
    assert data[-1] == "[DONE]"
    return [json.loads(item) for item in data[:-1]]


def prompt_of(server: RunningServer, scripted: ScriptedModel, script: str) -> list[int]:
    """The chat prompt that selects ``script``, tokenized by the server."""
    body = {"messages": MESSAGES, "chat_template_kwargs": scripted.chat_kwargs(script)}
    tokens: list[int] = post(server, "/tokenize", body)["tokens"]
    return tokens


def streamed_ids(chunks: list[dict[str, Any]], index: int = 0) -> list[int]:
    return [
        t
        for c in chunks
        for choice in c["choices"]
        if choice["index"] == index
        for t in choice["token_ids"]
    ]


def test_generate_returns_the_scripted_ids(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    prompt = prompt_of(scripted_server, scripted, "reasoning")
    body = {
        "model": scripted_server.model,
        "token_ids": prompt,
        "sampling_params": {"temperature": 0, "logprobs": 1},
    }
    reply = post(scripted_server, GENERATE, body)
    expected = scripted.token_ids("reasoning")  # <think> ... </think>, content, EOS
    (choice,) = reply["choices"]
    assert reply["object"] == "generate"
    assert choice["token_ids"] == expected
    assert (choice["finish_reason"], choice["matched_stop"]) == ("stop", None)
    assert [e["token"] for e in choice["logprobs"]["content"]] == [
        f"token_id:{t}" for t in expected
    ]
    usage = dict(reply["usage"])
    # The prefix cache may serve the prompt once another test has sent it.
    assert 0 <= usage.pop("prompt_tokens_details")["cached_tokens"] < len(prompt)
    assert usage == {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(expected),
        "total_tokens": len(prompt) + len(expected),
    }
    chunks = events(scripted_server, GENERATE, {**body, "stream_options": {"include_usage": True}})
    assert all(c["object"] == "generate.chunk" for c in chunks)
    assert streamed_ids(chunks) == expected
    entries = []
    for chunk in chunks[:-1]:
        # Each id travels at once, with exactly its entry, in the same event.
        (streamed,) = chunk["choices"]
        assert len(streamed["token_ids"]) == 1
        assert [e["token"] for e in streamed["logprobs"]["content"]] == [
            f"token_id:{streamed['token_ids'][0]}"
        ]
        entries += streamed["logprobs"]["content"]
    assert same_entries(entries, choice["logprobs"]["content"])
    # The same prompt a second time reads from the prefix cache: only that differs.
    streamed_usage = dict(chunks[-1]["usage"])
    cached = streamed_usage.pop("prompt_tokens_details")["cached_tokens"]
    assert 0 <= cached < len(prompt)
    assert streamed_usage == {
        k: v for k, v in reply["usage"].items() if k != "prompt_tokens_details"
    }


def test_chat_token_ids_are_the_prompt_and_the_generated_ids(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    """``return_token_ids`` on chat: the prompt ids are what /tokenize gives
    for the same messages (a forced tool call's prefix included); the ids are
    every generated id, markup and EOS included, streaming or not."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    fields = {"tools": TOOLS, "tool_choice": choice}
    chat = {
        "model": scripted_server.model,
        "messages": MESSAGES,
        "chat_template_kwargs": scripted.chat_kwargs("named"),
        "return_token_ids": True,
        "temperature": 0,
        **fields,
    }
    whole = post(scripted_server, "/v1/chat/completions", chat)
    tokenized = {"messages": MESSAGES, "chat_template_kwargs": scripted.chat_kwargs("named")}
    assert (
        whole["prompt_token_ids"]
        == post(scripted_server, "/tokenize", tokenized | fields)["tokens"]
    )
    assert whole["prompt_token_ids"] != post(scripted_server, "/tokenize", tokenized)["tokens"]
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    # A grammar holds the forced call (no prefix in the prompt): the ids are
    # every generated id, and they make the call.
    generated = whole["choices"][0]["token_ids"]
    assert len(generated) > 2
    (call,) = whole["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    chunks = events(scripted_server, "/v1/chat/completions", chat)
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert streamed_ids(chunks) == whole["choices"][0]["token_ids"]
    # The generate endpoint takes the prompt and the reply back as they are.
    again = post(
        scripted_server,
        GENERATE,
        {
            "token_ids": whole["prompt_token_ids"] + generated,
            "sampling_params": {"temperature": 0, "max_tokens": 1},
        },
    )
    assert again["usage"]["prompt_tokens"] == len(whole["prompt_token_ids"]) + len(generated)


def test_chunks_never_carry_text_before_its_ids(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    """Characters split over tokens and a stop string held back over three:
    after every chunk, the ids sent so far cover every character sent."""
    script = scripted.scripts["bytes_stop"]
    table = dict(zip(scripted.piece_ids["bytes_stop"], script.pieces, strict=True))
    body = {
        "model": scripted_server.model,
        "messages": MESSAGES,
        "chat_template_kwargs": scripted.chat_kwargs("bytes_stop"),
        "stop": ["STOP"],
        "max_tokens": 40,
        "return_token_ids": True,
    }
    chunks = events(scripted_server, "/v1/chat/completions", body)
    text, ids = "", []
    for chunk in chunks:
        (choice,) = chunk["choices"]
        text += choice["delta"].get("content") or ""
        ids += choice["token_ids"]
        covered = b"".join(
            piece.encode() if isinstance(piece, str) else piece for piece in (table[t] for t in ids)
        )
        assert covered.decode(errors="ignore").startswith(text)
    assert text == "Café costs 3€ "
    assert ids == scripted.token_ids("bytes_stop")[:10]  # through "P!", which completes STOP


def test_generate_stops_at_stop_strings_and_stop_ids(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    pieces = scripted.token_ids("bytes_stop")  # "Caf" ... " S" "TO" "P!" " tail." (loops)
    prompt = prompt_of(scripted_server, scripted, "bytes_stop")
    for params, ids, matched in [
        ({"stop": ["STOP"]}, pieces[:10], "STOP"),
        ({"stop_token_ids": [pieces[10]]}, pieces[:11], pieces[10]),
        ({"stop": "3€"}, pieces[:7], "3€"),
    ]:
        body = {"token_ids": prompt, "sampling_params": {"max_tokens": 30, **params}}
        choice = post(scripted_server, GENERATE, body)["choices"][0]
        assert (choice["token_ids"], choice["finish_reason"], choice["matched_stop"]) == (
            ids,
            "stop",
            matched,
        )
        chunks = events(scripted_server, GENERATE, body)
        assert streamed_ids(chunks) == ids
        assert (
            chunks[-1]["choices"][0]["finish_reason"],
            chunks[-1]["choices"][0]["matched_stop"],
        ) == (
            "stop",
            matched,
        )
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 13}}
    choice = post(scripted_server, GENERATE, body)["choices"][0]
    assert (choice["token_ids"], choice["finish_reason"]) == ((pieces * 2)[:13], "length")


def test_generate_disconnect_cancels(server: RunningServer) -> None:
    room = context_room(server)
    body = {"token_ids": PROMPT_IDS, "stream": True, "sampling_params": {"ignore_eos": True}}
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", server.base_url + GENERATE, json=body) as reply,
    ):
        lines = reply.iter_lines()
        data = [line for line, _ in zip(lines, range(6), strict=False) if line.startswith("data:")]
        assert len(data) >= 3
    assert_freed_promptly(server, left=room, since=time.monotonic())


def test_generate_logprobs_match_a_forward_pass(server: RunningServer, reference: Any) -> None:
    body = {
        "model": server.model,
        "token_ids": PROMPT_IDS,
        "sampling_params": {
            "max_tokens": 10,
            "temperature": 0.8,
            "seed": 11,
            "logprobs": 4,
            "prompt_logprobs": 3,
        },
    }
    reply = post(server, GENERATE, body)
    (choice,) = reply["choices"]
    generated = choice["token_ids"]
    expected = log_softmax_of(reference, PROMPT_IDS + generated)
    for position, entry in enumerate(choice["logprobs"]["content"]):
        row = expected[len(PROMPT_IDS) - 1 + position]
        assert entry["token"] == f"token_id:{generated[position]}"
        assert abs(entry["logprob"] - row[generated[position]]) < TOLERANCE
        ranked = np.argsort(-row, kind="stable")[:4].tolist()
        assert [int(t["token"].removeprefix("token_id:")) for t in entry["top_logprobs"]] == ranked
    scored = reply["prompt_logprobs"]
    assert scored[0] is None
    assert len(scored) == len(PROMPT_IDS)
    for position in range(1, len(PROMPT_IDS)):
        row = expected[position - 1]
        target = PROMPT_IDS[position]
        mine = scored[position][str(target)]
        assert abs(mine["logprob"] - row[target]) < TOLERANCE
        # Its rank, up to values closer than the tolerance.
        low = int((row > row[target] + TOLERANCE).sum()) + 1
        high = int((row > row[target] - TOLERANCE).sum()) + 1
        assert low <= mine["rank"] <= high
        # Then the top 3 (the prompt token among them or not).
        assert set(np.argsort(-row, kind="stable")[:3].tolist()) <= {
            int(t) for t in scored[position]
        }
        for key, value in scored[position].items():
            assert abs(value["logprob"] - row[int(key)]) < TOLERANCE
    streamed = events(server, GENERATE, body)
    assert streamed_ids(streamed) == generated
    assert streamed[0]["prompt_logprobs"] == scored


def test_generate_n_with_a_seed_reproduces(server: RunningServer) -> None:
    body = {
        "token_ids": PROMPT_IDS,
        "sampling_params": {"n": 3, "max_tokens": 8, "temperature": 1.0, "seed": 7},
    }
    first = post(server, GENERATE, body)
    again = post(server, GENERATE, body)
    ids = [c["token_ids"] for c in first["choices"]]
    assert ids == [c["token_ids"] for c in again["choices"]]
    assert len({tuple(i) for i in ids}) > 1  # each choice draws its own stream
    chunks = events(server, GENERATE, body)
    assert [streamed_ids(chunks, index) for index in range(3)] == ids


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": [1, -1]}, "token_ids"),
        ({"token_ids": [1, 10**9]}, "token_ids"),
        ({"token_ids": [1], "sampling_params": {"logprobs": 10**6}}, "sampling_params.logprobs"),
        ({"token_ids": [1], "sampling_params": {"n": 10**3}}, "sampling_params.n"),
        ({"token_ids": [1], "sampling_params": {"best_of": 2}}, "sampling_params.best_of"),
        ({"token_ids": [1], "sampling_params": {"stop": [""]}}, "sampling_params.stop"),
        ({"token_ids": [1], "cache_salt": "x"}, "cache_salt"),
        ({"token_ids": "1"}, "token_ids"),
    ],
)
def test_bad_generate_requests_get_400_naming_the_field(
    server: RunningServer, body: dict[str, Any], param: str
) -> None:
    response = httpx.post(server.base_url + GENERATE, json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)


def test_a_prompt_without_room_gets_400(server: RunningServer) -> None:
    room = context_room(server, prompt=0)
    response = httpx.post(server.base_url + GENERATE, json={"token_ids": [1] * room}, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("token_ids", "context_length_exceeded")


def test_tokenize_detokenize_and_tokenizer_info(server: RunningServer) -> None:
    chat = {"model": server.model, "messages": MESSAGES, "max_tokens": 1, "return_token_ids": True}
    prompt_ids = post(server, "/v1/chat/completions", chat)["prompt_token_ids"]
    tokenized = post(server, "/tokenize", {"messages": MESSAGES, "return_token_strs": True})
    assert tokenized["tokens"] == prompt_ids
    assert tokenized["count"] == len(prompt_ids)
    assert tokenized["max_model_len"] == context_room(server, prompt=0)
    assert len(tokenized["token_strs"]) == len(prompt_ids)
    text = post(server, "/detokenize", {"tokens": prompt_ids})["prompt"]
    assert "What now?" in text
    assert "<|im_start|>" in text  # special tokens stay, as in vLLM
    plain = post(server, "/tokenize", {"prompt": "What now?"})
    completion = post(
        server,
        "/v1/completions",
        {"model": server.model, "prompt": "What now?", "max_tokens": 1, "return_token_ids": True},
    )
    assert completion["choices"][0]["prompt_token_ids"] == plain["tokens"]
    assert post(server, "/detokenize", {"tokens": plain["tokens"]})["prompt"] == "What now?"
    bare = post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert prompt_ids[: bare["count"]] == bare["tokens"]
    assert bare["count"] < len(prompt_ids)
    opened = [*MESSAGES, {"role": "assistant", "content": "Sure"}]
    continued = post(
        server,
        "/tokenize",
        {"messages": opened, "add_generation_prompt": False, "continue_final_message": True},
    )
    assert post(server, "/detokenize", {"tokens": continued["tokens"]})["prompt"].endswith("Sure")
    both = {"messages": opened, "continue_final_message": True}
    assert httpx.post(server.base_url + "/tokenize", json=both, timeout=30).status_code == 400
    info = httpx.get(server.base_url + "/tokenizer_info", timeout=30).json()
    assert info["tokenizer_class"]
    assert "{%" in info["chat_template"]
    assert info["eos_token"] == "<|im_end|>"
    assert "model_max_length" in info
    assert "name_or_path" not in info
    response = httpx.post(server.base_url + "/detokenize", json={"tokens": [10**9]}, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tokens"
