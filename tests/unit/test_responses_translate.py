"""The Responses translator: items onto neutral turns, tools onto what the
template is offered, and what a stateless server refuses."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sluiceway.protocol.constraints import ConstraintKind
from sluiceway.protocol.errors import InvalidRequest
from sluiceway.surfaces import validation
from sluiceway.surfaces.conversation import (
    Conversation,
    Message,
    Role,
    ToolCall,
    ToolChoiceMode,
    TurnIds,
)
from sluiceway.surfaces.responses.text_format import format_echo, output_format
from sluiceway.surfaces.responses.tools import ToolTable, tool_table
from sluiceway.surfaces.responses.translate import (
    check_settings,
    check_stateless,
    conversation_of,
)
from sluiceway.surfaces.responses.wire import ResponsesRequest

APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Apply a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch"'},
}
EXEC = {
    "type": "function",
    "name": "exec_command",
    "description": "Run a command.",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
    "strict": False,
}
NAMESPACE = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Sub-agents.",
    "tools": [
        {"type": "function", "name": "wait_agent", "parameters": {"type": "object"}},
        {"type": "custom", "name": "note"},
    ],
}
WEB_SEARCH = {"type": "web_search", "external_web_access": False}


def request(**fields: Any) -> ResponsesRequest:
    return validation.parse_request(ResponsesRequest, {"model": "m", "input": "hi", **fields})


def translate(**fields: Any) -> tuple[Conversation, ToolTable]:
    parsed = request(**fields)
    conversation, tools, _ = conversation_of(parsed, tool_table(parsed.tools or []))
    return conversation, tools


def test_a_string_input_is_one_user_turn_after_the_instructions() -> None:
    conversation, _ = translate(instructions="Be terse.")
    assert conversation.messages == (
        Message(role=Role.SYSTEM, text="Be terse."),
        Message(role=Role.USER, text="hi"),
    )


def test_codex_items_gather_into_turns() -> None:
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "A"}]},
        {"role": "user", "content": "go"},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "think"}],
            "encrypted_content": None,
        },
        {
            "type": "message",
            "id": "msg_1",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "ok", "annotations": [], "logprobs": []}],
        },
        {
            "type": "function_call",
            "id": "fc_1",
            "status": "completed",
            "call_id": "c1",
            "name": "wait_agent",
            "namespace": "multi_agent_v1",
            "arguments": "{}",
        },
        {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "P\n"},
        {"type": "function_call_output", "call_id": "c1", "output": "done"},
        {
            "type": "custom_tool_call_output",
            "call_id": "c2",
            "output": [{"type": "input_text", "text": "applied"}],
        },
        {"type": "message", "role": "system", "content": "mid-conversation"},
    ]
    conversation, _ = translate(input=items, tools=[APPLY_PATCH, NAMESPACE])
    assert conversation.messages == (
        Message(role=Role.SYSTEM, text="A"),
        Message(role=Role.USER, text="go"),
        Message(
            role=Role.ASSISTANT,
            text="ok",
            reasoning="think",
            tool_calls=(
                ToolCall(id="c1", name="multi_agent_v1__wait_agent", arguments="{}"),
                ToolCall(id="c2", name="apply_patch", arguments=json.dumps({"input": "P\n"})),
            ),
        ),
        Message(role=Role.TOOL, text="done", tool_call_id="c1"),
        Message(role=Role.TOOL, text="applied", tool_call_id="c2"),
        Message(role=Role.SYSTEM, text="mid-conversation"),
    )


def test_reasoning_after_a_call_starts_the_next_assistant_turn() -> None:
    items = [
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "again"}]},
        {"type": "message", "role": "assistant", "content": "text"},
    ]
    conversation, _ = translate(input=items)
    assert [(m.role, m.reasoning, m.text, len(m.tool_calls)) for m in conversation.messages] == [
        (Role.ASSISTANT, "", "", 1),
        (Role.ASSISTANT, "again", "text", 0),
    ]


def test_tools_offered_to_the_template() -> None:
    conversation, table = translate(tools=[EXEC, APPLY_PATCH, NAMESPACE, WEB_SEARCH])
    names = [spec.name for spec in conversation.tools]
    assert names == [
        "exec_command",
        "apply_patch",
        "multi_agent_v1__wait_agent",
        "multi_agent_v1__note",
    ]
    patch = conversation.tools[1]
    assert patch.parameters is not None
    assert patch.parameters["required"] == ["input"]
    assert patch.description is not None
    assert 'start: "*** Begin Patch"' in patch.description  # the grammar, shown
    assert conversation.tools[2].description is not None
    assert conversation.tools[2].description.startswith("Sub-agents.")
    assert table.ref("multi_agent_v1__note").custom
    assert table.ref("multi_agent_v1__wait_agent").namespace == "multi_agent_v1"
    assert table.ref("unknown").name == "unknown"


def test_only_hosted_tools_leave_auto_with_nothing_to_call() -> None:
    conversation, _ = translate(tools=[WEB_SEARCH], tool_choice="auto")
    assert conversation.tools == ()
    assert conversation.tool_choice is None


@pytest.mark.parametrize(
    ("choice", "mode", "name"),
    [
        ("required", ToolChoiceMode.REQUIRED, None),
        ({"type": "function", "name": "exec_command"}, ToolChoiceMode.NAMED, "exec_command"),
        ({"type": "custom", "name": "apply_patch"}, ToolChoiceMode.NAMED, "apply_patch"),
        (
            {"type": "function", "name": "wait_agent"},
            ToolChoiceMode.NAMED,
            "multi_agent_v1__wait_agent",
        ),
    ],
)
def test_tool_choices(choice: Any, mode: ToolChoiceMode, name: str | None) -> None:
    conversation, _ = translate(tools=[EXEC, APPLY_PATCH, NAMESPACE], tool_choice=choice)
    assert conversation.tool_choice is not None
    assert conversation.tool_choice.mode is mode
    assert conversation.tool_choice.name == name


def test_allowed_tools_narrow_what_is_offered() -> None:
    choice = {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [{"type": "function", "name": "exec_command"}],
    }
    conversation, table = translate(tools=[EXEC, APPLY_PATCH], tool_choice=choice)
    assert [spec.name for spec in conversation.tools] == ["exec_command"]
    assert conversation.tool_choice is not None
    assert conversation.tool_choice.mode is ToolChoiceMode.REQUIRED
    assert table.ref("apply_patch").custom  # calls still map back


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"tools": [WEB_SEARCH], "tool_choice": {"type": "web_search"}}, "tool_choice", "hosted"),
        ({"tools": [{"type": "frobnicate"}]}, "tools[0]", "frobnicate"),
        ({"tools": [EXEC, EXEC]}, "tools[1]", "twice"),
        (
            {"tools": [EXEC], "tool_choice": {"type": "function", "name": "nope"}},
            "tool_choice.name",
            "nope",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "stateless"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content",
            "images",
        ),
        ({"input": [{"type": "web_search_call", "id": "ws"}]}, "input[0]", "web_search_call"),
        ({"temperature": 3.0}, "temperature", "2"),
        ({"top_logprobs": 21}, "top_logprobs", "20"),
        ({"include": ["bogus"]}, "include[0]", "message.output_text.logprobs"),
        ({"stop": ["x"]}, "stop", "Unrecognized"),
    ],
)
def test_refusals_name_their_param(fields: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        translate(**fields)
    assert caught.value.param == param
    assert words in caught.value.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"conversation": {"id": "conv_1"}}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"background": True}, "background"),
    ],
)
def test_stateful_features_are_refused_as_such(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        check_stateless(request(**fields))
    assert caught.value.param == param
    assert "stateless" in caught.value.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"truncation": "auto"}, "truncation"),
    ],
)
def test_unsupported_settings(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        check_settings(request(**fields))
    assert caught.value.param == param


SCHEMA_FORMAT = {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}


@pytest.mark.parametrize(
    ("text_format", "kind"),
    [
        (None, None),
        ({"type": "text"}, None),
        ({"type": "json_object"}, ConstraintKind.JSON_OBJECT),
        (SCHEMA_FORMAT, ConstraintKind.JSON_SCHEMA),
    ],
)
def test_text_format_constraint(
    text_format: dict[str, Any] | None, kind: ConstraintKind | None
) -> None:
    parsed = request(text={"format": text_format} if text_format else None)
    output = output_format(parsed)
    assert (output.constraint.kind if output else None) is kind
    if output is not None:
        assert output.param == "text.format"
    if kind is ConstraintKind.JSON_SCHEMA:
        assert output is not None
        assert json.loads(output.constraint.text) == {"type": "object"}
    assert format_echo(parsed) == (text_format or {"type": "text"})


def test_each_function_tool_names_where_its_schema_sits() -> None:
    """Errors about a strict tool's schema name its place in the request,
    however hosted tools and namespaces shift the tools offered."""
    function = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    namespace = {"type": "namespace", "name": "ns", "tools": [function, {**function, "name": "g"}]}
    custom = {"type": "custom", "name": "c"}
    parsed = request(tools=[{"type": "web_search"}, namespace, custom, function])
    table = tool_table(parsed.tools or [])
    assert {name: ref.parameters for name, ref in table.refs.items()} == {
        "ns__f": "tools[1].tools[0].parameters",
        "ns__g": "tools[1].tools[1].parameters",
        "c": None,
        "f": "tools[3].parameters",
    }


def test_a_json_schema_format_needs_its_schema() -> None:
    with pytest.raises(InvalidRequest):
        request(text={"format": {"type": "json_schema", "name": "x"}})


def test_accepted_codex_settings() -> None:
    parsed = request(
        store=True,
        include=["reasoning.encrypted_content", "message.output_text.logprobs"],
        reasoning={"effort": "high", "summary": "auto"},
        prompt_cache_key="k",
        client_metadata={"x": "y"},
        text={"format": {"type": "text"}, "verbosity": "low"},
        truncation="disabled",
        metadata={"a": "b"},
        user="u",
    )
    check_stateless(parsed)
    check_settings(parsed)
    assert parsed.wants_logprobs


@pytest.mark.parametrize(
    ("effort", "thinking"),
    [(None, None), ("none", False), ("minimal", False), ("low", True), ("xhigh", True)],
)
def test_effort_switches_thinking(effort: str | None, thinking: bool | None) -> None:
    reasoning = {} if effort is None else {"reasoning": {"effort": effort}}
    conversation, _ = translate(**reasoning)
    assert conversation.thinking is thinking
    assert conversation.effort == {None: None, "none": "low", "minimal": "low", "low": "low",
                                   "xhigh": "high"}[effort]  # fmt: skip


def test_a_turns_ids_come_from_its_items_and_errors_name_the_item() -> None:
    """The ids on a turn's last item (as the reply puts them) go on its one
    assistant message, whose location is that item; equal ids on two items
    of the turn are one turn's; different ones are refused."""
    ids = {"prompt_token_ids": [1, 2], "generation_token_ids": [3]}
    items: list[dict[str, Any]] = [
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "r"}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", **ids},
        {"type": "function_call_output", "call_id": "c", "output": "4"},
    ]
    parsed = request(instructions="be", input=items)
    conversation, _, params = conversation_of(parsed, tool_table([]))
    assert params.locations == ("instructions", "input[0]", "input[2]", "input[3]")
    assistant = conversation.messages[2]
    assert assistant.ids == TurnIds(prompt=(1, 2), generation=(3,))
    assert params.message_field(2, "prompt_token_ids") == "input[2].prompt_token_ids"
    items[1] |= ids
    assert conversation_of(request(input=items), tool_table([]))[0].messages[1].ids is not None
    items[1] |= {"generation_token_ids": [9]}
    with pytest.raises(InvalidRequest) as caught:
        conversation_of(request(input=items), tool_table([]))
    assert caught.value.param == "input[2].generation_token_ids"


def test_ids_on_a_tool_output_reach_the_core_which_refuses_them() -> None:
    items = [
        {"role": "user", "content": "hi"},
        {"type": "function_call_output", "call_id": "c", "output": "4", "prompt_token_ids": [1]},
    ]
    conversation, _, params = conversation_of(request(input=items), tool_table([]))
    assert conversation.messages[1].ids == TurnIds(prompt=(1,), generation=None)
    assert params.locations == ("input[0]", "input[1]")
