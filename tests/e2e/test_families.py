"""Every tool-call family end to end: a scripted model that writes the
family's markup (its markup tokens added to the tokenizer, special where the
family's tokenizers have them so), served with the family's parsers, read
through chat completions (whole and streamed, logprobs on), Responses and
Messages with the official SDKs. Surfaces and streaming agree, and every
token's logprob entry rides with its text.

Engines and worker classes alternate across families (one server each keeps
the suite in budget); both engines run the parser layer the same way, and
tests/engines and tests/parsers hold the rest.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from sluiceway.parsers.formats import FORMATS
from sluiceway.parsers.formats.render import Call, Style, render
from sluiceway.parsers.reasoning import DIALECTS
from tests.e2e import schemas
from tests.e2e.harness import RunningServer, serving, sse_lines
from tests.fixtures.scripted_model import Piece, Script, ScriptedModel, build_scripted_model
from tests.parsers.family_calls import REASONING

FAMILIES = sorted(FORMATS)
SETUPS = [("asyncio", "transformers"), ("trio", "mlx")]
#: Markup the family's own tokenizers mark special (left out of decoded text
#: unless the server reveals it to its parsers).
SPECIAL = {"kimi_k2", "deepseek_v31", "deepseek_v3", "mistral", "llama3_json", "pythonic"}
THOUGHT = "Checking the weather."
LEAD = "Sure. "
ARGUMENTS = {"city": "Paris"}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


class _Tight(Style):
    """No optional whitespace: the markup as tightly as the family allows."""

    def space(self, pre: str) -> str:
        return ""

    def newline(self, pre: str) -> str:
        return ""


def _split(text: str, markup: tuple[str, ...]) -> list[Piece]:
    """``text`` as pieces: each markup text one token, the text between raw bytes."""
    pieces: list[Piece] = []
    rest = text
    while rest:
        found = [(rest.find(m), m) for m in markup if m in rest]
        if not found:
            pieces.append(rest.encode())
            break
        at, mark = min(found)
        if at:
            pieces.append(rest[:at].encode())
        pieces.append(mark)
        rest = rest[at + len(mark) :]
    return pieces


def _markup(family: str) -> tuple[str, ...]:
    dialect = REASONING[family]
    tags = (DIALECTS[dialect].open_tag, DIALECTS[dialect].close_tag) if dialect else ()
    return (*FORMATS[family].special, *tags)


def _script(family: str) -> Script:
    fmt = FORMATS[family]
    dialect = REASONING[family]
    text = ""
    if dialect is not None:
        text += DIALECTS[dialect].open_tag + THOUGHT + DIALECTS[dialect].close_tag
    if not fmt.at_start:
        text += LEAD
    text += render(fmt, [Call("get_weather", ARGUMENTS)], _Tight())
    return Script("call", tuple(_split(text, _markup(family))))


@pytest.fixture(scope="module", params=FAMILIES)
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, ScriptedModel, RunningServer]]:
    name: str = request.param
    special = name in SPECIAL
    added = {text: special for text in _markup(name) if text not in ("<think>", "</think>")}
    model = build_scripted_model(tmp_path_factory.mktemp(name), [_script(name)], added_tokens=added)
    worker_class, engine = SETUPS[FAMILIES.index(name) % len(SETUPS)]
    reasoning = REASONING[name] or "none"
    flags = ("--engine", engine, "--tool-call-parser", name, "--reasoning-parser", reasoning)
    logs = tmp_path_factory.mktemp(f"{name}-logs")
    with serving(model.path, logs, *flags, worker_class=worker_class) as running:
        yield name, model, running


def _fields(model: ScriptedModel) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": TOOLS,
        "temperature": 0,
        "chat_template_kwargs": model.chat_kwargs("call"),
    }


def _expected_id(name: str) -> str | None:
    return "functions.get_weather:0" if FORMATS[name].call_id else None


def test_chat_whole_and_streamed_agree(family: tuple[str, ScriptedModel, RunningServer]) -> None:
    name, model, server = family
    fields = _fields(model)
    with openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0) as client:
        raw = client.chat.completions.with_raw_response.create(
            model=server.model, logprobs=True, top_logprobs=1, **_sdk(fields)
        )
    body = raw.http_response.json()
    schemas.check(body, schemas.CHAT_COMPLETION)
    message = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == ARGUMENTS
    assert call["id"] == (_expected_id(name) or call["id"])
    assert call["id"].startswith("functions." if _expected_id(name) else "call_")
    assert (message.get("reasoning_content") or "") == (THOUGHT if REASONING[name] else "")
    assert (message.get("content") or "") == ("" if FORMATS[name].at_start else LEAD)
    assert body["usage"]["completion_tokens"] == len(model.token_ids("call"))

    streamed = _stream(server, {**fields, "logprobs": True, "top_logprobs": 1})
    assert streamed["calls"] == [
        {"id": call["id"] if _expected_id(name) else streamed["calls"][0]["id"],
         "name": "get_weather", "arguments": call["function"]["arguments"]}
    ]  # fmt: skip
    assert streamed["content"] == (message.get("content") or "")
    assert streamed["reasoning"] == (message.get("reasoning_content") or "")
    assert streamed["entries"] == body["usage"]["completion_tokens"]


def _sdk(fields: dict[str, Any]) -> dict[str, Any]:
    extra = {"chat_template_kwargs": fields["chat_template_kwargs"]}
    rest = {k: v for k, v in fields.items() if k != "chat_template_kwargs"}
    return {**rest, "extra_body": extra}


def _stream(server: RunningServer, fields: dict[str, Any]) -> dict[str, Any]:
    payload = {"model": server.model, "stream": True, **fields}
    response = httpx.post(server.api_url + "/chat/completions", json=payload, timeout=120)
    assert response.status_code == 200, response.text
    lines = [line[6:] for line in sse_lines(response.text) if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    calls: list[dict[str, str]] = []
    content = reasoning = ""
    entries = 0
    for line in lines[:-1]:
        chunk = json.loads(line)
        schemas.check(chunk, schemas.CHAT_CHUNK)
        if not chunk["choices"]:
            continue
        choice = chunk["choices"][0]
        delta = choice["delta"]
        part = delta.get("content") or ""
        content += part
        reasoning += delta.get("reasoning_content") or ""
        logprobs = choice.get("logprobs") or {}
        carried = logprobs.get("content") or []
        if part:
            # A content token's entry rides with the chunk carrying its text.
            assert "".join(e["token"] for e in carried) == part
        entries += sum(len(logprobs.get(k) or []) for k in logprobs)
        for fragment in delta.get("tool_calls") or []:
            if fragment["index"] == len(calls):
                calls.append({"id": fragment["id"], "name": fragment["function"]["name"],
                              "arguments": ""})  # fmt: skip
            calls[fragment["index"]]["arguments"] += fragment["function"].get("arguments") or ""
    return {"calls": calls, "content": content, "reasoning": reasoning, "entries": entries}


def test_responses_carry_the_same_call(family: tuple[str, ScriptedModel, RunningServer]) -> None:
    name, model, server = family
    payload = {
        "model": server.model,
        "input": "Weather in Paris?",
        "temperature": 0,
        "tools": [{"type": "function", **TOOLS[0]["function"]}],
        "chat_template_kwargs": model.chat_kwargs("call"),
    }
    response = httpx.post(server.api_url + "/responses", json=payload, timeout=120)
    assert response.status_code == 200, response.text
    output = response.json()["output"]
    calls = [item for item in output if item["type"] == "function_call"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", ARGUMENTS)]
    expected = _expected_id(name)
    if expected is not None:
        assert calls[0]["call_id"] == expected
    thinking = [item for item in output if item["type"] == "reasoning"]
    assert bool(thinking) == bool(REASONING[name])


def test_messages_carry_the_same_call(family: tuple[str, ScriptedModel, RunningServer]) -> None:
    name, model, server = family
    with anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0) as sdk:
        message = sdk.messages.create(
            model=server.model,
            max_tokens=200,
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=[
                {
                    "name": "get_weather",
                    "input_schema": TOOLS[0]["function"]["parameters"],
                }
            ],
            extra_body={"chat_template_kwargs": model.chat_kwargs("call"), "temperature": 0.0},
        )
    kinds = [block.type for block in message.content]
    uses = [block for block in message.content if block.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [("get_weather", ARGUMENTS)]
    assert ("thinking" in kinds) == bool(REASONING[name])
    assert message.stop_reason == "tool_use"
