"""Stop conditions end to end: text, token ids and logprobs released together."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.e2e import schemas
from tests.e2e.conftest import DEFAULT_ENGINE_ONLY
from tests.e2e.harness import RunningServer, same_entries, sse_lines, start_server
from tests.fixtures.scripted_model import ScriptedModel

SCRIPT = "bytes_stop"  # "Caf" "é" " costs" " 3" "€" " S" "TO" "P!" " tail." and again


def chat(server: RunningServer, scripted: ScriptedModel, **fields: Any) -> dict[str, Any]:
    payload = {
        "model": server.model,
        "messages": [{"role": "user", "content": "price?"}],
        "max_tokens": 40,
        "logprobs": True,
        "chat_template_kwargs": scripted.chat_kwargs(SCRIPT),
        **fields,
    }
    response = httpx.post(server.api_url + "/chat/completions", json=payload, timeout=60)
    assert response.status_code == 200, response.text
    if not fields.get("stream"):
        reply: dict[str, Any] = response.json()
        schemas.check(reply, schemas.CHAT_COMPLETION)
        return reply
    return {
        "chunks": [
            json.loads(line[6:]) for line in sse_lines(response.text) if line.startswith("data: {")
        ]
    }


def streamed(
    server: RunningServer, scripted: ScriptedModel, **fields: Any
) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    chunks = chat(server, scripted, stream=True, **fields)["chunks"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    entries = [
        e
        for c in chunks
        if c["choices"]
        for e in ((c["choices"][0]["logprobs"] or {}).get("content") or [])
    ]
    final = next(
        c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]
    )
    return text, entries, final


def test_stop_string_across_three_tokens(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    whole = chat(scripted_server, scripted, stop=["STOP"])
    choice = whole["choices"][0]
    assert choice["message"]["content"] == "Café costs 3€ "
    assert choice["finish_reason"] == "stop"
    assert choice["matched_stop"] == "STOP"
    # Ten tokens up to "P!" were generated; each has exactly one entry.
    assert whole["usage"]["completion_tokens"] == 10
    assert len(choice["logprobs"]["content"]) == 10
    text, entries, final = streamed(scripted_server, scripted, stop=["STOP"])
    assert text == choice["message"]["content"]
    assert same_entries(entries, choice["logprobs"]["content"])
    assert (final["finish_reason"], final["matched_stop"]) == ("stop", "STOP")


def test_stream_never_shows_stop_text(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    chunks = chat(scripted_server, scripted, stream=True, stop=["STOP", "ts 3"])["chunks"]
    shown = ""
    for chunk in chunks:
        if chunk["choices"]:
            shown += chunk["choices"][0]["delta"].get("content") or ""
            assert "ts 3" not in shown
    assert shown == "Café cos"


def test_include_stop_str_in_output(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    whole = chat(scripted_server, scripted, stop=["STOP"], include_stop_str_in_output=True)
    assert whole["choices"][0]["message"]["content"] == "Café costs 3€ STOP"
    text, _, final = streamed(
        scripted_server, scripted, stop=["STOP"], include_stop_str_in_output=True
    )
    assert text == "Café costs 3€ STOP"
    assert final["matched_stop"] == "STOP"


def test_stop_token_id(scripted_server: RunningServer, scripted: ScriptedModel) -> None:
    costs = scripted.piece_ids[SCRIPT][3]
    whole = chat(scripted_server, scripted, stop_token_ids=[costs])
    choice = whole["choices"][0]
    assert choice["message"]["content"] == "Café"
    assert (choice["finish_reason"], choice["matched_stop"]) == ("stop", costs)
    assert whole["usage"]["completion_tokens"] == 4
    assert [e["token"] for e in choice["logprobs"]["content"]][-1] == " costs"
    _, entries, final = streamed(scripted_server, scripted, stop_token_ids=[costs])
    assert same_entries(entries, choice["logprobs"]["content"])
    assert final["matched_stop"] == costs


def test_min_tokens_defers_stops(scripted_server: RunningServer, scripted: ScriptedModel) -> None:
    # " costs" is token 3; with min_tokens 5 only its second appearance (token 14) counts.
    whole = chat(scripted_server, scripted, stop=["costs"], min_tokens=5)
    assert whole["choices"][0]["message"]["content"] == "Café costs 3€ STOP! tail.Café "
    assert whole["usage"]["completion_tokens"] == 15


def test_completions_share_the_stop_semantics(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    with openai.OpenAI(base_url=scripted_server.api_url, api_key="unused") as client:
        completion = client.completions.create(
            model=scripted_server.model,
            prompt="x" + scripted.selector(SCRIPT),
            stop=["STOP"],
            max_tokens=50,
            logprobs=1,
        )
        streamed_text = "".join(
            c.choices[0].text
            for c in client.completions.create(
                model=scripted_server.model,
                prompt="x" + scripted.selector(SCRIPT),
                stop=["STOP"],
                max_tokens=50,
                stream=True,
            )
        )
    choice = completion.choices[0]
    assert choice.text == streamed_text == "Café costs 3€ "
    assert choice.finish_reason == "stop"
    assert choice.model_extra["matched_stop"] == "STOP"
    assert len(choice.logprobs.tokens) == completion.usage.completion_tokens == 10


def test_length_when_no_stop_matches(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    whole = chat(scripted_server, scripted, stop=["never"], max_tokens=6)
    choice = whole["choices"][0]
    assert (choice["finish_reason"], choice["matched_stop"]) == ("length", None)
    # The reply ends inside "€": the incomplete character is flushed as U+FFFD.
    assert choice["message"]["content"] == "Café costs 3\ufffd"
    assert choice["logprobs"]["content"][-1]["bytes"] == [0xE2]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stop": [str(i) for i in range(17)]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [10**7]}, "stop_token_ids"),
        ({"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
        ({"messages": [{"role": "user", "content": "word " * 9000}]}, "messages"),
    ],
)
def test_bad_stop_requests(
    scripted_server: RunningServer, fields: dict[str, Any], param: str
) -> None:
    payload = {
        "model": scripted_server.model,
        "messages": [{"role": "user", "content": "x"}],
        **fields,
    }
    response = httpx.post(scripted_server.api_url + "/chat/completions", json=payload, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.fixture(scope="module")
def reasoning_stop_server(
    scripted: ScriptedModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    running = start_server(
        scripted.path,
        worker_class="asyncio",
        log_dir=tmp_path_factory.mktemp("logs"),
        name="scripted",
        extra_args=["--stop-in-reasoning"],
    )
    yield running
    running.stop()


def stop_in_reasoning(scripted: ScriptedModel) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": "x"}],
        "stop": ["asks"],
        "chat_template_kwargs": scripted.chat_kwargs("reasoning"),
    }


def test_stops_skip_reasoning(scripted_server: RunningServer, scripted: ScriptedModel) -> None:
    payload = stop_in_reasoning(scripted)
    default = httpx.post(
        scripted_server.api_url + "/chat/completions",
        json={**payload, "model": scripted_server.model},
    ).json()["choices"][0]
    assert default["message"]["reasoning_content"] == "\nThe user asks for bold.\n"
    assert default["matched_stop"] is None


@DEFAULT_ENGINE_ONLY
def test_stops_in_reasoning_when_asked(
    reasoning_stop_server: RunningServer, scripted: ScriptedModel
) -> None:
    payload = stop_in_reasoning(scripted)
    inside = httpx.post(
        reasoning_stop_server.api_url + "/chat/completions",
        json={**payload, "model": reasoning_stop_server.model},
    ).json()["choices"][0]
    assert inside["message"]["reasoning_content"] == "\nThe user "
    assert (inside["finish_reason"], inside["matched_stop"]) == ("stop", "asks")
