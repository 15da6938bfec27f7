"""Multi-turn from the exact tokens (issue K) on the Responses API and the
Messages API: the same splice core as chat's (tests/e2e/test_multiturn.py),
reached through each surface's own fields. A client drives the conversation
the way that surface's clients do -- Responses: the previous reply's
``output`` items go back into ``input`` as they came (the ids ride on the
last one); Messages: the reply's content goes back as the assistant message,
its ids beside it -- and every turn's prompt must begin with the previous
turn's prompt and generated ids; without the ids it does not (the template
drops past reasoning)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

import anthropic
import httpx
import openai
import pytest
from httpx_sse import connect_sse
from hypothesis import HealthCheck, given, settings

from tests.e2e.harness import RunningServer
from tests.e2e.test_multiturn import Plan, plans
from tests.fixtures.scripted_model import ScriptedModel

pytestmark = pytest.mark.e2e

IDS = ("prompt_token_ids", "generation_token_ids")
TOOL_RESULT = '{"temp": 21}'
RESPONSES_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
]
MESSAGES_TOOLS: list[dict[str, Any]] = [
    {
        "name": "get_weather",
        "description": "Weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
]


@dataclass(frozen=True)
class Turn:
    """One reply's ids, as the surface reports them."""

    prompt: list[int]
    output: list[int]
    reused: int | None


class Driver(Protocol):
    """How a client of one surface drives a conversation."""

    path: str

    def body(
        self, server: RunningServer, scripted: ScriptedModel, plan: Plan, history: list[Any]
    ) -> dict[str, Any]: ...

    def turn(self, reply: dict[str, Any]) -> Turn: ...

    def passed_back(self, reply: dict[str, Any], *, with_ids: bool) -> list[dict[str, Any]]: ...

    def after(
        self, passed: list[dict[str, Any]], follow_up: str | None
    ) -> list[dict[str, Any]]: ...


class Responses:
    path = "/v1/responses"

    def body(
        self, server: RunningServer, scripted: ScriptedModel, plan: Plan, history: list[Any]
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": server.model,
            "input": history,
            "tools": RESPONSES_TOOLS,
            "temperature": 0,
            "return_token_ids": True,
            "chat_template_kwargs": scripted.chat_kwargs(plan.script),
        }
        if plan.system is not None:
            body["instructions"] = plan.system
        if plan.max_tokens is not None:
            body["max_output_tokens"] = plan.max_tokens
        return body

    def turn(self, reply: dict[str, Any]) -> Turn:
        *earlier, last = reply["output"]
        assert all(not set(IDS) & item.keys() for item in earlier)  # once, on the last item
        return Turn(last[IDS[0]], last[IDS[1]], reply.get("reused_prompt_tokens"))

    def passed_back(self, reply: dict[str, Any], *, with_ids: bool) -> list[dict[str, Any]]:
        if with_ids:
            return list(reply["output"])
        return [{k: v for k, v in item.items() if k not in IDS} for item in reply["output"]]

    def after(self, passed: list[dict[str, Any]], follow_up: str | None) -> list[dict[str, Any]]:
        added: list[dict[str, Any]] = [
            {"type": "function_call_output", "call_id": item["call_id"], "output": TOOL_RESULT}
            for item in passed
            if item["type"] == "function_call"
        ]
        if follow_up is not None or not added:
            added.append({"role": "user", "content": follow_up or "go on"})
        return added


class Messages:
    path = "/v1/messages"

    def body(
        self, server: RunningServer, scripted: ScriptedModel, plan: Plan, history: list[Any]
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": server.model,
            "messages": history,
            "tools": MESSAGES_TOOLS,
            "max_tokens": plan.max_tokens or 1024,
            "temperature": 0.0,
            "return_token_ids": True,
            "chat_template_kwargs": scripted.chat_kwargs(plan.script),
        }
        if plan.system is not None:
            body["system"] = plan.system
        if plan.stop:
            body["stop_sequences"] = list(plan.stop)
        return body

    def turn(self, reply: dict[str, Any]) -> Turn:
        return Turn(reply[IDS[0]], reply[IDS[1]], reply.get("reused_prompt_tokens"))

    def passed_back(self, reply: dict[str, Any], *, with_ids: bool) -> list[dict[str, Any]]:
        message = {"role": "assistant", "content": reply["content"]}
        if with_ids:
            message |= {name: reply[name] for name in IDS}
        return [message]

    def after(self, passed: list[dict[str, Any]], follow_up: str | None) -> list[dict[str, Any]]:
        (message,) = passed
        blocks: list[dict[str, Any]] = [
            {"type": "tool_result", "tool_use_id": block["id"], "content": TOOL_RESULT}
            for block in message["content"]
            if block["type"] == "tool_use"
        ]
        if follow_up is not None or not blocks:
            blocks.append({"type": "text", "text": follow_up or "go on"})
        return [{"role": "user", "content": blocks}]


DRIVERS: dict[str, Driver] = {"responses": Responses(), "messages": Messages()}


def post(server: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=120)


def reply_of(server: RunningServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = post(server, path, body)
    assert response.status_code == 200, response.text
    reply: dict[str, Any] = response.json()
    return reply


def converse(
    server: RunningServer, scripted: ScriptedModel, driver: Driver, plan: Plan, *, with_ids: bool
) -> list[dict[str, Any]]:
    """Drive the conversation turn by turn; every reply, in order."""
    history: list[Any] = [{"role": "user", "content": plan.first}]
    replies = []
    for turn in range(plan.turns):
        reply = reply_of(server, driver.path, driver.body(server, scripted, plan, history))
        replies.append(reply)
        passed = driver.passed_back(reply, with_ids=with_ids)
        if turn < plan.turns - 1:
            history = [*history, *passed, *driver.after(passed, plan.follow_ups[turn])]
    return replies


def broken_turns(driver: Driver, replies: list[dict[str, Any]]) -> list[int]:
    """The turns whose prompt does not begin with the previous prompt + output."""
    turns = [driver.turn(reply) for reply in replies]
    return [
        index
        for index in range(1, len(turns))
        if turns[index].prompt[: len(turns[index - 1].prompt) + len(turns[index - 1].output)]
        != turns[index - 1].prompt + turns[index - 1].output
    ]


def check_conversation(driver: Driver, replies: list[dict[str, Any]]) -> None:
    assert broken_turns(driver, replies) == []
    for index, reply in enumerate(replies):
        turn = driver.turn(reply)
        if index:
            before = driver.turn(replies[index - 1])
            assert turn.reused == len(before.prompt) + len(before.output)
        else:
            assert turn.reused is None


PROPERTY = settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(plan=plans(stop_strings=False, synonyms=False))
def test_responses_every_turn_starts_with_the_previous_prompt_and_output_few_examples(
    scripted_server: RunningServer, scripted: ScriptedModel, plan: Plan
) -> None:
    driver = DRIVERS["responses"]
    check_conversation(driver, converse(scripted_server, scripted, driver, plan, with_ids=True))


@PROPERTY
@given(plan=plans(synonyms=False))
def test_messages_every_turn_starts_with_the_previous_prompt_and_output_few_examples(
    scripted_server: RunningServer, scripted: ScriptedModel, plan: Plan
) -> None:
    driver = DRIVERS["messages"]
    check_conversation(driver, converse(scripted_server, scripted, driver, plan, with_ids=True))


@pytest.mark.parametrize("surface", list(DRIVERS))
@pytest.mark.parametrize("script", ["reasoning", "tool_call"])
def test_without_ids_the_template_breaks_the_invariant(
    scripted_server: RunningServer, scripted: ScriptedModel, surface: str, script: str
) -> None:
    """The negative control: passed back without ids, the history is
    re-rendered and loses the past turn's ``<think>`` block."""
    driver = DRIVERS[surface]
    plan = Plan(
        script=script, system=None, first="hi", turns=3, follow_ups=("next", None), synonym=False
    )
    rerendered = converse(scripted_server, scripted, driver, plan, with_ids=False)
    assert broken_turns(driver, rerendered) == [1, 2]
    assert all(driver.turn(reply).reused is None for reply in rerendered)
    with_ids = converse(scripted_server, scripted, driver, plan, with_ids=True)
    assert broken_turns(driver, with_ids) == []


def _two_turns(
    server: RunningServer, scripted: ScriptedModel, surface: str
) -> tuple[dict[str, Any], list[Any]]:
    """The tool-call script's first reply passed back with its ids and the
    tool's result: the body of the second turn, and its history."""
    driver = DRIVERS[surface]
    plan = Plan(
        script="tool_call", system=None, first="hi", turns=2, follow_ups=(None,), synonym=False
    )
    history: list[Any] = [{"role": "user", "content": plan.first}]
    first = reply_of(server, driver.path, driver.body(server, scripted, plan, history))
    passed = driver.passed_back(first, with_ids=True)
    history = [*history, *passed, *driver.after(passed, None)]
    return driver.body(server, scripted, plan, history), history


#: (surface, which entry of the second turn's history to change, the change,
#: where the refusal must point). Responses' history: user, reasoning,
#: function_call (the ids), its output -- ids on the reasoning item that
#: differ from the call's are refused too (one turn, one reply). Messages':
#: user, assistant (the ids), the tool result.
BAD_IDS = [
    ("responses", 2, {"generation_token_ids": [10**9]}, "input[2].generation_token_ids"),
    ("responses", 2, {"prompt_token_ids": [1, 2, 3]}, "input[2].prompt_token_ids"),
    ("responses", 2, {"generation_token_ids": None}, "input[2].generation_token_ids"),
    ("responses", 1, {"prompt_token_ids": [1], "generation_token_ids": [2]}, "input[2].prompt_token_ids"),
    ("responses", 3, {"prompt_token_ids": [1], "generation_token_ids": [2]}, "input[3].prompt_token_ids"),
    ("messages", 1, {"generation_token_ids": [10**9]}, "messages[1].generation_token_ids"),
    ("messages", 1, {"prompt_token_ids": [1, 2, 3]}, "messages[1].prompt_token_ids"),
    ("messages", 1, {"prompt_token_ids": None}, "messages[1].prompt_token_ids"),
    ("messages", 2, {"prompt_token_ids": [1], "generation_token_ids": [2]}, "messages[2].prompt_token_ids"),
]  # fmt: skip


def refused_at(surface: str, response: httpx.Response) -> str:
    """Where a 400 in the surface's own error shape says the fault is: the
    OpenAI body's ``param`` (its message starts with it too); Anthropic's
    body has no ``param``, so the start of its message."""
    assert response.status_code == 400, response.text
    payload = response.json()
    if surface == "messages":
        assert payload["type"] == "error"
    error = payload["error"]
    assert error["type"] == "invalid_request_error"
    where = str(error["message"]).split(":", 1)[0]
    if surface == "responses":
        assert error["param"] == where
    return where


@pytest.mark.parametrize(("surface", "index", "change", "where"), BAD_IDS)
def test_bad_ids_are_a_400_naming_item_and_field(
    scripted_server: RunningServer,
    scripted: ScriptedModel,
    surface: str,
    index: int,
    change: dict[str, Any],
    where: str,
) -> None:
    body, sent = _two_turns(scripted_server, scripted, surface)
    history = list(sent)  # the body keeps the good history
    history[index] = {k: v for k, v in {**history[index], **change}.items() if v is not None}
    field = "input" if surface == "responses" else "messages"
    paths = [DRIVERS[surface].path]
    if surface == "messages":
        paths.append("/v1/messages/count_tokens")
    for path in paths:
        assert refused_at(surface, post(scripted_server, path, {**body, field: history})) == where
    assert reply_of(scripted_server, paths[0], body)  # the next request is unaffected


def test_responses_openai_sdk_passes_output_items_back_with_their_ids(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    """The agent loop as the ``openai`` SDK runs it: ``output`` items (the
    SDK's own objects) appended to ``input``; their extra fields go along."""
    kwargs = scripted.chat_kwargs("tool_call")
    history: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    with openai.OpenAI(base_url=scripted_server.api_url, api_key="unused") as client:

        def create() -> Any:
            return client.responses.create(
                model=scripted_server.model,
                input=history,
                tools=RESPONSES_TOOLS,  # type: ignore[arg-type]
                temperature=0,
                extra_body={"return_token_ids": True, "chat_template_kwargs": kwargs},
            )

        first = create()
        last = first.output[-1]
        prompt, generated = (last.model_extra or {})[IDS[0]], (last.model_extra or {})[IDS[1]]
        history += [
            *first.output,
            {"type": "function_call_output", "call_id": last.call_id, "output": TOOL_RESULT},
        ]
        second = create()
    extra = second.output[-1].model_extra or {}
    assert extra[IDS[0]][: len(prompt) + len(generated)] == prompt + generated
    assert (second.model_extra or {})["reused_prompt_tokens"] == len(prompt) + len(generated)


def test_messages_anthropic_sdk_passes_the_ids_on_the_assistant_message(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    """The ``anthropic`` SDK sends unknown keys of a message dict as they are;
    the reply's extension fields are in ``model_extra``."""
    extra_body = {
        "return_token_ids": True,
        "chat_template_kwargs": scripted.chat_kwargs("tool_call"),
    }
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    with anthropic.Anthropic(
        base_url=scripted_server.base_url, api_key="unused", max_retries=0
    ) as client:

        def create() -> Any:
            return client.messages.create(
                model=scripted_server.model,
                max_tokens=1024,
                messages=messages,
                tools=MESSAGES_TOOLS,  # type: ignore[arg-type]
                extra_body=extra_body,
            )

        first = create()
        ids = first.model_extra or {}
        prompt, generated = ids[IDS[0]], ids[IDS[1]]
        (call,) = [block for block in first.content if block.type == "tool_use"]
        messages += [
            {"role": "assistant", "content": first.content, IDS[0]: prompt, IDS[1]: generated},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21"}],
            },
        ]
        second = create()
    extra = second.model_extra or {}
    assert extra[IDS[0]][: len(prompt) + len(generated)] == prompt + generated
    assert extra["reused_prompt_tokens"] == len(prompt) + len(generated)


def _sse(server: RunningServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with (
        httpx.Client(timeout=120) as client,
        connect_sse(client, "POST", server.base_url + path, json={**body, "stream": True}) as src,
    ):
        assert src.response.status_code == 200, src.response.read()
        return [json.loads(event.data) for event in src.iter_sse()]


def test_responses_stream_carries_the_ids_on_the_last_item(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    body, _ = _two_turns(scripted_server, scripted, "responses")
    whole = reply_of(scripted_server, "/v1/responses", body)
    events = _sse(scripted_server, "/v1/responses", body)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [set(IDS) <= item.keys() for item in done] == [False] * (len(done) - 1) + [True]
    assert {k: done[-1][k] for k in IDS} == {k: whole["output"][-1][k] for k in IDS}
    final = events[-1]["response"]
    assert final["output"][-1][IDS[1]] == whole["output"][-1][IDS[1]]
    assert all(e["response"]["reused_prompt_tokens"] for e in events if "response" in e)
    assert final["reused_prompt_tokens"] == whole["reused_prompt_tokens"]


def test_messages_stream_carries_the_ids_at_its_ends(
    scripted_server: RunningServer, scripted: ScriptedModel
) -> None:
    body, _ = _two_turns(scripted_server, scripted, "messages")
    whole = reply_of(scripted_server, "/v1/messages", body)
    events = _sse(scripted_server, "/v1/messages", body)
    (start,) = [e["message"] for e in events if e["type"] == "message_start"]
    (delta,) = [e["delta"] for e in events if e["type"] == "message_delta"]
    assert start[IDS[0]] == whole[IDS[0]]
    assert start["reused_prompt_tokens"] == whole["reused_prompt_tokens"]
    assert delta[IDS[1]] == whole[IDS[1]]
