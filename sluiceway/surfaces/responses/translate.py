"""A Responses request onto the neutral conversation.

``instructions`` and ``system``/``developer`` messages become system turns
where they stand; the items an assistant turn produced (``reasoning``, an
assistant ``message``, ``function_call`` and ``custom_tool_call`` items)
gather into one assistant turn, as the chat template expects; tool outputs
become tool turns. The server keeps no state: items that refer to stored
ones are refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from sluiceway.protocol.errors import InvalidRequest
from sluiceway.surfaces.conversation import (
    Conversation,
    Message,
    Role,
    ToolCall,
    ToolChoiceMode,
)
from sluiceway.surfaces.responses.tools import CUSTOM_INPUT, ToolTable, qualified, tool_choice
from sluiceway.surfaces.responses.wire import (
    CallOutputItem,
    CustomToolCallItem,
    FunctionCallItem,
    InputItem,
    ItemReference,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)

STATELESS = (
    "this server is stateless: it stores no responses or conversations, so send the "
    "whole conversation in `input` instead"
)

_ROLES = {
    "user": Role.USER,
    "assistant": Role.ASSISTANT,
    "system": Role.SYSTEM,
    "developer": Role.SYSTEM,
}

#: Effort levels that mean "do not think".
_NO_THINKING = frozenset({"none", "minimal"})


@dataclass(slots=True)
class _AssistantTurn:
    """The items of one assistant turn, gathered into one message."""

    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)

    def message(self) -> Message:
        return Message(
            role=Role.ASSISTANT,
            text="".join(self.text),
            reasoning="\n\n".join(self.reasoning),
            tool_calls=tuple(self.calls),
        )


def _text(text: str | None, param: str) -> str:
    if text is None:
        raise InvalidRequest(
            f"{param}: images, files and audio are not supported (the model reads text)",
            param=param,
        )
    return text


def _call(item: FunctionCallItem | CustomToolCallItem) -> ToolCall:
    if isinstance(item, CustomToolCallItem):
        arguments = json.dumps({CUSTOM_INPUT: item.input}, ensure_ascii=False)
    else:
        arguments = item.arguments
    return ToolCall(id=item.call_id, name=qualified(item.namespace, item.name), arguments=arguments)


def _other(item: InputItem, param: str) -> Message:
    """A turn that is not the assistant's."""
    if isinstance(item, MessageItem):
        return Message(role=_ROLES[item.role], text=_text(item.text(), f"{param}.content"))
    if isinstance(item, CallOutputItem):
        return Message(
            role=Role.TOOL, text=_text(item.text(), f"{param}.output"), tool_call_id=item.call_id
        )
    assert isinstance(item, ItemReference)
    raise InvalidRequest(f"{param} refers to the stored item {item.id!r}; {STATELESS}", param=param)


def messages_of(request: ResponsesRequest) -> tuple[Message, ...]:
    """``instructions`` and ``input`` as neutral turns."""
    messages = []
    if request.instructions:
        messages.append(Message(role=Role.SYSTEM, text=request.instructions))
    if isinstance(request.input, str):
        messages.append(Message(role=Role.USER, text=request.input))
        return tuple(messages)
    turn: _AssistantTurn | None = None
    for index, item in enumerate(request.input):
        param = f"input[{index}]"
        assistant = isinstance(item, ReasoningItem | FunctionCallItem | CustomToolCallItem) or (
            isinstance(item, MessageItem) and item.role == "assistant"
        )
        if not assistant:
            if turn is not None:
                messages.append(turn.message())
                turn = None
            messages.append(_other(item, param))
            continue
        # A turn's reasoning comes first and its calls last: a reasoning item
        # after text or calls, or text after calls, starts the next turn.
        if turn is not None and (
            (isinstance(item, ReasoningItem) and (turn.text or turn.calls))
            or (isinstance(item, MessageItem) and turn.calls)
        ):
            messages.append(turn.message())
            turn = None
        turn = turn or _AssistantTurn()
        if isinstance(item, ReasoningItem):
            turn.reasoning.append(item.text())
        elif isinstance(item, MessageItem):
            turn.text.append(_text(item.text(), f"{param}.content"))
        elif isinstance(item, FunctionCallItem | CustomToolCallItem):
            turn.calls.append(_call(item))
    if turn is not None:
        messages.append(turn.message())
    return tuple(messages)


def check_stateless(request: ResponsesRequest) -> None:
    """Refuse what needs stored state, saying why."""
    for name in ("previous_response_id", "conversation", "prompt"):
        if getattr(request, name) is not None:
            raise InvalidRequest(f"{name} is not supported: {STATELESS}", param=name)
    if request.background:
        raise InvalidRequest(
            "background responses are not supported: this server is stateless and answers "
            "on the request's own connection",
            param="background",
        )


def check_settings(request: ResponsesRequest) -> None:
    if request.truncation == "auto":
        raise InvalidRequest(
            "truncation 'auto' is not supported: this server never drops input items "
            "(a conversation that does not fit is a 400)",
            param="truncation",
        )


def thinking(request: ResponsesRequest) -> bool | None:
    """Thinking on or off from ``reasoning.effort`` (None: the template's default)."""
    effort = request.reasoning.effort if request.reasoning is not None else None
    if effort is None:
        return None
    return effort not in _NO_THINKING


def conversation_of(request: ResponsesRequest, table: ToolTable) -> tuple[Conversation, ToolTable]:
    """The request in neutral terms, and the tools on offer."""
    choice, offered = tool_choice(request, table)
    if not offered.specs and choice is not None and choice.mode is ToolChoiceMode.AUTO:
        # Only hosted tools (not offered): "auto" leaves the model nothing to call.
        choice = None
    conversation = Conversation(
        messages=messages_of(request),
        tools=offered.specs,
        tool_choice=choice,
        parallel_tool_calls=request.parallel_tool_calls is not False,
        template_kwargs=request.chat_template_kwargs,
        thinking=thinking(request),
    )
    return conversation, offered
