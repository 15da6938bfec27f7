"""The Responses API end to end: the scripted model through the real server,
driven raw (httpx, every event checked: framing, order, schemas, SDK
types) and with the official ``openai`` SDK, on every engine and worker
class."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.e2e import schemas
from tests.e2e.harness import (
    RunningServer,
    assert_freed_promptly,
    context_room,
    same_entries,
    seconds_per_token,
)
from tests.e2e.responses_wire import (
    check_response,
    check_stream,
    item_text,
    parse_sse,
    without_ids,
)
from tests.e2e.scripts import CUSTOM_INPUT
from tests.fixtures.scripted_model import ScriptedModel

pytestmark = pytest.mark.e2e

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Apply a patch to files.",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch"'},
}
EXEC = {
    "type": "function",
    "name": "exec_command",
    "description": "Runs a command.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {"cmd": {"type": "string"}},
        "required": ["cmd"],
        "additionalProperties": False,
    },
}
MULTI_AGENT = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Tools for spawning and managing sub-agents.",
    "tools": [
        {
            "type": "function",
            "name": "wait_agent",
            "description": "Wait for agents.",
            "strict": False,
            "parameters": {
                "type": "object",
                "properties": {"targets": {"type": "array", "items": {"type": "string"}}},
                "required": ["targets"],
            },
        },
        {
            "type": "function",
            "name": "close_agent",
            "strict": False,
            "parameters": {"type": "object", "properties": {"target": {"type": "string"}}},
        },
    ],
}
WEB_SEARCH = {"type": "web_search", "external_web_access": False}
#: A strict tool whose schema the grammar engine cannot compile.
BAD_STRICT = {
    "type": "function",
    "name": "bad",
    "strict": True,
    "parameters": {"type": "object", "properties": {"x": {"type": "string", "format": "nope"}}},
}


def body(
    server: RunningServer, scripted: ScriptedModel, script: str, **fields: Any
) -> dict[str, Any]:
    return {
        "model": server.model,
        "input": "What now?",
        "temperature": 0,
        "tools": [WEATHER, APPLY_PATCH],
        "chat_template_kwargs": scripted.chat_kwargs(script),
        **fields,
    }


def post(server: RunningServer, payload: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(server.api_url + "/responses", json=payload, timeout=120)
    assert response.status_code == 200, response.text
    reply: dict[str, Any] = response.json()
    check_response(reply)
    return reply


def stream(server: RunningServer, payload: dict[str, Any]) -> list[dict[str, Any]]:
    response = httpx.post(
        server.api_url + "/responses", json={**payload, "stream": True}, timeout=120
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.text)
    check_stream(events)
    return events


def codex_request(server: RunningServer, scripted: ScriptedModel) -> dict[str, Any]:
    """What Codex sends: developer messages, its tool kinds, replayed items."""
    return {
        "model": server.model,
        "instructions": None,
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are a coding agent."}]},
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "<skills/>"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix the bug."}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Look first."}], "encrypted_content": None},
            {"type": "function_call", "id": "fc_1", "status": "completed", "name": "exec_command", "arguments": '{"cmd": "ls"}', "call_id": "call_1"},
            {"type": "function_call_output", "id": "fco_1", "call_id": "call_1", "output": "main.py\n"},
            {"type": "custom_tool_call", "id": "ctc_1", "status": "completed", "call_id": "call_2", "name": "apply_patch", "input": "*** Begin Patch\n*** End Patch\n"},
            {"type": "custom_tool_call_output", "call_id": "call_2", "output": "Success."},
            {"type": "function_call", "status": "completed", "name": "close_agent", "namespace": "multi_agent_v1", "arguments": '{"target": "a0"}', "call_id": "call_3"},
            {"type": "function_call_output", "call_id": "call_3", "output": [{"type": "input_text", "text": "closed"}]},
            {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant", "content": [{"type": "output_text", "text": "Patched.", "annotations": [], "logprobs": []}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Now wait for the agent."}]},
        ],
        "tools": [EXEC, APPLY_PATCH, MULTI_AGENT, WEB_SEARCH],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "01a2-session",
        "client_metadata": {"thread_id": "01a2"},
        "chat_template_kwargs": scripted.chat_kwargs("namespaced"),
    }  # fmt: skip


def test_codex_shaped_request_streams_a_namespaced_call(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    events = stream(scripted_server, codex_request(scripted_server, scripted))
    assert events[-1]["type"] == "response.completed"
    [call] = events[-1]["response"]["output"]
    assert call["type"] == "function_call"
    assert call["namespace"] == "multi_agent_v1"
    assert call["name"] == "wait_agent"  # apart from its namespace, as Codex resolves it
    assert call["arguments"] == '{"targets": ["agent-1"]}'
    assert call["call_id"].startswith("call_")
    tools = events[-1]["response"]["tools"]
    assert [tool["type"] for tool in tools] == ["function", "custom", "namespace", "web_search"]


def test_custom_tool_call_comes_back_with_its_input(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    payload = body(scripted_server, scripted, "custom_call")
    whole = post(scripted_server, payload)
    reasoning, call = whole["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "\nPatch it.\n"}]
    assert call["type"] == "custom_tool_call"
    assert call["name"] == "apply_patch"
    assert call["input"] == CUSTOM_INPUT
    events = stream(scripted_server, payload)
    inputs = [e for e in events if e["type"].startswith("response.custom_tool_call_input.")]
    assert [e["type"] for e in inputs] == [
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
    ]
    assert inputs[-1]["input"] == CUSTOM_INPUT
    assert without_ids(events[-1]["response"]["output"]) == without_ids(whole["output"])


def chat(server: RunningServer, scripted: ScriptedModel, script: str) -> dict[str, Any]:
    tools = [
        {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
        for tool in (WEATHER,)
    ]
    payload = {
        "model": server.model,
        "messages": [{"role": "user", "content": "What now?"}],
        "temperature": 0,
        "tools": tools,
        "chat_template_kwargs": scripted.chat_kwargs(script),
    }
    response = httpx.post(server.api_url + "/chat/completions", json=payload, timeout=120)
    assert response.status_code == 200, response.text
    message: dict[str, Any] = response.json()["choices"][0]["message"]
    return message


@pytest.mark.parametrize("script", ["reasoning", "tool_call"])
def test_the_same_greedy_request_gives_what_chat_gives(
    scripted_server: RunningServer, scripted: ScriptedModel, script: str
) -> None:
    message = chat(scripted_server, scripted, script)
    with openai.OpenAI(base_url=scripted_server.api_url, api_key="unused") as client:
        response = client.responses.create(
            model=scripted_server.model,
            input="What now?",
            temperature=0,
            tools=[WEATHER],  # type: ignore[list-item]
            extra_body={"chat_template_kwargs": scripted.chat_kwargs(script)},
        )
    items = response.output
    assert items[0].type == "reasoning"
    assert items[0].content is not None
    assert items[0].content[0].text == message["reasoning_content"]
    rest = items[1:]
    if message["content"]:
        assert rest[0].type == "message"
        assert response.output_text == message["content"]
        rest = rest[1:]
    calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []
    ]
    assert [(item.name, item.arguments) for item in rest if item.type == "function_call"] == calls
    assert len(rest) == len(calls)
    assert response.status == "completed"
    assert response.usage is not None
    assert response.usage.output_tokens == len(scripted.token_ids(script))


def without_cached(usage: dict[str, Any]) -> dict[str, Any]:
    details = {k: v for k, v in usage["input_tokens_details"].items() if k != "cached_tokens"}
    return {**usage, "input_tokens_details": details}


@pytest.mark.parametrize("script", ["reasoning", "tool_call", "custom_call"])
def test_stream_concatenations_equal_the_whole_reply(
    scripted_server: RunningServer, scripted: ScriptedModel, script: str
) -> None:
    payload = body(scripted_server, scripted, script)
    whole = post(scripted_server, payload)
    events = stream(scripted_server, payload)
    final = events[-1]["response"]
    assert without_ids(final["output"]) == without_ids(whole["output"])
    # But for cached_tokens: the first of the two requests may find its
    # prompt in the prefix cache or not, depending on what ran before it.
    assert without_cached(final["usage"]) == without_cached(whole["usage"])
    texts = {
        kind: "".join(e["delta"] for e in events if e["type"] == f"response.{kind}.delta")
        for kind in ("output_text", "reasoning_text", "function_call_arguments")
    }
    by_type = {item["type"]: item_text(item) for item in whole["output"]}
    assert texts["output_text"] == by_type.get("message", "")
    assert texts["reasoning_text"] == by_type.get("reasoning", "")
    assert texts["function_call_arguments"] == by_type.get("function_call", "")


def test_sdk_streams_and_stream_helper(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    extra = {"chat_template_kwargs": scripted.chat_kwargs("reasoning")}
    with openai.OpenAI(base_url=scripted_server.api_url, api_key="unused") as client:
        whole = client.responses.create(
            model=scripted_server.model, input="What now?", temperature=0, extra_body=extra
        )
        events = list(
            client.responses.create(
                model=scripted_server.model,
                input="What now?",
                temperature=0,
                stream=True,
                extra_body=extra,
            )
        )
        with client.responses.stream(
            model=scripted_server.model, input="What now?", temperature=0, extra_body=extra
        ) as helper:
            text = "".join(e.delta for e in helper if e.type == "response.output_text.delta")
            final = helper.get_final_response()
    assert whole.output_text == "Use <b>bold</b> when 1 < 2."
    assert events[0].type == "response.created"
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == whole.output_text
    assert text == final.output_text == whole.output_text
    assert [item.type for item in final.output] == ["reasoning", "message"]


@pytest.mark.anyio
async def test_async_sdk_streams(scripted_server: RunningServer, scripted: ScriptedModel) -> None:
    async with openai.AsyncOpenAI(base_url=scripted_server.api_url, api_key="unused") as client:
        events = await client.responses.create(
            model=scripted_server.model,
            input="What now?",
            temperature=0,
            stream=True,
            tools=[WEATHER],  # type: ignore[list-item]
            extra_body={"chat_template_kwargs": scripted.chat_kwargs("tool_call")},
        )
        async with events:
            kinds = [event.type async for event in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds


def delta_entries(events: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    return [
        (e["delta"], e["logprobs"]) for e in events if e["type"] == "response.output_text.delta"
    ]


def assert_first_characters_carry_entries(pieces: list[tuple[str, list[dict[str, Any]]]]) -> None:
    """Each delta carries the entries of exactly the tokens whose first byte
    it carries: with the entries' bytes laid end to end over the text, every
    entry starts inside the delta that carries it."""
    text_at = token_at = 0
    for text, entries in pieces:
        end = text_at + len(text.encode())
        for entry in entries:
            if not text:
                continue  # a token with no text (EOS) rides an empty delta
            assert text_at <= token_at < end, (text, entries)
            token_at += len(entry["bytes"])
        text_at = end


@pytest.mark.parametrize(("script", "limit"), [("reasoning", None), ("bytes_stop", 7)])
def test_logprobs_are_aligned_on_every_delta(
    scripted_server: RunningServer, scripted: ScriptedModel, script: str, limit: int | None
) -> None:
    payload = body(
        scripted_server,
        scripted,
        script,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
        max_output_tokens=limit,
    )
    events = stream(scripted_server, payload)
    pieces = delta_entries(events)
    assert_first_characters_carry_entries(pieces)
    carried = [entry for _, entries in pieces for entry in entries]
    assert all(len(entry["top_logprobs"]) == 2 for entry in carried)
    [message] = [
        item for item in post(scripted_server, payload)["output"] if item["type"] == "message"
    ]
    assert same_entries(message["content"][0]["logprobs"], carried)
    text = message["content"][0]["text"]
    if script == "bytes_stop":
        assert text == "Café costs 3€"
        assert [t for t, _ in pieces if t] == ["Caf", "é", " costs", " 3", "€"]
        assert bytes(b for e in carried for b in e["bytes"]) == text.encode()
    else:
        assert carried[-1]["token"] == "<|im_end|>"
        assert bytes(b for e in carried[:-1] for b in e["bytes"]) == text.encode()


def test_max_output_tokens_ends_incomplete(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    payload = body(scripted_server, scripted, "bytes_stop", max_output_tokens=5)
    whole = post(scripted_server, payload)
    assert whole["status"] == "incomplete"
    assert whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert whole["output"][-1]["status"] == "incomplete"
    assert whole["usage"]["output_tokens"] == 5
    events = stream(scripted_server, payload)
    assert events[-1]["type"] == "response.incomplete"
    assert without_ids(events[-1]["response"]["output"]) == without_ids(whole["output"])


def test_disconnect_cancels_the_response(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    seconds_per_token(scripted_server)  # timed before, on an idle server
    payload = {**body(scripted_server, scripted, "bytes_stop"), "stream": True}
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", scripted_server.api_url + "/responses", json=payload) as response,
    ):
        lines = response.iter_lines()
        while "output_text.delta" not in next(lines):
            pass
        # Leaving the block closes the connection mid-reply.
    closed = time.monotonic()
    assert_freed_promptly(scripted_server, context_room(scripted_server), closed)


def refused(server: RunningServer, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
    response = httpx.request(method, server.api_url + path, timeout=30, **kwargs)
    error: dict[str, Any] = response.json()
    schemas.check(error, schemas.ERROR)
    error["status"] = response.status_code
    return error


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "stateless"),
        ({"conversation": "conv_1"}, "conversation", "stateless"),
        ({"background": True}, "background", "stateless"),
        ({"tools": [WEB_SEARCH], "tool_choice": {"type": "web_search"}}, "tool_choice", "hosted"),
        ({"tools": [{"type": "frobnicate"}]}, "tools[0]", "'frobnicate'"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "frob"}}}}, "text.format", "invalid json_schema"),
        ({"tools": [BAD_STRICT]}, "tools[0].parameters", "nope"),
        ({"tools": [WEB_SEARCH, {**MULTI_AGENT, "tools": [EXEC, BAD_STRICT]}]}, "tools[1].tools[1].parameters", "nope"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "stateless"),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater than"),
        ({"seed": 1}, "seed", "Unrecognized"),
    ],
)  # fmt: skip
def test_refusals_are_400s_in_the_openai_shape(
    scripted_server: RunningServer, fields: dict[str, Any], param: str, words: str
) -> None:
    payload = {"model": scripted_server.model, "input": "hi", **fields}
    error = refused(scripted_server, "POST", "/responses", json=payload)
    assert error["status"] == 400
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["param"] == param
    assert words in error["error"]["message"]


FORECAST: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
FORECAST_FORMAT = {"type": "json_schema", "name": "forecast", "schema": FORECAST, "strict": True}


def test_text_format_json_schema_holds_the_message(server: RunningServer) -> None:
    """The random-weight default model writes only what the schema allows,
    whole and streamed alike."""
    payload = {
        "model": server.model,
        "input": "Describe the weather.",
        "text": {"format": FORECAST_FORMAT},
        "max_output_tokens": 400,
        "temperature": 0,
        # An open <think> of a random model would run to the limit.
        "chat_template_kwargs": {"enable_thinking": False},
    }
    whole = post(server, payload)
    assert whole["status"] == "completed"
    assert whole["text"]["format"] == FORECAST_FORMAT
    jsonschema.validate(json.loads(item_text(whole["output"][-1])), FORECAST)
    events = stream(server, payload)
    assert without_ids(events[-1]["response"]["output"]) == without_ids(whole["output"])


def test_text_format_leaves_reasoning_free(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    """The constraint starts after </think>: the reasoning is the script's."""
    free = post(scripted_server, body(scripted_server, scripted, "custom_call", tools=[]))
    payload = body(
        scripted_server,
        scripted,
        "custom_call",
        tools=[],
        text={"format": FORECAST_FORMAT},
        max_output_tokens=200,
    )
    held = post(scripted_server, payload)
    assert held["output"][0]["type"] == "reasoning"
    assert without_ids(held["output"][:1]) == without_ids(free["output"][:1])
    jsonschema.validate(json.loads(item_text(held["output"][-1])), FORECAST)


def test_unknown_model_and_stored_responses_are_404s(scripted_server: RunningServer) -> None:
    error = refused(scripted_server, "POST", "/responses", json={"model": "gpt-9", "input": "hi"})
    assert error["status"] == 404
    assert error["error"]["code"] == "model_not_found"
    for method, path in [
        ("GET", "/responses/resp_123"),
        ("DELETE", "/responses/resp_123"),
        ("GET", "/responses/resp_123/input_items"),
        ("POST", "/responses/resp_123/cancel"),
    ]:
        error = refused(scripted_server, method, path)
        assert error["status"] == 404
        assert "stateless" in error["error"]["message"]
        assert error["error"]["type"] == "not_found_error"


@pytest.mark.parametrize(
    ("effort", "thinking"), [("none", False), ("minimal", False), ("high", True)]
)
def test_reasoning_effort_switches_thinking_as_chat_does(
    scripted_server: RunningServer, scripted: ScriptedModel, effort: str, thinking: bool
) -> None:
    """With thinking off the template closes ``<think>`` itself, so what the
    model writes is all content, as chat gives it with ``enable_thinking``."""
    payload = {
        "model": scripted_server.model,
        "messages": [{"role": "user", "content": "What now?"}],
        "temperature": 0,
        "chat_template_kwargs": {**scripted.chat_kwargs("reasoning"), "enable_thinking": thinking},
    }
    reply = httpx.post(scripted_server.api_url + "/chat/completions", json=payload, timeout=120)
    message = reply.json()["choices"][0]["message"]
    whole = post(
        scripted_server,
        body(scripted_server, scripted, "reasoning", tools=None, reasoning={"effort": effort}),
    )
    texts = {item["type"]: item_text(item) for item in whole["output"]}
    assert texts == {
        key: value
        for key, value in [
            ("reasoning", message.get("reasoning_content")),
            ("message", message["content"]),
        ]
        if value
    }
    assert ("reasoning" in texts) is thinking


# --- tools through the grammar, as on chat ------------------------------------------------

STRICT_WEATHER = {
    "type": "function",
    "name": "get_weather",
    "strict": True,
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
GET_TIME = {
    "type": "function",
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
}


def calls(output: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(i["name"], json.loads(i["arguments"])) for i in output if i["type"] == "function_call"]


def test_a_strict_tools_arguments_are_held_to_its_schema(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    """The script's unit "kelvin" is outside the strict tool's enum: the
    grammar holds the call to the first unit it allows, whole and streamed."""
    payload = body(scripted_server, scripted, "strict_call", tools=[STRICT_WEATHER, GET_TIME])
    whole = post(scripted_server, payload)
    assert calls(whole["output"]) == [("get_weather", {"city": "Paris", "unit": "c"})]
    assert item_text(whole["output"][0]) == "Let me check."
    events = stream(scripted_server, payload)
    assert without_ids(events[-1]["response"]["output"]) == without_ids(whole["output"])
    loose = {**STRICT_WEATHER, "strict": False}
    free = post(scripted_server, {**payload, "tools": [loose, GET_TIME]})
    assert calls(free["output"]) == [("get_weather", {"city": "Paris", "unit": "kelvin"})]


def test_a_required_call_goes_through_the_grammar_not_the_prompt(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    payload = body(scripted_server, scripted, "required", tools=[STRICT_WEATHER, GET_TIME])
    forced = post(scripted_server, {**payload, "tool_choice": "required"})
    offered = post(scripted_server, {**payload, "tool_choice": "auto"})
    assert forced["usage"]["input_tokens"] == offered["usage"]["input_tokens"]
    assert calls(forced["output"]) == [("get_time", {"tz": "UTC"})]


def test_text_format_beside_tools_gives_the_format_or_calls(server: RunningServer) -> None:
    """The random-weight default model, sampled three times: each reply is a
    message that matches the schema or calls whose arguments match the
    strict tool's."""
    tool = {**STRICT_WEATHER, "parameters": FORECAST}  # bounded: a random model ends it
    for _ in range(3):
        payload = {
            "model": server.model,
            "input": "Describe the weather.",
            "text": {"format": FORECAST_FORMAT},
            "tools": [tool],
            # One call at most: parallel ones of a random model may fill max_output_tokens.
            "parallel_tool_calls": False,
            "max_output_tokens": 400,
            "temperature": 1.0,
            "chat_template_kwargs": {"enable_thinking": False},
        }
        whole = post(server, payload)
        assert whole["status"] == "completed", whole
        items = whole["output"]
        if items[-1]["type"] == "message":
            jsonschema.validate(json.loads(item_text(items[-1])), FORECAST)
        else:
            found = calls(items)
            assert found
            for name, arguments in found:
                assert name == "get_weather"
                jsonschema.validate(arguments, FORECAST)
