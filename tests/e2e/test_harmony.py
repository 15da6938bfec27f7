"""gpt-oss's harmony end to end: a trained harmony model
(:mod:`tests.fixtures.harmony_model`) served with no parser flags (its
template is detected), read through chat completions (whole and streamed,
logprobs and token ids on), Responses and Messages, on both engines.

Every script's channels land where the docs say (analysis -> reasoning,
final and preambles -> content, calls -> tool calls), streaming equals
non-streaming on each surface, and each token's logprob entry rides with
its text (the expected home of every token comes from a reading of the
script written here, not from the server's parser).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import openai
import pytest
from tokenizers import Tokenizer

from sluiceway.engines.default_model import default_cache_dir
from tests.e2e import responses_wire as wire
from tests.e2e import schemas
from tests.e2e.conftest import ON_VLLM, VLLM
from tests.e2e.harness import RunningServer, ServerPool
from tests.fixtures.harmony_model import (
    CALL,
    END,
    HARMONY_SCRIPTS,
    MESSAGE,
    RETURN,
    HarmonyModel,
    cached_harmony_model,
)
from tests.fixtures.scripted_model import Script

#: Training the fixture model (on a cold cache) takes minutes on a busy 2-core host.
pytestmark = pytest.mark.timeout(1200)

#: Both engines always (the harmony reader is the same on each, the model
#: is not), or vLLM's under ``make test-vllm``.
SETUPS = (
    VLLM
    if ON_VLLM
    else [
        pytest.param(("asyncio", "transformers"), id="asyncio-transformers"),
        pytest.param(("trio", "mlx"), id="trio-mlx"),
    ]
)
SCRIPTS = [script.name for script in HARMONY_SCRIPTS]
BY_NAME = {script.name: script for script in HARMONY_SCRIPTS}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}
TIME = {"type": "object", "properties": {"tz": {"type": "string"}}}
CHAT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@dataclass(frozen=True)
class Expected:
    reasoning: str = ""
    content: str = ""
    calls: tuple[tuple[str, dict[str, Any]], ...] = ()
    #: Responses item types, in order.
    items: tuple[str, ...] = ()


PARIS = ("get_weather", {"city": "Paris"})
EXPECTED = {
    "analysis_final": Expected("The user greets.", "Hello! How can I help?", (),
                               ("reasoning", "message")),
    "preamble_call": Expected("Need weather.", "Checking Paris.", (PARIS,),
                              ("reasoning", "message", "function_call")),
    "two_calls": Expected("", "", (PARIS, ("get_time", {"tz": "UTC"})),
                          ("function_call", "function_call")),
    "role_recipient": Expected("", "", (("get_weather", {"city": "Oslo"}),), ("function_call",)),
    "final_json": Expected("JSON wanted.", '{"answer": "yes"}', (), ("reasoning", "message")),
    "no_header": Expected("", "Plain answer without channels.", (), ("message",)),
    "multibyte": Expected("", "Café costs 3€.", (), ("message",)),
    "after_tool": Expected("Got it.", "It is sunny.", (), ("reasoning", "message")),
}  # fmt: skip


@pytest.fixture(scope="session")
def harmony() -> HarmonyModel:
    return cached_harmony_model(default_cache_dir() / "test-models", HARMONY_SCRIPTS)


@pytest.fixture(scope="module", params=SETUPS)
def harmony_server(
    request: pytest.FixtureRequest, harmony: HarmonyModel, servers: ServerPool
) -> RunningServer:
    worker_class, engine = request.param
    return servers.get(
        harmony.path, worker_class=worker_class, name="harmony", extra_args=["--engine", engine]
    )


def _homes(script: Script) -> list[tuple[str, bool]]:
    """Per token: the channel whose entries carry it, and whether it is text
    of that channel (a body's text) rather than markup."""
    homes: list[tuple[str, bool]] = []
    header: list[str] = []
    channel = ""
    for piece in script.pieces:
        if piece == MESSAGE:
            text = "".join(p for p in header if isinstance(p, str))
            channel = "tool" if "to=" in text else "reasoning" if "analysis" in text else "content"
            homes += [(channel, False)] * (len(header) + 1)
            header = []
        elif piece in (END, CALL, RETURN):
            if header:  # text that never got a header is content
                homes += [("content", True)] * len(header)
                header, channel = [], "content"
            homes.append((channel, False))
            channel = ""
        elif channel:
            homes.append((channel, True))
        else:
            header.append(piece if isinstance(piece, str) else "")
    return homes


def _post(server: RunningServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(server.api_url + path, json=body, timeout=120)
    assert response.status_code == 200, response.text
    reply: dict[str, Any] = response.json()
    return reply


def _chat_body(server: RunningServer, harmony: HarmonyModel, script: str) -> dict[str, Any]:
    return {
        "model": server.model,
        "messages": MESSAGES,
        "tools": CHAT_TOOLS,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 1,
        "return_token_ids": True,
        "chat_template_kwargs": harmony.chat_kwargs(script),
    }


def _constrained_body(server: RunningServer, harmony: HarmonyModel, script: str) -> dict[str, Any]:
    """A body for a request under a grammar: on vLLM without logprobs, which
    it would take from the masked distribution and so refuses (a 400 that
    docs/engines.md states) unless served with ``--logprobs-mode processed``."""
    body = _chat_body(server, harmony, script)
    if ON_VLLM:
        del body["logprobs"], body["top_logprobs"]
    return body


def test_the_template_selects_harmony_without_flags(harmony_server: RunningServer) -> None:
    assert "reasoning parser: openai_gptoss (auto); tool-call parser: openai (auto)" in (
        harmony_server.log()
    )


@pytest.mark.parametrize("script", SCRIPTS)
def test_chat_channels_whole_and_streamed(
    harmony_server: RunningServer, harmony: HarmonyModel, script: str
) -> None:
    body = _chat_body(harmony_server, harmony, script)
    whole = _post(harmony_server, "/chat/completions", body)
    schemas.check(whole, schemas.CHAT_COMPLETION)
    (choice,) = whole["choices"]
    message = choice["message"]
    expected = EXPECTED[script]
    calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message.get("tool_calls") or []
    ]
    assert (message.get("reasoning_content") or "", message.get("content") or "") == (
        expected.reasoning,
        expected.content,
    )
    assert calls == list(expected.calls)
    assert choice["finish_reason"] == ("tool_calls" if expected.calls else "stop")
    ids = harmony.token_ids(script)
    assert choice["token_ids"] == ids
    assert whole["usage"]["completion_tokens"] == len(ids)

    chunks = _stream_chat(harmony_server, body)
    streamed = _merge(chunks)
    assert streamed["reasoning"] == (message.get("reasoning_content") or "")
    assert streamed["content"] == (message.get("content") or "")
    assert streamed["calls"] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []
    ]
    assert streamed["token_ids"] == ids
    _check_alignment(chunks, BY_NAME[script], ids)


def _stream_chat(server: RunningServer, body: dict[str, Any]) -> list[dict[str, Any]]:
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    chunks = schemas.streamed_chat(server.api_url, payload, timeout=120)
    return [chunk for chunk in chunks if chunk["choices"]]


def _merge(chunks: Sequence[dict[str, Any]]) -> dict[str, Any]:
    reasoning = content = ""
    calls: list[list[str]] = []
    token_ids: list[int] = []
    for chunk in chunks:
        (choice,) = chunk["choices"]
        delta = choice["delta"]
        reasoning += delta.get("reasoning_content") or ""
        content += delta.get("content") or ""
        token_ids += choice.get("token_ids") or []
        for fragment in delta.get("tool_calls") or []:
            if fragment["index"] == len(calls):
                calls.append([fragment["function"]["name"], ""])
            assert fragment["index"] < len(calls), "tool call indices jump"
            calls[fragment["index"]][1] += fragment["function"].get("arguments") or ""
    return {
        "reasoning": reasoning,
        "content": content,
        "calls": [tuple(call) for call in calls],
        "token_ids": token_ids,
    }


#: The chat chunk's logprobs field of each channel.
_FIELDS = {"content": "content", "reasoning": "reasoning_content", "tool": "tool_calls"}


def _check_alignment(chunks: Sequence[dict[str, Any]], script: Script, ids: list[int]) -> None:
    """Each channel's entries are its tokens, in order, each once; a chunk's
    text of a channel is exactly the text of the body tokens whose entries
    it carries."""
    homes = _homes(script)
    assert len(homes) == len(ids)
    raw = [piece.encode() if isinstance(piece, str) else piece for piece in script.pieces]
    for channel, field in _FIELDS.items():
        want = [raw[i] for i, (home, _) in enumerate(homes) if home == channel]
        carried = [
            bytes(entry["bytes"])
            for chunk in chunks
            for entry in (chunk["choices"][0].get("logprobs") or {}).get(field) or []
        ]
        assert carried == want, f"{channel} entries"
    body = {raw[i] for i, (_, text) in enumerate(homes) if text}
    for chunk in chunks:
        choice = chunk["choices"][0]
        logprobs = choice.get("logprobs") or {}
        for channel, key in (("content", "content"), ("reasoning", "reasoning_content")):
            text = choice["delta"].get(key) or ""
            data = b"".join(
                bytes(e["bytes"])
                for e in logprobs.get(_FIELDS[channel]) or []
                if bytes(e["bytes"]) in body
            )
            assert data.decode(errors="replace") == text, f"{channel} chunk {chunk}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_responses_items_whole_and_streamed(
    harmony_server: RunningServer, harmony: HarmonyModel, script: str
) -> None:
    body = {
        "model": harmony_server.model,
        "input": "Weather in Paris?",
        "tools": [
            {
                "type": "function",
                "name": t["function"]["name"],
                "parameters": t["function"]["parameters"],
            }
            for t in CHAT_TOOLS
        ],
        "temperature": 0,
        "chat_template_kwargs": harmony.chat_kwargs(script),
    }
    whole = _post(harmony_server, "/responses", body)
    wire.check_response(whole)
    expected = EXPECTED[script]
    output = whole["output"]
    assert tuple(item["type"] for item in output) == expected.items
    texts = {
        kind: [wire.item_text(i) for i in output if i["type"] == kind] for kind in expected.items
    }
    assert "".join(texts.get("reasoning", [])) == expected.reasoning
    assert "".join(texts.get("message", [])) == expected.content
    calls = [
        (i["name"], json.loads(i["arguments"])) for i in output if i["type"] == "function_call"
    ]
    assert calls == list(expected.calls)
    assert whole["status"] == "completed"

    response = httpx.post(
        harmony_server.api_url + "/responses", json={**body, "stream": True}, timeout=120
    )
    assert response.status_code == 200, response.text
    events = wire.parse_sse(response.text)
    assert events[-1]["type"] == "response.completed"
    final = wire.check_stream(events)
    assert wire.without_ids(final["output"]) == wire.without_ids(output)


@pytest.mark.parametrize("script", SCRIPTS)
def test_messages_blocks_whole_and_streamed(
    harmony_server: RunningServer, harmony: HarmonyModel, script: str
) -> None:
    fields: dict[str, Any] = {
        "model": harmony_server.model,
        "max_tokens": 200,
        "messages": MESSAGES,
        "tools": [
            {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
            for t in CHAT_TOOLS
        ],
        "extra_body": {"chat_template_kwargs": harmony.chat_kwargs(script), "temperature": 0.0},
    }
    sdk = anthropic.Anthropic(base_url=harmony_server.base_url, api_key="unused", max_retries=0)
    with sdk:
        whole = sdk.messages.create(**fields)
        with sdk.messages.stream(**fields) as stream:
            streamed = stream.get_final_message()
    expected = EXPECTED[script]
    blocks = [block.model_dump(exclude={"id"}) for block in whole.content]
    thinking = "".join(b["thinking"] for b in blocks if b["type"] == "thinking")
    text = "".join(b["text"] for b in blocks if b["type"] == "text")
    uses = [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"]
    assert (thinking, text, uses) == (expected.reasoning, expected.content, list(expected.calls))
    assert whole.stop_reason == ("tool_use" if expected.calls else "end_turn")
    assert [block.model_dump(exclude={"id"}) for block in streamed.content] == blocks
    assert streamed.stop_reason == whole.stop_reason


ANSWER = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("script", ["analysis_final", "final_json"])
def test_a_format_holds_the_final_answer_only(
    harmony_server: RunningServer, harmony: HarmonyModel, script: str
) -> None:
    """The script's reasoning comes out as written; its answer is held to
    the schema (``analysis_final`` would say "Hello! ..." unconstrained)."""
    body = {
        **_constrained_body(harmony_server, harmony, script),
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}},
        "max_tokens": 60,
    }
    whole = _post(harmony_server, "/chat/completions", body)
    message = whole["choices"][0]["message"]
    assert message["reasoning_content"] == EXPECTED[script].reasoning
    assert json.loads(message["content"]) in ({"answer": "yes"}, {"answer": "no"})
    assert not message.get("tool_calls")
    assert whole["choices"][0]["finish_reason"] == "stop"


def test_a_named_tool_choice_holds_the_call(
    harmony_server: RunningServer, harmony: HarmonyModel
) -> None:
    """The script calls get_weather; the named choice makes it get_time,
    with arguments of get_time's schema; the reasoning stays the script's."""
    tz = {"type": "object", "properties": {"tz": {"enum": ["UTC"]}}, "required": ["tz"],
          "additionalProperties": False}  # fmt: skip
    body = {
        **_constrained_body(harmony_server, harmony, "preamble_call"),
        "tools": [
            CHAT_TOOLS[0],
            {"type": "function", "function": {"name": "get_time", "parameters": tz}},
        ],
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        "max_tokens": 80,
    }
    whole = _post(harmony_server, "/chat/completions", body)
    choice = whole["choices"][0]
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in choice["message"]["tool_calls"]]  # fmt: skip
    assert calls == [("get_time", {"tz": "UTC"})]
    assert choice["message"]["reasoning_content"] == "Need weather."
    assert choice["finish_reason"] == "tool_calls"


def test_a_chat_tool_loop_over_two_turns(
    harmony_server: RunningServer, harmony: HarmonyModel
) -> None:
    """The call's turn goes back (reasoning, preamble, call, result) and the
    next turn answers; the template renders the earlier turn in harmony."""
    first = _post(
        harmony_server, "/chat/completions", _chat_body(harmony_server, harmony, "preamble_call")
    )
    message = first["choices"][0]["message"]
    (call,) = message["tool_calls"]
    history = [
        *MESSAGES,
        {"role": "assistant", "content": message["content"], "tool_calls": [call],
         "reasoning_content": message["reasoning_content"]},
        {"role": "tool", "tool_call_id": call["id"], "name": "get_weather", "content": "sunny"},
    ]  # fmt: skip
    body = {**_chat_body(harmony_server, harmony, "after_tool"), "messages": history}
    tokenized = httpx.post(
        harmony_server.base_url + "/tokenize",
        json={"model": harmony_server.model, **_only(body)},
        timeout=60,
    )
    assert tokenized.status_code == 200, tokenized.text
    tokenizer = Tokenizer.from_file(str(harmony.path / "tokenizer.json"))
    text = tokenizer.decode(tokenized.json()["tokens"], skip_special_tokens=False)
    assert (
        "<|channel|>analysis<|message|>Need weather.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Checking Paris.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>"
    ) in text
    second = _post(harmony_server, "/chat/completions", body)
    reply = second["choices"][0]
    assert (reply["message"]["reasoning_content"], reply["message"]["content"]) == (
        "Got it.",
        "It is sunny.",
    )
    assert reply["finish_reason"] == "stop"


def _only(body: dict[str, Any]) -> dict[str, Any]:
    return {k: body[k] for k in ("messages", "tools", "chat_template_kwargs")}


def test_the_openai_sdk_streams_a_responses_tool_loop(
    harmony_server: RunningServer, harmony: HarmonyModel
) -> None:
    tools: list[Any] = [
        {"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": False}
    ]
    with openai.OpenAI(base_url=harmony_server.api_url, api_key="unused", max_retries=0) as sdk:

        def turn(items: list[Any], script: str) -> Any:
            extra = {"chat_template_kwargs": harmony.chat_kwargs(script), "temperature": 0}
            with sdk.responses.stream(
                model=harmony_server.model, input=items, tools=tools, extra_body=extra
            ) as stream:
                kinds = [event.type for event in stream]
                assert kinds[-1] == "response.completed"
                return stream.get_final_response()

        asked: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
        first = turn(asked, "preamble_call")
        assert [item.type for item in first.output] == ["reasoning", "message", "function_call"]
        call = first.output[-1]
        assert (call.name, json.loads(call.arguments)) == PARIS
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
        done = [item.model_dump(exclude_none=True) for item in first.output]
        second = turn([*asked, *done, result], "after_tool")
    assert [item.type for item in second.output] == ["reasoning", "message"]
    assert second.output_text == "It is sunny."


def test_the_exact_token_path_keeps_a_harmony_turns_ids(
    harmony_server: RunningServer, harmony: HarmonyModel
) -> None:
    """A tool call's turn sent back with its ids: the next prompt starts with
    that turn's prompt and generated ids (reasoning, preamble and markers
    included), whatever the template would render, and the loop goes on."""
    first = _post(
        harmony_server, "/chat/completions", _chat_body(harmony_server, harmony, "preamble_call")
    )
    choice = first["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    kept = first["prompt_token_ids"] + choice["token_ids"]
    history = [
        *MESSAGES,
        {"role": "assistant", "content": choice["message"]["content"], "tool_calls": [call],
         "prompt_token_ids": first["prompt_token_ids"], "generation_token_ids": choice["token_ids"]},
        {"role": "tool", "tool_call_id": call["id"], "name": "get_weather", "content": "sunny"},
    ]  # fmt: skip
    body = {**_chat_body(harmony_server, harmony, "after_tool"), "messages": history}
    second = _post(harmony_server, "/chat/completions", body)
    assert second["prompt_token_ids"][: len(kept)] == kept
    assert second["choices"][0]["message"]["content"] == "It is sunny."


@pytest.mark.parametrize("cut", [1, 2, 9, 11])
def test_a_reply_cut_inside_a_header_ends_normally(
    harmony_server: RunningServer, harmony: HarmonyModel, cut: int
) -> None:
    """``max_tokens`` inside a header: its text is content (as the docs say),
    chat and Responses answer 200 and end their streams as usual."""
    body = {**_chat_body(harmony_server, harmony, "analysis_final"), "max_tokens": cut}
    whole = _post(harmony_server, "/chat/completions", body)
    choice = whole["choices"][0]
    header = {1: "", 2: "analysis", 9: "assistant", 11: "assistantfinal"}[cut]
    reasoning = "The user greets." if cut > 6 else ""
    assert (
        choice["message"].get("reasoning_content") or "",
        choice["message"].get("content") or "",
    ) == (
        reasoning,
        header,
    )
    assert choice["finish_reason"] == "length"
    streamed = _merge(_stream_chat(harmony_server, body))
    assert (streamed["reasoning"], streamed["content"]) == (reasoning, header)
    payload = {
        "model": harmony_server.model,
        "input": "hi",
        "max_output_tokens": cut,
        "temperature": 0,
        "stream": True,
        "chat_template_kwargs": harmony.chat_kwargs("analysis_final"),
    }
    response = httpx.post(harmony_server.api_url + "/responses", json=payload, timeout=120)
    assert response.status_code == 200, response.text
    events = wire.parse_sse(response.text)
    assert wire.check_stream(events)["status"] == "incomplete"


@pytest.mark.parametrize("rule", ["required", "strict"])
def test_required_and_strict_calls_run_under_the_reply_grammar(
    harmony_server: RunningServer, harmony: HarmonyModel, rule: str
) -> None:
    """``required`` (no final answer allowed) and a ``strict`` tool (its
    schema holds the arguments): the script's call fits both, so it comes
    out as written, through the grammar."""
    city = {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"],
            "additionalProperties": False}  # fmt: skip
    function: dict[str, Any] = {"name": "get_weather", "parameters": city}
    fields: dict[str, Any] = {"tool_choice": "required"}
    if rule == "strict":
        function["strict"] = True
        fields = {}
    body = {
        **_constrained_body(harmony_server, harmony, "preamble_call"),
        "tools": [{"type": "function", "function": function}],
        "max_tokens": 80,
        **fields,
    }
    whole = _post(harmony_server, "/chat/completions", body)
    choice = whole["choices"][0]
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in choice["message"]["tool_calls"]]  # fmt: skip
    assert calls == [PARIS]
    assert (choice["message"]["reasoning_content"], choice["message"]["content"]) == (
        "Need weather.",
        "Checking Paris.",
    )
    assert choice["finish_reason"] == "tool_calls"
