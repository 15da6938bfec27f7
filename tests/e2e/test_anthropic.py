"""The Messages API end to end: real Hypercorn, the official ``anthropic`` SDK
(sync and async) and raw SSE, on the scripted model, both engines and both
worker classes. The same greedy request gives the same blocks as chat
completions gives reasoning, content and tool calls."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent, Usage
from httpx_sse import connect_sse
from pydantic import TypeAdapter

from tests.e2e import anthropic_schemas as schemas
from tests.e2e.conftest import ALL_SETUPS, DEFAULT_ENGINE_ONLY, ON_VLLM, VLLM
from tests.e2e.harness import (
    RunningServer,
    assert_freed_promptly,
    context_room,
    seconds_per_token,
    serving,
)
from tests.fixtures.scripted_model import ScriptedModel

WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
TIME = {
    "name": "get_time",
    "input_schema": {"type": "object", "properties": {"tz": {"type": "string"}}},
}
TOOLS = [WEATHER, TIME]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": t["name"], "parameters": t["input_schema"]}
        | ({"description": t["description"]} if "description" in t else {}),
    }
    for t in TOOLS
]
MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": "What now?"}]
EVENTS = TypeAdapter(RawMessageStreamEvent)

#: For what does not depend on the engine or the worker class (request
#: checks, error shapes, template switches): one of the session's servers,
#: asyncio-transformers (vLLM's under ``make test-vllm``: no other start).
ONE_SETUP = pytest.mark.parametrize(
    "scripted_server", [VLLM[0] if ON_VLLM else ALL_SETUPS[2]], indirect=True
)


def client(server: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


def script_body(scripted: ScriptedModel, script: str) -> dict[str, Any]:
    """Greedy, on a script (the SDK sends both as extra body fields)."""
    return {"chat_template_kwargs": scripted.chat_kwargs(script), "temperature": 0.0}


def create(server: RunningServer, scripted: ScriptedModel, script: str, **fields: Any) -> Message:
    """``messages.create`` through the SDK, its raw reply checked against the
    published shape."""
    with client(server) as sdk:
        raw = sdk.messages.with_raw_response.create(
            model=server.model,
            max_tokens=fields.pop("max_tokens", 200),
            messages=fields.pop("messages", MESSAGES),
            extra_body=script_body(scripted, script),
            **fields,
        )
        schemas.check(raw.http_response.json(), schemas.MESSAGE)
        return raw.parse()


def raw_events(
    server: RunningServer, body: dict[str, Any], path: str = "/v1/messages"
) -> list[tuple[str, dict[str, Any]]]:
    """(``event:`` line, parsed data) of each event, each checked against the
    published shapes and the SDK's event types."""
    with (
        httpx.Client(timeout=120) as http,
        connect_sse(http, "POST", server.base_url + path, json={**body, "stream": True}) as source,
    ):
        assert source.response.status_code == 200, source.response.read()
        assert source.response.headers["content-type"].startswith("text/event-stream")
        events = [(event.event, json.loads(event.data)) for event in source.iter_sse()]
    for name, data in events:
        schemas.check_event(name, data)
        if name != "error":
            EVENTS.validate_python(data)
    return events


def assert_well_formed(events: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The events come in the published order; returns the message they build
    (content blocks with their text concatenated, tool inputs parsed)."""
    names = [name for name, _ in events if name != "ping"]
    assert names[0] == "message_start"
    assert names[-2:] == ["message_delta", "message_stop"]
    message = events[0][1]["message"]
    assert message["content"] == []
    assert message["stop_reason"] is None
    blocks: list[dict[str, Any]] = []
    open_index = None
    for name, data in events[1:]:
        if name == "content_block_start":
            assert open_index is None, "a block opens only after the last one closed"
            assert data["index"] == len(blocks)
            open_index = data["index"]
            blocks.append({**data["content_block"], "partial_json": ""})
        elif name == "content_block_delta":
            assert data["index"] == open_index
            block, delta = blocks[open_index], data["delta"]
            field = {"text_delta": "text", "thinking_delta": "thinking"}.get(delta["type"])
            if field:
                block[field] += delta[field]
            elif delta["type"] == "input_json_delta":
                block["partial_json"] += delta["partial_json"]
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
        elif name == "message_delta":
            assert open_index is None
            message |= data["delta"]
            message["usage"] |= data["usage"]
    for block in blocks:
        partial = block.pop("partial_json")
        if block["type"] == "tool_use":
            block["input"] = json.loads(partial)  # the pieces make one JSON object
    message["content"] = blocks
    schemas.check(message, schemas.MESSAGE)
    return message


def chat(server: RunningServer, scripted: ScriptedModel, script: str, **fields: Any) -> Any:
    with openai.OpenAI(base_url=server.api_url, api_key="unused") as sdk:
        return sdk.chat.completions.create(
            model=server.model,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=200,
            temperature=0,
            extra_body={"chat_template_kwargs": scripted.chat_kwargs(script)},
            **fields,
        )


def prompt_tokens(usage: Usage) -> int:
    """The whole prompt: Anthropic counts the part read from the cache apart."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def prompt_length(usage: dict[str, Any]) -> int:
    """:func:`prompt_tokens` of a usage as the wire has it."""
    return int(usage["input_tokens"]) + int(usage.get("cache_read_input_tokens") or 0)


def blocks_of(message: Message) -> list[tuple[str, Any]]:
    return [
        (block.type, block.input if block.type == "tool_use" else getattr(block, block.type))
        for block in message.content
    ]


@pytest.mark.parametrize("script", ["reasoning", "tool_call"])
def test_blocks_equal_chats_reasoning_content_and_tool_calls(
    scripted_server: RunningServer, scripted: ScriptedModel, script: str
) -> None:
    message = create(scripted_server, scripted, script, tools=TOOLS)
    reply = chat(scripted_server, scripted, script, tools=CHAT_TOOLS).choices[0]
    expected: list[tuple[str, Any]] = [("thinking", reply.message.model_extra["reasoning_content"])]
    if reply.message.content:
        expected.append(("text", reply.message.content))
    for call in reply.message.tool_calls or ():
        expected.append(("tool_use", json.loads(call.function.arguments)))
    assert blocks_of(message) == expected
    assert message.stop_reason == ("tool_use" if script == "tool_call" else "end_turn")
    assert message.stop_sequence is None
    for block in message.content:
        if block.type == "tool_use":
            assert block.id.startswith("toolu_")
            assert block.name == "get_weather"
        if block.type == "thinking":
            assert block.signature == ""
    assert message.usage.output_tokens == len(scripted.token_ids(script))
    # The same request streamed builds the same message.
    body = {
        "model": scripted_server.model,
        "max_tokens": 200,
        "messages": MESSAGES,
        "tools": TOOLS,
        **script_body(scripted, script),
    }
    streamed = assert_well_formed(raw_events(scripted_server, body))
    whole = message.model_dump(mode="json", exclude_none=True)
    for block, other in zip(streamed["content"], whole["content"], strict=True):
        block.pop("id", None)  # each reply mints its own
        other.pop("id", None)
    assert streamed["content"] == whole["content"]
    # the second of two equal prompts reads from the prefix cache: the split
    # differs, the prompt's length and the output do not
    assert prompt_length(streamed["usage"]) == prompt_length(whole["usage"])
    assert streamed["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
    assert streamed["stop_reason"] == whole["stop_reason"]


def test_stream_helpers_and_count_tokens(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    fields = {"model": scripted_server.model, "max_tokens": 200, "messages": MESSAGES}
    with client(scripted_server) as sdk:
        with sdk.messages.stream(
            **fields, tools=TOOLS, extra_body=script_body(scripted, "tool_call")
        ) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_message()
        assert kinds[0] == "message_start"
        assert kinds[-1] == "message_stop"
        assert blocks_of(final) == [
            ("thinking", "\nNeed weather.\n"),
            ("tool_use", {"city": "Paris"}),
        ]
        assert final.stop_reason == "tool_use"
        with sdk.messages.stream(**fields, extra_body=script_body(scripted, "reasoning")) as stream:
            assert "".join(stream.text_stream) == "Use <b>bold</b> when 1 < 2."
            assert stream.get_final_text() == "Use <b>bold</b> when 1 < 2."
        count = sdk.messages.count_tokens(
            model=scripted_server.model,
            messages=MESSAGES,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            system="Be brief.",
            extra_body={"chat_template_kwargs": scripted.chat_kwargs("reasoning")},
        )
        assert isinstance(count, MessageTokensCount)
        message = sdk.messages.create(
            **fields,
            tools=TOOLS,  # type: ignore[arg-type]
            system="Be brief.",
            extra_body=script_body(scripted, "reasoning"),
        )
        assert count.input_tokens == prompt_tokens(message.usage)
        listed = sdk.models.list()
        assert [model.id for model in listed.data] == [scripted_server.model]
        assert sdk.models.retrieve(scripted_server.model).max_input_tokens == context_room(
            scripted_server, prompt=0
        )


@pytest.mark.anyio
async def test_async_sdk_creates_and_streams(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    async with anthropic.AsyncAnthropic(
        base_url=scripted_server.base_url, api_key="unused", max_retries=0
    ) as sdk:
        fields = {"model": scripted_server.model, "max_tokens": 200, "messages": MESSAGES}
        created = await sdk.messages.create(
            **fields,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            extra_body=script_body(scripted, "tool_call"),
        )
        async with sdk.messages.stream(
            **fields,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            extra_body=script_body(scripted, "tool_call"),
        ) as stream:
            final = await stream.get_final_message()
        count = await sdk.messages.count_tokens(
            model=scripted_server.model,
            messages=MESSAGES,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            extra_body={"chat_template_kwargs": scripted.chat_kwargs("tool_call")},
        )
    assert blocks_of(created) == blocks_of(final)
    assert [block.type for block in final.content] == ["thinking", "tool_use"]
    assert count.input_tokens == prompt_tokens(created.usage) == prompt_tokens(final.usage)


def test_a_repeated_prompt_is_read_from_the_cache(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    system = "Answer as a weather bot would. " * 20  # a long prefix both requests share
    first = create(scripted_server, scripted, "reasoning", system=system)
    again = create(scripted_server, scripted, "reasoning", system=system)
    with client(scripted_server) as sdk:
        with sdk.messages.stream(
            model=scripted_server.model,
            max_tokens=200,
            messages=MESSAGES,  # type: ignore[arg-type]
            system=system,
            extra_body=script_body(scripted, "reasoning"),
        ) as stream:
            streamed = stream.get_final_message()
        count = sdk.messages.count_tokens(
            model=scripted_server.model,
            messages=MESSAGES,  # type: ignore[arg-type]
            system=system,
            extra_body={"chat_template_kwargs": scripted.chat_kwargs("reasoning")},
        )
    assert blocks_of(first) == blocks_of(again) == blocks_of(streamed)
    for usage in (again.usage, streamed.usage):
        # all but the prompt's last token (its logits are needed) can be reused
        assert usage.cache_read_input_tokens is not None
        assert usage.cache_read_input_tokens > count.input_tokens // 2
        assert usage.input_tokens == count.input_tokens - usage.cache_read_input_tokens >= 1
        assert usage.cache_creation_input_tokens == 0


def test_stop_sequence_across_token_boundaries(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    # "Caf" "é" " costs" " 3" "€" " S" "TO" "P!" ...: STOP spans three tokens.
    message = create(scripted_server, scripted, "bytes_stop", stop_sequences=["STOP"])
    assert blocks_of(message) == [("text", "Café costs 3€ ")]
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "STOP")
    body = {
        "model": scripted_server.model,
        "max_tokens": 40,
        "messages": MESSAGES,
        "stop_sequences": ["STOP"],
        **script_body(scripted, "bytes_stop"),
    }
    streamed = assert_well_formed(raw_events(scripted_server, body))
    assert streamed["content"] == [{"type": "text", "text": "Café costs 3€ "}]
    assert (streamed["stop_reason"], streamed["stop_sequence"]) == ("stop_sequence", "STOP")


def test_max_tokens_ends_with_max_tokens(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    message = create(scripted_server, scripted, "bytes_stop", max_tokens=4)
    assert blocks_of(message) == [("text", "Café costs")]
    assert (message.stop_reason, message.usage.output_tokens) == ("max_tokens", 4)


def test_tool_result_round_trip_renders_as_chat_does(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    """The call and its result go back to the model: the prompt is the one
    chat completions renders for the same turns, and the answer follows."""
    called = create(scripted_server, scripted, "tool_call", tools=TOOLS)
    thinking, tool_use = called.content
    assert tool_use.type == "tool_use"
    result = "Sunny, 21 degrees."
    turns = [
        *MESSAGES,
        {"role": "assistant", "content": [block.model_dump() for block in called.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": result}],
        },
    ]
    answer = create(scripted_server, scripted, "reasoning", tools=TOOLS, messages=turns)
    assert [block.type for block in answer.content] == ["thinking", "text"]
    arguments = json.dumps(tool_use.input)
    chat_turns = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": getattr(thinking, "thinking", ""),
            "tool_calls": [
                {
                    "id": tool_use.id,
                    "type": "function",
                    "function": {"name": tool_use.name, "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": tool_use.id, "content": result},
    ]
    with openai.OpenAI(base_url=scripted_server.api_url, api_key="unused") as sdk:
        same = sdk.chat.completions.create(
            model=scripted_server.model,
            messages=chat_turns,  # type: ignore[arg-type]
            tools=CHAT_TOOLS,  # type: ignore[arg-type]
            extra_body={"chat_template_kwargs": scripted.chat_kwargs("reasoning")},
        )
    assert prompt_tokens(answer.usage) == same.usage.prompt_tokens
    longer = [
        *turns[:-1],
        {**turns[-1], "content": [{**turns[-1]["content"][0], "content": result * 2}]},
    ]
    with client(scripted_server) as sdk:
        grown = sdk.messages.count_tokens(
            model=scripted_server.model,
            messages=longer,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            extra_body={"chat_template_kwargs": scripted.chat_kwargs("reasoning")},
        )
    assert grown.input_tokens > answer.usage.input_tokens  # the result is in the prompt


def test_arguments_that_are_not_json_still_give_an_object(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    """The model writes ``{"city": Paris}``: chat relays it as written; the
    Messages API promises an object, so the input keeps what was valid."""
    raw = chat(scripted_server, scripted, "bad_arguments", tools=CHAT_TOOLS).choices[0]
    assert raw.message.tool_calls[0].function.arguments == '{"city": Paris}'
    message = create(scripted_server, scripted, "bad_arguments", tools=TOOLS)
    assert blocks_of(message) == [("tool_use", {"city": None})]
    body = {
        "model": scripted_server.model,
        "max_tokens": 50,
        "messages": MESSAGES,
        "tools": TOOLS,
        **script_body(scripted, "bad_arguments"),
    }
    streamed = assert_well_formed(raw_events(scripted_server, body))
    assert [block["input"] for block in streamed["content"]] == [{"city": None}]
    with (
        client(scripted_server) as sdk,
        sdk.messages.stream(
            model=scripted_server.model,
            max_tokens=50,
            messages=MESSAGES,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            extra_body=script_body(scripted, "bad_arguments"),
        ) as stream,
    ):
        assert blocks_of(stream.get_final_message()) == [("tool_use", {"city": None})]


@ONE_SETUP
@pytest.mark.parametrize(
    ("thinking", "effort", "thinks"),
    [
        ({"type": "enabled", "budget_tokens": 2048}, None, True),
        ({"type": "adaptive"}, "high", True),
        ({"type": "adaptive"}, "low", False),
        ({"type": "disabled"}, None, False),
        (None, "low", False),
    ],
)
def test_thinking_switch(
    scripted_server: RunningServer,
    scripted: ScriptedModel,
    thinking: dict[str, Any] | None,
    effort: str | None,
    thinks: bool,
) -> None:
    body: dict[str, Any] = {"model": scripted_server.model, "max_tokens": 100, "messages": MESSAGES}
    if thinking is not None:
        body["thinking"] = thinking
    if effort is not None:
        body["output_config"] = {"effort": effort}
    response = httpx.post(
        scripted_server.base_url + "/v1/messages",
        json={**body, **script_body(scripted, "reasoning")},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    kinds = [block["type"] for block in response.json()["content"]]
    # Off, the template closes the thinking in the prompt: the model's own
    # <think> ... </think> is then plain text.
    assert kinds == (["thinking", "text"] if thinks else ["text"])


def claude_code_turns(scripted: ScriptedModel) -> dict[str, Any]:
    """A conversation as Claude Code sends it after a tool call."""
    return {
        "model": "scripted",
        "max_tokens": 32000,
        "stream": True,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197;"},
            {
                "type": "text",
                "text": "You are a coding agent.",
                "cache_control": {"type": "ephemeral"},
            },
            {"type": "text", "text": "Work carefully.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>today</system-reminder>\n\n"},
                    {
                        "type": "text",
                        "text": "what is the weather?",
                        "cache_control": {"type": "ephemeral"},
                    },
                ],
            },
            {"role": "system", "content": "Available agent types: none."},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Need weather.", "signature": "c2lnbmF0dXJl"},
                    {"type": "text", "text": "Checking."},
                    {
                        "type": "tool_use",
                        "id": "toolu_01A09q90qw90lq917835lq9",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_01A09q90qw90lq917835lq9",
                        "content": [{"type": "text", "text": "Sunny \ud83d"}],
                        "is_error": False,
                        "cache_control": {"type": "ephemeral"},
                    },
                    {"type": "text", "text": "Thanks."},
                ],
            },
            {"role": "system", "content": [{"type": "text", "text": "Be brief now."}]},
        ],
        "tools": [{**tool, "cache_control": {"type": "ephemeral"}} for tool in TOOLS],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": False},
        "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "s"})},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "service_tier": "auto",
        "speed": "standard",
        "chat_template_kwargs": scripted.chat_kwargs("tool_call"),
    }


def test_a_claude_code_shaped_conversation_is_answered(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    body = claude_code_turns(scripted)
    headers = {
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,mid-conversation-system-2026-04-07,no-such-beta-1",
        "x-api-key": "unused",
        "content-type": "application/json",
    }
    with (
        httpx.Client(timeout=120, headers=headers) as http,
        connect_sse(
            http,
            "POST",
            scripted_server.base_url + "/v1/messages?beta=true",
            content=json.dumps(body),
        ) as source,
    ):
        assert source.response.status_code == 200, source.response.read()
        events = [(event.event, json.loads(event.data)) for event in source.iter_sse()]
    for name, data in events:
        schemas.check_event(name, data)
    message = assert_well_formed(events)
    assert [block["type"] for block in message["content"]] == ["thinking", "tool_use"]
    assert message["stop_reason"] == "tool_use"
    # max_tokens 32000 on an 8192-token model is a cap, clamped to the room left.
    count = httpx.post(
        scripted_server.base_url + "/v1/messages/count_tokens?beta=true",
        content=json.dumps({k: v for k, v in body.items() if k not in ("max_tokens", "stream")}),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert count.json() == {"input_tokens": prompt_length(message["usage"])}


def test_disconnect_mid_stream_cancels(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    server = scripted_server
    seconds_per_token(server)  # timed before, on an idle server
    # Greedy on a looping script: a sampled reply on the default model could
    # end (EOS) before the third delta, and the test with it.
    body = {
        "model": server.model,
        "max_tokens": 100_000,  # clamped to the context: far more than the test waits for
        "messages": MESSAGES,
        "stream": True,
        **script_body(scripted, "bytes_stop"),
    }
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", server.base_url + "/v1/messages", json=body) as response,
    ):
        lines = response.iter_lines()
        deltas = 0
        while deltas < 3:
            deltas += next(lines) == "event: content_block_delta"
        # Leaving the block closes the connection mid-reply.
    closed = time.monotonic()
    assert_freed_promptly(server, left=context_room(server), since=closed)


@ONE_SETUP
@pytest.mark.parametrize(
    ("fields", "status", "kind", "needle"),
    [
        ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
        ({"model": "claude-opus-4-8"}, 404, "not_found_error", "claude-opus-4-8"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            400,
            "invalid_request_error",
            "messages[0].content[0]: image blocks are not supported",
        ),
        (
            {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            400,
            "invalid_request_error",
            "web_search_20250305",
        ),
        (
            {"output_config": {"format": {"type": "json_schema"}}},
            400,
            "invalid_request_error",
            "format",
        ),
        ({"temperature": 1.5}, 400, "invalid_request_error", "temperature"),
        ({"tool_choice": {"type": "tool", "name": "nope"}}, 400, "invalid_request_error", "nope"),
        (
            {"messages": [{"role": "user", "content": "x" * 9000}]},
            400,
            "invalid_request_error",
            "context",
        ),
    ],
)
def test_errors_have_anthropics_shape(
    scripted_server: RunningServer,
    fields: dict[str, Any],
    status: int,
    kind: str,
    needle: str,
) -> None:
    body = {"model": scripted_server.model, "max_tokens": 10, "messages": MESSAGES, "tools": TOOLS}
    body = {k: v for k, v in (body | fields).items() if v is not None}
    response = httpx.post(scripted_server.base_url + "/v1/messages", json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()
    schemas.check(error, schemas.ERROR)
    assert error["error"]["type"] == kind
    assert needle in error["error"]["message"]
    with client(scripted_server) as sdk, pytest.raises(anthropic.APIStatusError) as raised:
        sdk.post("/v1/messages", body=body, cast_to=Message)
    assert raised.value.status_code == status
    assert raised.value.body["error"]["type"] == kind  # type: ignore[index]


@ONE_SETUP
def test_head_root_with_the_playground(scripted_server: RunningServer) -> None:
    """Claude Code's probe: the playground's page answers ``HEAD /``."""
    probe = httpx.head(scripted_server.base_url + "/")
    assert probe.status_code == 200
    assert probe.headers["content-type"].startswith("text/html")


@ONE_SETUP
def test_bad_json_and_unknown_route(scripted_server: RunningServer) -> None:
    bad = httpx.post(scripted_server.base_url + "/v1/messages", content=b"{nope")
    assert bad.status_code == 400
    schemas.check(bad.json(), schemas.ERROR)
    counted = httpx.post(
        scripted_server.base_url + "/v1/messages/count_tokens", json={"model": "x"}
    )
    assert (counted.status_code, counted.json()["error"]["type"]) == (400, "invalid_request_error")


@pytest.fixture(scope="module")
def keyed_server(
    scripted: ScriptedModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    # No playground: HEAD / is then the Messages surface's to answer.
    with serving(
        scripted.path, tmp_path_factory.mktemp("logs"), "--api-key", "k3y", "--no-playground"
    ) as running:
        yield running


@DEFAULT_ENGINE_ONLY
def test_api_key_the_anthropic_ways(keyed_server: RunningServer, scripted: ScriptedModel) -> None:
    """``x-api-key`` (the SDK's api_key) or ``Authorization: Bearer`` (its
    auth_token); a wrong key is Anthropic's 401; ``HEAD /`` needs none."""
    url = keyed_server.base_url
    probe = httpx.head(url + "/")
    assert (probe.status_code, probe.content) == (200, b"")
    body = {"model": keyed_server.model, "max_tokens": 5, "messages": MESSAGES}
    wrong = httpx.post(url + "/v1/messages", json=body, headers={"x-api-key": "nope"})
    assert (wrong.status_code, wrong.json()["error"]["type"]) == (401, "authentication_error")
    schemas.check(wrong.json(), schemas.ERROR)
    missing = httpx.post(url + "/v1/messages", json=body)
    assert missing.status_code == 401
    with anthropic.Anthropic(base_url=url, api_key="k3y", max_retries=0) as sdk:
        assert sdk.messages.create(**body).type == "message"  # type: ignore[arg-type]
        listing = sdk.models.list()
        schemas.check(listing.model_dump(mode="json"), schemas.MODEL_LIST)
    with anthropic.Anthropic(base_url=url, auth_token="k3y", max_retries=0) as sdk:
        assert (
            sdk.messages.count_tokens(
                model=keyed_server.model,
                messages=MESSAGES,  # type: ignore[arg-type]
            ).input_tokens
            > 0
        )
    # Without anthropic-version, /v1/models is OpenAI's, and takes OpenAI's key.
    models = httpx.get(url + "/v1/models", headers={"authorization": "Bearer k3y"}).json()
    assert models["object"] == "list"
    shaped = httpx.get(
        url + "/v1/models", headers={"x-api-key": "k3y", "anthropic-version": "2023-06-01"}
    ).json()
    schemas.check(shaped, schemas.MODEL_LIST)


@ONE_SETUP
def test_a_lone_surrogate_does_not_break_the_request(scripted_server: RunningServer) -> None:
    body = (
        b'{"model": "%s", "max_tokens": 20, "messages": [{"role": "user", "content": "hi \\ud83d"}]}'
        % scripted_server.model.encode()
    )
    response = httpx.post(
        scripted_server.base_url + "/v1/messages",
        content=body,
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 200, response.text
