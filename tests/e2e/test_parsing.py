"""Reasoning and tool calls end to end, with logprobs on: the scripted model
follows a known token script through the real server and the openai SDK."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.e2e import schemas
from tests.e2e.conftest import DEFAULT_ENGINE_ONLY
from tests.e2e.harness import RunningServer, serving
from tests.fixtures.scripted_model import ScriptedModel

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
        },
    },
]
MESSAGES = [{"role": "user", "content": "What now?"}]


def create(server: RunningServer, scripted: ScriptedModel, script: str, **fields: Any) -> Any:
    with openai.OpenAI(base_url=server.api_url, api_key="unused") as client:
        return client.chat.completions.create(
            model=server.model,
            messages=MESSAGES,  # type: ignore[arg-type]
            extra_body={"chat_template_kwargs": scripted.chat_kwargs(script)},
            **{"logprobs": True, "top_logprobs": 2, **fields},
        )


def stream_chunks(
    server: RunningServer, scripted: ScriptedModel, script: str, **fields: Any
) -> list[dict[str, Any]]:
    payload = {
        "model": server.model,
        "messages": MESSAGES,
        "logprobs": True,
        "top_logprobs": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "chat_template_kwargs": scripted.chat_kwargs(script),
        **fields,
    }
    return schemas.streamed_chat(server.api_url, payload, timeout=60)


def entries(chunk: dict[str, Any], field: str) -> list[dict[str, Any]]:
    logprobs = chunk["choices"][0].get("logprobs") if chunk["choices"] else None
    return list((logprobs or {}).get(field) or [])


def test_reasoning_is_separated_from_content(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    completion = create(scripted_server, scripted, "reasoning")
    choice = completion.choices[0]
    assert choice.message.model_extra["reasoning_content"] == "\nThe user asks for bold.\n"
    assert choice.message.content == "Use <b>bold</b> when 1 < 2."
    assert choice.finish_reason == "stop"
    extra = choice.logprobs.model_extra
    counted = len(choice.logprobs.content) + len(extra["reasoning_content"])
    assert counted == completion.usage.completion_tokens == len(scripted.token_ids("reasoning"))
    assert [e["token"] for e in extra["reasoning_content"]][:2] == ["<think>", "\nThe user"]
    # </think> and the blank line after it are reasoning markup.
    assert [e["token"] for e in extra["reasoning_content"]][-2:] == ["</think>", "\n\n"]
    assert choice.logprobs.content[0].token == "Use"
    assert choice.logprobs.content[-1].token == "<|im_end|>"
    details = completion.usage.completion_tokens_details
    assert details.reasoning_tokens == len(extra["reasoning_content"])


def test_reasoning_streams_with_aligned_entries(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    chunks = stream_chunks(scripted_server, scripted, "reasoning")
    reasoning = content = ""
    all_entries = 0
    for chunk in chunks[1:-1]:
        delta = chunk["choices"][0]["delta"]
        reasoning_part = delta.get("reasoning_content") or ""
        content_part = delta.get("content") or ""
        reasoning += reasoning_part
        content += content_part
        carried_reasoning = entries(chunk, "reasoning_content")
        carried_content = entries(chunk, "content")
        all_entries += len(carried_reasoning) + len(carried_content)
        if content_part and chunk["choices"][0]["finish_reason"] is None:
            # Each content token's entry rides with the chunk carrying its text.
            assert "".join(e["token"] for e in carried_content) == content_part
    assert reasoning == "\nThe user asks for bold.\n"
    assert content == "Use <b>bold</b> when 1 < 2."
    assert all_entries == chunks[-1]["usage"]["completion_tokens"]


def tool_call_deltas(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        call
        for c in chunks
        if c["choices"]
        for call in c["choices"][0]["delta"].get("tool_calls") or []
    ]


def reconstruct(deltas: list[dict[str, Any]]) -> dict[int, dict[str, str]]:
    """Rebuild calls from deltas, checking the streaming rules on the way."""
    calls: dict[int, dict[str, str]] = {}
    for delta in deltas:
        index = delta["index"]
        if index not in calls:
            assert index == len(calls), "indices never jump"
            assert delta["id"].startswith("call_")
            assert delta["type"] == "function"
            assert delta["function"]["arguments"] == ""
            calls[index] = {"id": delta["id"], "name": delta["function"]["name"], "arguments": ""}
        else:
            assert set(delta) == {"index", "function"}
            assert set(delta["function"]) == {"arguments"}
            calls[index]["arguments"] += delta["function"]["arguments"]
    return calls


def test_tool_call_streams_as_clean_deltas(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    chunks = stream_chunks(scripted_server, scripted, "tool_call", tools=TOOLS)
    calls = reconstruct(tool_call_deltas(chunks))
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    arguments_chunks = [d for d in tool_call_deltas(chunks) if "id" not in d]
    assert len(arguments_chunks) >= 2, "arguments stream as they are generated"
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finals[-1] == "tool_calls"
    reasoning = "".join(
        c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks if c["choices"]
    )
    assert reasoning == "\nNeed weather.\n"
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks if c["choices"])
    counted = sum(
        len(entries(c, field))
        for c in chunks
        for field in ("content", "reasoning_content", "tool_calls")
    )
    assert counted == chunks[-1]["usage"]["completion_tokens"]
    whole = create(scripted_server, scripted, "tool_call", tools=TOOLS)
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert call.function.arguments == calls[0]["arguments"]
    assert whole.choices[0].finish_reason == "tool_calls"
    assert whole.choices[0].message.content is None
    logprobs = whole.choices[0].logprobs
    extra = logprobs.model_extra
    # EOS comes after the call: it belongs to the channel then open, content.
    assert [e.token for e in logprobs.content] == ["<|im_end|>"]
    counted = len(extra["tool_calls"]) + len(extra["reasoning_content"]) + len(logprobs.content)
    assert counted == whole.usage.completion_tokens


@pytest.mark.parametrize(
    ("choice", "script", "name", "arguments"),
    [
        (
            {"type": "function", "function": {"name": "get_weather"}},
            "named",
            "get_weather",
            {"city": "Oslo"},
        ),
        ("required", "required", "get_time", {"tz": "UTC"}),
    ],
)
def test_forced_tool_choice_produces_a_call(
    scripted_server: RunningServer,
    scripted: ScriptedModel,
    choice: Any,
    script: str,
    name: str,
    arguments: dict[str, str],
) -> None:
    # vLLM takes logprobs after the grammar's mask, so under --logprobs-mode
    # raw it refuses them with a forced call (docs/engines.md): none asked there.
    plain = {"logprobs": False, "top_logprobs": None} if scripted_server.engine == "vllm" else {}
    chunks = stream_chunks(
        scripted_server, scripted, script, tools=TOOLS, tool_choice=choice, **plain
    )
    calls = reconstruct(tool_call_deltas(chunks))
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [(name, arguments)]
    whole = create(scripted_server, scripted, script, tools=TOOLS, tool_choice=choice, **plain)
    (call,) = whole.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (name, arguments)
    assert whole.choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_leaves_text_as_content(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    whole = create(scripted_server, scripted, "tool_call", tools=TOOLS, tool_choice="none")
    message = whole.choices[0].message
    assert message.tool_calls is None
    assert '<tool_call>\n{"name": "get_weather"' in (message.content or "")
    assert whole.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            "tools[0].function.name",
        ),
    ],
)
def test_bad_tool_requests(
    scripted_server: RunningServer, fields: dict[str, Any], param: str
) -> None:
    payload = {"model": scripted_server.model, "messages": MESSAGES, **fields}
    response = httpx.post(scripted_server.api_url + "/chat/completions", json=payload)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_disabled_thinking_keeps_everything_content(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    payload = {
        "model": scripted_server.model,
        "messages": MESSAGES,
        "chat_template_kwargs": {**scripted.chat_kwargs("reasoning"), "enable_thinking": False},
    }
    reply = httpx.post(
        scripted_server.api_url + "/chat/completions", json=payload, timeout=60
    ).json()
    message = reply["choices"][0]["message"]
    assert "reasoning_content" not in message
    assert message["content"] == scripted.text("reasoning")


@pytest.fixture(scope="module")
def defaults_server(
    scripted: ScriptedModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """The scripted model with template defaults that pick a script and
    turn thinking off, as an operator would set ``enable_thinking``."""
    defaults = json.dumps({**scripted.chat_kwargs("reasoning"), "enable_thinking": False})
    with serving(
        scripted.path, tmp_path_factory.mktemp("logs"), "--default-chat-template-kwargs", defaults
    ) as running:
        yield running


@DEFAULT_ENGINE_ONLY
def test_default_template_kwargs_apply_and_a_request_overrides_them(
    defaults_server: RunningServer, scripted: ScriptedModel
) -> None:
    def message(**fields: Any) -> dict[str, Any]:
        payload = {"model": defaults_server.model, "messages": MESSAGES, **fields}
        reply = httpx.post(defaults_server.api_url + "/chat/completions", json=payload, timeout=60)
        assert reply.status_code == 200, reply.text
        found: dict[str, Any] = reply.json()["choices"][0]["message"]
        return found

    plain = message()  # the defaults alone: the script, thinking off
    assert "reasoning_content" not in plain
    assert plain["content"] == scripted.text("reasoning")
    thinking = message(chat_template_kwargs={"enable_thinking": True})  # one key overridden
    assert thinking["reasoning_content"]
    assert thinking["content"] != scripted.text("reasoning")
    other = message(chat_template_kwargs=scripted.chat_kwargs("tool_call"))
    assert other["content"] == scripted.text("tool_call")  # no tools offered: plain text
