"""A Messages request in neutral terms: blocks onto messages, tool results at
their place, thinking passed back, the thinking switch, thinking cleared,
tools and tool choice, and what is refused by name."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sluiceway.protocol.errors import InvalidRequest
from sluiceway.surfaces import validation
from sluiceway.surfaces.anthropic import translate
from sluiceway.surfaces.anthropic.wire import MessagesRequest
from sluiceway.surfaces.conversation import Message, Role, ToolCall, ToolChoiceMode, TurnIds

USER = {"role": "user", "content": "hi"}


def request(**fields: Any) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 10, "messages": [USER], **fields}
    return validation.parse_request(MessagesRequest, body)


def messages_of(*messages: dict[str, Any], **fields: Any) -> list[Message]:
    return list(translate.conversation_of(request(messages=list(messages), **fields)).messages)


def test_blocks_become_messages_in_order() -> None:
    got = messages_of(
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "system", "content": "mid-conversation"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": "é"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "before"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "4"}, {"type": "text", "text": "2"}],
                    "is_error": True,
                    "cache_control": {"type": "ephemeral"},
                },
                {"type": "text", "text": "after"},
            ],
        },
        system=[{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
    )
    assert got == [
        Message(role=Role.SYSTEM, text="sys"),
        Message(role=Role.USER, text="ab"),
        Message(role=Role.SYSTEM, text="mid-conversation"),
        Message(
            role=Role.ASSISTANT,
            text="Let me look.",
            reasoning="hmm",
            tool_calls=(
                ToolCall(
                    id="toolu_1", name="f", arguments=json.dumps({"x": "é"}, ensure_ascii=False)
                ),
            ),
        ),
        Message(role=Role.USER, text="before"),
        Message(role=Role.TOOL, text="42", tool_call_id="toolu_1", is_error=True),
        Message(role=Role.USER, text="after"),
    ]


@pytest.mark.parametrize(
    ("message", "param", "needle"),
    [
        (
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]},
            "messages[0].content[0]",
            "image blocks are not supported",
        ),
        (
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t",
                        "content": [{"type": "document", "source": {}}],
                    }
                ],
            },
            "messages[0].content[0].content[0]",
            "document blocks are not supported",
        ),
        (
            {
                "role": "user",
                "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
            },
            "messages[0].content[0]",
            "tool_use block cannot be in a user message",
        ),
        (
            {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
            "messages[0].content[0]",
            "tool_result block cannot be in an assistant message",
        ),
        (
            {"role": "system", "content": [{"type": "thinking", "thinking": "x"}]},
            "messages[0].content[0]",
            "thinking block cannot be in a system message",
        ),
    ],
)
def test_what_cannot_be_taken_is_refused_by_name(
    message: dict[str, Any], param: str, needle: str
) -> None:
    with pytest.raises(InvalidRequest) as raised:
        messages_of(message)
    assert raised.value.param == param
    assert needle in raised.value.message


@pytest.mark.parametrize(
    ("thinking", "effort", "switch"),
    [
        (None, None, None),  # the template's own default
        (None, "high", None),
        (None, "low", False),
        ({"type": "enabled", "budget_tokens": 1024}, "low", True),  # said outright
        ({"type": "disabled"}, "max", False),
        ({"type": "adaptive"}, None, True),  # Claude Code's default: the model decides
        ({"type": "adaptive"}, "medium", True),
        ({"type": "adaptive"}, "low", False),
        ({"type": "between_tools"}, None, True),
    ],
)
def test_the_thinking_switch(
    thinking: dict[str, Any] | None, effort: str | None, switch: bool | None
) -> None:
    fields: dict[str, Any] = {}
    if thinking is not None:
        fields["thinking"] = thinking
    if effort is not None:
        fields["output_config"] = {"effort": effort}
    assert translate.conversation_of(request(**fields)).thinking is switch


def turns() -> list[dict[str, Any]]:
    said = [{"type": "thinking", "thinking": "t1"}, {"type": "text", "text": "a1"}]
    again = [{"type": "thinking", "thinking": "t2"}, {"type": "text", "text": "a2"}]
    return [
        USER,
        {"role": "assistant", "content": said},
        USER,
        {"role": "assistant", "content": again},
    ]


@pytest.mark.parametrize(
    ("keep", "kept"),
    [
        ("all", ["t1", "t2"]),
        (None, ["", "t2"]),  # Anthropic's default for the edit: the last turn's
        ({"type": "thinking_turns", "value": 2}, ["t1", "t2"]),
        ({"type": "thinking_turns", "value": 0}, ["", ""]),
    ],
)
def test_clear_thinking_edits(keep: Any, kept: list[str]) -> None:
    edit: dict[str, Any] = {"type": "clear_thinking_20251015"}
    if keep is not None:
        edit["keep"] = keep
    management = {"edits": [{"type": "clear_tool_uses_20250919"}, edit]}
    got = messages_of(*turns(), context_management=management)
    assert [m.reasoning for m in got if m.role is Role.ASSISTANT] == kept


def test_without_an_edit_all_thinking_goes_to_the_template() -> None:
    got = messages_of(*turns())
    assert [m.reasoning for m in got if m.role is Role.ASSISTANT] == ["t1", "t2"]


def test_a_malformed_keep_is_refused() -> None:
    edits = {
        "edits": [{"type": "clear_thinking_20251015", "keep": {"type": "tool_uses", "value": 1}}]
    }
    with pytest.raises(InvalidRequest) as raised:
        messages_of(USER, context_management=edits)
    assert raised.value.param == "context_management.edits[0].keep"


@pytest.mark.parametrize(
    ("choice", "mode", "name", "parallel"),
    [
        ({"type": "auto"}, ToolChoiceMode.AUTO, None, True),
        ({"type": "any", "disable_parallel_tool_use": True}, ToolChoiceMode.REQUIRED, None, False),
        ({"type": "tool", "name": "f"}, ToolChoiceMode.NAMED, "f", True),
        ({"type": "none"}, ToolChoiceMode.NONE, None, True),
    ],
)
def test_tools_and_tool_choice(
    choice: dict[str, Any], mode: ToolChoiceMode, name: str | None, parallel: bool
) -> None:
    tool = {"name": "f", "description": "d", "input_schema": {"type": "object"}, "type": "custom"}
    conversation = translate.conversation_of(request(tools=[tool], tool_choice=choice))
    (spec,) = conversation.tools
    assert (spec.name, spec.description, spec.parameters) == ("f", "d", {"type": "object"})
    assert conversation.tool_choice is not None
    assert (conversation.tool_choice.mode, conversation.tool_choice.name) == (mode, name)
    assert conversation.parallel_tool_calls is parallel


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
        (
            {"output_config": {"format": {"type": "json_schema", "schema": {}}}},
            "output_config.format",
        ),
    ],
)
def test_server_tools_and_output_formats_are_refused(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as raised:
        translate.conversation_of(request(**fields))
    assert raised.value.param == param


def test_unknown_fields_are_accepted_and_sampling_and_stops_carry_over() -> None:
    parsed = request(
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        stop_sequences=["END", "END", "STOP"],
        metadata={"user_id": json.dumps({"device_id": "d"})},
        service_tier="auto",
        speed="fast",
        container=None,
        cache_control={"type": "ephemeral"},
        no_such_field=1,
    )
    assert translate.stop_strings(parsed) == ("END", "STOP")
    assert translate.sampling(parsed) == validation.Sampling(temperature=0.5, top_p=0.9, top_k=5)


def test_max_tokens_is_required() -> None:
    with pytest.raises(InvalidRequest) as raised:
        validation.parse_request(MessagesRequest, {"model": "m", "messages": [USER]})
    assert raised.value.param == "max_tokens"


def test_ids_ride_on_the_message_and_errors_name_it() -> None:
    """A user message with a tool result and text is two neutral turns, both
    located at the client's message; the assistant's ids stay on its turn
    (a ``clear_thinking`` edit keeps them)."""
    assistant = {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
        "prompt_token_ids": [1, 2],
        "generation_token_ids": [3],
    }
    results = {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": "4"},
            {"type": "text", "text": "and?"},
        ],
    }
    management = {"edits": [{"type": "clear_thinking_20251015"}]}
    parsed = request(
        system="be", messages=[USER, assistant, results], context_management=management
    )
    conversation, params = translate.conversation_and_params(parsed)
    assert params.locations == (
        "system",
        "messages[0]",
        "messages[1]",
        "messages[2]",
        "messages[2]",
    )
    assert conversation.messages[2].ids == TurnIds(prompt=(1, 2), generation=(3,))
    assert [message.ids for message in conversation.messages[3:]] == [None, None]
    assert params.message_field(2, "prompt_token_ids") == "messages[1].prompt_token_ids"
