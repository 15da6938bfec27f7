"""Logprobs end to end: exact against a direct forward pass, aligned, cheap."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from httpx_sse import connect_sse

from tests.e2e import schemas
from tests.e2e.conftest import DEFAULT_ENGINE_ONLY
from tests.e2e.harness import RunningServer, serving
from tests.fixtures.scripted_model import ScriptedModel

TOLERANCE = 1e-4


def log_softmax_of(model: Any, ids: list[int]) -> np.ndarray:
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def assert_same_numbers(got: Any, want: Any) -> None:
    """The same structure, strings and ids; floats within ``TOLERANCE``. Two
    requests for the same thing may differ in the last bits of a logprob: the
    second reuses the first's prompt from the prefix cache, and prefills
    only its last token, in a pass of another shape."""
    if isinstance(want, float) and not isinstance(got, bool):
        assert isinstance(got, float | int)
        assert abs(got - want) < TOLERANCE, (got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict)
        assert list(got) == list(want)
        for key in want:
            assert_same_numbers(got[key], want[key])
    elif isinstance(want, list):
        assert isinstance(got, list)
        assert len(got) == len(want)
        for mine, theirs in zip(got, want, strict=True):
            assert_same_numbers(mine, theirs)
    else:
        assert got == want


def token_id(token: str) -> int:
    assert token.startswith("token_id:"), token
    return int(token.removeprefix("token_id:"))


def post(server: RunningServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(server.api_url + path, json=body, timeout=120)
    assert response.status_code == 200, response.text
    reply: dict[str, Any] = response.json()
    return reply


def stream_chunks(server: RunningServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with (
        httpx.Client(timeout=120) as client,
        connect_sse(client, "POST", server.api_url + path, json={**body, "stream": True}) as src,
    ):
        data = [event.data for event in src.iter_sse()]
    assert data[-1] == "[DONE]"
    return [json.loads(item) for item in data[:-1]]


PROMPT_IDS = [1, 370, 265, 201, 42, 75, 2, 201, 1, 1298, 466, 201]


def test_generated_and_prompt_logprobs_match_a_forward_pass(
    server: RunningServer, reference: Any
) -> None:
    body = {
        "model": server.model,
        "prompt": PROMPT_IDS,
        "max_tokens": 12,
        "temperature": 0.8,
        "seed": 11,
        "logprobs": 5,
        "echo": True,
        "prompt_logprobs": 3,
        "return_tokens_as_token_ids": True,
    }
    reply = post(server, "/completions", body)
    choice = reply["choices"][0]
    tokens = [token_id(t) for t in choice["logprobs"]["tokens"]]
    assert tokens[: len(PROMPT_IDS)] == PROMPT_IDS
    expected = log_softmax_of(reference, tokens)
    values = choice["logprobs"]["token_logprobs"]
    assert values[0] is None
    for position in range(1, len(tokens)):
        assert abs(values[position] - expected[position - 1, tokens[position]]) < TOLERANCE
        top = choice["logprobs"]["top_logprobs"][position]
        ranked = np.argsort(-expected[position - 1], kind="stable")[:5]
        assert [token_id(t) for t in top] == ranked.tolist()
        for token, value in top.items():
            assert abs(value - expected[position - 1, token_id(token)]) < TOLERANCE
    prompt_entries = choice["prompt_logprobs"]
    assert prompt_entries[0] is None
    assert len(prompt_entries) == len(PROMPT_IDS)
    for position, entry in enumerate(prompt_entries[1:], start=1):
        assert abs(entry["logprob"] - expected[position - 1, PROMPT_IDS[position]]) < TOLERANCE
        assert len(entry["top_logprobs"]) == 3


def test_chat_entries_match_a_forward_pass(
    server: RunningServer, reference: Any, default_model: Path
) -> None:
    from sluiceway.engines.tokenizer import ModelTokenizer

    messages = [{"role": "user", "content": "Bonjour, ça va ? 😀"}]
    body = {
        "model": server.model,
        "messages": messages,
        "max_tokens": 10,
        "logprobs": True,
        "top_logprobs": 4,
        "temperature": 0,
        "return_tokens_as_token_ids": True,
        "prompt_logprobs": 1,
    }
    reply = post(server, "/chat/completions", body)
    schemas.check(reply, schemas.CHAT_COMPLETION)
    tokenizer = ModelTokenizer(default_model, 0)
    prompt = tokenizer.encode(tokenizer.chat.render(messages).text)
    assert reply["usage"]["prompt_tokens"] == len(prompt)
    entries = reply["choices"][0]["logprobs"]["content"]
    assert len(entries) == reply["usage"]["completion_tokens"] == 10
    generated = [token_id(e["token"]) for e in entries]
    full = log_softmax_of(reference, prompt + generated)
    scored = reply["prompt_logprobs"]
    assert scored[0] is None
    assert len(scored) == len(prompt)
    for position in range(1, len(prompt)):
        assert abs(scored[position]["logprob"] - full[position - 1, prompt[position]]) < TOLERANCE
    for position, entry in enumerate(entries):
        row = full[len(prompt) - 1 + position]
        assert abs(entry["logprob"] - row[generated[position]]) < TOLERANCE
        assert generated[position] == int(np.argmax(row))
        ranked = np.argsort(-row, kind="stable")[:4].tolist()
        assert [token_id(t["token"]) for t in entry["top_logprobs"]] == ranked


def chunk_content(chunk: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    choice = chunk["choices"][0]
    text = choice["delta"].get("content") or ""
    entries = (choice.get("logprobs") or {}).get("content") or []
    return text, entries


def test_partial_characters_travel_with_the_chunk_that_completes_them(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    body = {
        "model": scripted_server.model,
        "messages": [{"role": "user", "content": "price?"}],
        "max_tokens": 7,
        "logprobs": True,
        "top_logprobs": 2,
        "chat_template_kwargs": scripted.chat_kwargs("bytes_stop"),
    }
    chunks = stream_chunks(scripted_server, "/chat/completions", body)
    for chunk in chunks:
        schemas.check(chunk, schemas.CHAT_CHUNK)
    pieces = [chunk_content(c) for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    texts = [text for text, _ in pieces if text]
    assert texts == ["Caf", "é", " costs", " 3", "€"]
    by_text = {text: entries for text, entries in pieces if text}
    # é's two byte tokens ride the chunk that carries é, in order.
    assert [e["bytes"] for e in by_text["é"]] == [[0xC3], [0xA9]]
    assert [e["bytes"] for e in by_text["€"]] == [[0xE2], [0x82, 0xAC]]
    every = [e for _, entries in pieces for e in entries]
    assert bytes(b for e in every for b in e["bytes"]) == "Café costs 3€".encode()
    whole = post(scripted_server, "/chat/completions", body)
    assert_same_numbers(whole["choices"][0]["logprobs"]["content"], every)
    assert whole["choices"][0]["message"]["content"] == "Café costs 3€"


def test_eos_entry_is_counted_and_delivered(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    body = {
        "model": scripted_server.model,
        "prompt": "go" + scripted.selector("reasoning"),
        "max_tokens": 100,
        "logprobs": 0,
    }
    reply = post(scripted_server, "/completions", body)
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop"
    ids = scripted.token_ids("reasoning")
    assert reply["usage"]["completion_tokens"] == len(ids)
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert choice["logprobs"]["tokens"][-1] == "<|im_end|>"
    assert choice["text"] == scripted.text("reasoning")
    offsets = choice["logprobs"]["text_offset"]
    assert offsets == sorted(offsets)
    assert offsets[-1] == len(choice["text"])
    streamed = stream_chunks(scripted_server, "/completions", body)
    entries = [
        t for c in streamed for t in (c["choices"][0]["logprobs"] or {"tokens": []})["tokens"]
    ]
    assert entries == choice["logprobs"]["tokens"]
    offsets_streamed = [
        o
        for c in streamed
        for o in (c["choices"][0]["logprobs"] or {"text_offset": []})["text_offset"]
    ]
    assert offsets_streamed == offsets


@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
def test_streaming_and_whole_replies_carry_the_same_entries(
    server: RunningServer, path: str
) -> None:
    body: dict[str, Any] = {"model": server.model, "max_tokens": 15, "seed": 5, "temperature": 1.0}
    if path == "/completions":
        body |= {"prompt": "The river", "logprobs": 3}
    else:
        body |= {
            "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True,
            "top_logprobs": 3,
        }
    whole = post(server, path, body)["choices"][0]
    chunks = stream_chunks(server, path, body)
    if path == "/completions":
        streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for chunk in chunks:
            logprobs = chunk["choices"][0]["logprobs"] if chunk["choices"] else None
            for key in streamed:
                streamed[key] += (logprobs or {}).get(key, [])
        assert_same_numbers(streamed, whole["logprobs"])
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole["text"]
    else:
        entries = [e for c in chunks if c["choices"] for e in chunk_content(c)[1]]
        assert_same_numbers(entries, whole["logprobs"]["content"])


def test_logprob_token_ids_score_every_position(server: RunningServer, reference: Any) -> None:
    wanted = [5, 77, 300, 1000]
    body = {
        "model": server.model,
        "prompt": PROMPT_IDS,
        "max_tokens": 6,
        "temperature": 0,
        "logprob_token_ids": wanted,
        "return_tokens_as_token_ids": True,
        "logprobs": 0,
    }
    logprobs = post(server, "/completions", body)["choices"][0]["logprobs"]
    generated = [token_id(t) for t in logprobs["tokens"]]
    expected = log_softmax_of(reference, PROMPT_IDS + generated)
    assert len(logprobs["token_id_logprobs"]) == len(generated) == 6
    for position, scores in enumerate(logprobs["token_id_logprobs"]):
        row = expected[len(PROMPT_IDS) - 1 + position]
        assert list(scores) == [str(t) for t in wanted]
        for token in wanted:
            assert abs(scores[str(token)] - row[token]) < TOLERANCE
    chat_body = {
        "model": server.model,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 3,
        "logprob_token_ids": wanted,
        "ignore_eos": True,  # sampled: an early EOS would shorten the reply
    }
    entries = post(server, "/chat/completions", chat_body)["choices"][0]["logprobs"]["content"]
    assert len(entries) == 3
    for entry in entries:
        assert list(entry["token_id_logprobs"]) == [str(t) for t in wanted]
        assert entry["top_logprobs"] == []


@pytest.mark.parametrize(
    ("path", "change", "param"),
    [
        ("/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("/chat/completions", {"logprobs": True, "top_logprobs": 2.5}, "top_logprobs"),
        ("/chat/completions", {"logprobs": "yes"}, "logprobs"),
        ("/chat/completions", {"logprob_token_ids": [10**7]}, "logprob_token_ids"),
        ("/chat/completions", {"logprob_token_ids": list(range(129))}, "logprob_token_ids"),
        ("/chat/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("/completions", {"logprobs": 21}, "logprobs"),
        ("/completions", {"logprobs": -2}, "logprobs"),
        ("/completions", {"suffix": "tail"}, "suffix"),
        ("/completions", {"best_of": 3}, "best_of"),
        ("/completions", {"prompt": [[1, 2], [10**7]]}, "prompt"),
        ("/completions", {"prompt": []}, "prompt"),
        ("/completions", {"prompt": 5}, "prompt"),
    ],
)
def test_bad_logprob_requests(
    server: RunningServer, path: str, change: dict[str, Any], param: str
) -> None:
    base: dict[str, Any] = {"model": server.model, "max_tokens": 2}
    base |= (
        {"prompt": "x"}
        if path == "/completions"
        else {"messages": [{"role": "user", "content": "x"}]}
    )
    response = httpx.post(server.api_url + path, json={**base, **change})
    assert response.status_code == 400, response.text
    body = response.json()
    schemas.check(body, schemas.ERROR)
    assert body["error"]["param"] == param


def test_multiple_prompts_share_one_reply(server: RunningServer) -> None:
    body = {
        "model": server.model,
        "prompt": ["one", "two", "three"],
        "n": 2,
        "max_tokens": 3,
        "seed": 1,
    }
    reply = post(server, "/completions", body)
    assert [c["index"] for c in reply["choices"]] == list(range(6))
    assert reply["usage"]["completion_tokens"] == 18
    chunks = stream_chunks(
        server, "/completions", {**body, "stream_options": {"include_usage": True}}
    )
    assert {c["choices"][0]["index"] for c in chunks if c["choices"]} == set(range(6))
    assert chunks[-1]["usage"]["completion_tokens"] == 18


@pytest.fixture(scope="module")
def processed_server(
    default_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    with serving(
        default_model,
        tmp_path_factory.mktemp("logs"),
        "--logprobs-mode", "processed",
        "--return-tokens-as-token-ids",
        "--max-top-logprobs", "7",
    ) as running:  # fmt: skip
        yield running


# On vLLM, processed mode's mapping is unit-tested (test_vllm_mapping.py): an
# end-to-end run would need a vLLM server of its own, a minute's start.
@DEFAULT_ENGINE_ONLY
def test_processed_mode_reports_the_sampled_distribution(
    processed_server: RunningServer, reference: Any
) -> None:
    body = {
        "model": processed_server.model,
        "prompt": PROMPT_IDS,
        "max_tokens": 5,
        "temperature": 0.5,
        "top_k": 5,
        "seed": 2,
        "logprobs": 7,
    }
    logprobs = post(processed_server, "/completions", body)["choices"][0]["logprobs"]
    generated = [token_id(t) for t in logprobs["tokens"]]  # ids without asking: server flag
    with torch.inference_mode():
        logits = reference(torch.tensor([PROMPT_IDS + generated])).logits[0].double()
    for position, token in enumerate(generated):
        row = logits[len(PROMPT_IDS) - 1 + position] / 0.5
        kept = torch.topk(row, 5).indices
        expected = torch.full_like(row, float("-inf"))
        expected[kept] = torch.log_softmax(row[kept], dim=-1)
        assert abs(logprobs["token_logprobs"][position] - float(expected[token])) < TOLERANCE
        top = logprobs["top_logprobs"][position]
        assert len(top) == 7
        finite = sorted(v for v in top.values() if v > -9999)
        assert len(finite) == 5
        assert sorted(v for v in top.values() if v <= -9999) == [-9999.0, -9999.0]
        assert abs(sum(np.exp(finite)) - 1.0) < 1e-4


@DEFAULT_ENGINE_ONLY
def test_server_cap_on_top_logprobs(processed_server: RunningServer) -> None:
    body = {
        "model": processed_server.model,
        "messages": [{"role": "user", "content": "x"}],
        "logprobs": True,
        "top_logprobs": 8,
    }
    response = httpx.post(processed_server.api_url + "/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "top_logprobs"
