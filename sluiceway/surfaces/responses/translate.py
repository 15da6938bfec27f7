"""A Responses request onto the neutral conversation.

``instructions`` and ``system``/``developer`` messages become system turns
where they stand; the items an assistant turn produced (``reasoning``, an
assistant ``message``, ``function_call`` and ``custom_tool_call`` items)
gather into one assistant turn, as the chat template expects; tool outputs
become tool turns. The server keeps no state: items that refer to stored
ones are refused.

The items of an assistant turn may carry the ids of the reply they came
from (issue K; the reply puts them on its last output item): the turn
takes them, and its location for errors is that item's (``input[5]``), so
that a refusal names the field the client sent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from sluiceway.protocol.errors import InvalidRequest
from sluiceway.surfaces.conversation import (
    Conversation,
    ConversationParams,
    Message,
    Role,
    ToolCall,
    ToolChoiceMode,
    TurnIds,
    turn_ids,
)
from sluiceway.surfaces.reasoning import reasoning_level
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
    TurnIdsFields,
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
    """The items of one assistant turn, gathered into one message; ``where``:
    its first item, or the item that carried its ids."""

    where: str
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    ids: TurnIds | None = None

    def take_ids(self, item: TurnIdsFields, where: str) -> None:
        ids = _ids(item)
        if ids is None:
            return
        if self.ids is not None and self.ids != ids:
            differs = "prompt" if self.ids.prompt != ids.prompt else "generation"
            param = f"{where}.{differs}_token_ids"
            raise InvalidRequest(
                f"{param}: the items of one assistant turn carry different token ids "
                f"(they came from one reply: send that reply's ids, once is enough)",
                param=param,
            )
        self.ids, self.where = ids, where

    def message(self) -> Message:
        return Message(
            role=Role.ASSISTANT,
            text="".join(self.text),
            reasoning="\n\n".join(self.reasoning),
            tool_calls=tuple(self.calls),
            ids=self.ids,
        )


@dataclass(frozen=True, slots=True)
class Turns:
    """The neutral turns, and where each came from (for errors)."""

    messages: tuple[Message, ...]
    locations: tuple[str, ...]


def _ids(item: TurnIdsFields) -> TurnIds | None:
    return turn_ids(item.prompt_token_ids, item.generation_token_ids)


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
    """A turn that is not the assistant's (ids on it are the core's to refuse)."""
    if isinstance(item, MessageItem):
        text = _text(item.text(), f"{param}.content")
        return Message(role=_ROLES[item.role], text=text, ids=_ids(item))
    if isinstance(item, CallOutputItem):
        return Message(
            role=Role.TOOL,
            text=_text(item.text(), f"{param}.output"),
            tool_call_id=item.call_id,
            ids=_ids(item),
        )
    assert isinstance(item, ItemReference)
    raise InvalidRequest(f"{param} refers to the stored item {item.id!r}; {STATELESS}", param=param)


def turns_of(request: ResponsesRequest) -> Turns:
    """``instructions`` and ``input`` as neutral turns."""
    turns = _TurnsBuilder()
    if request.instructions:
        turns.add(Message(role=Role.SYSTEM, text=request.instructions), "instructions")
    if isinstance(request.input, str):
        turns.add(Message(role=Role.USER, text=request.input), "input")
        return turns.build()
    for index, item in enumerate(request.input):
        turns.item(item, f"input[{index}]")
    return turns.build()


class _TurnsBuilder:
    def __init__(self) -> None:
        self._messages: list[Message] = []
        self._locations: list[str] = []
        self._turn: _AssistantTurn | None = None

    def add(self, message: Message, where: str) -> None:
        self._messages.append(message)
        self._locations.append(where)

    def item(self, item: InputItem, param: str) -> None:
        assistant = isinstance(item, ReasoningItem | FunctionCallItem | CustomToolCallItem) or (
            isinstance(item, MessageItem) and item.role == "assistant"
        )
        if not assistant:
            self._close()
            self.add(_other(item, param), param)
            return
        turn = self._turn
        # A turn's reasoning comes first and its calls last: a reasoning item
        # after text or calls, or text after calls, starts the next turn.
        if turn is not None and (
            (isinstance(item, ReasoningItem) and (turn.text or turn.calls))
            or (isinstance(item, MessageItem) and turn.calls)
        ):
            self._close()
        turn = self._turn = self._turn or _AssistantTurn(where=param)
        if isinstance(item, ReasoningItem):
            turn.reasoning.append(item.text())
        elif isinstance(item, MessageItem):
            turn.text.append(_text(item.text(), f"{param}.content"))
        elif isinstance(item, FunctionCallItem | CustomToolCallItem):
            turn.calls.append(_call(item))
        if isinstance(item, TurnIdsFields):
            turn.take_ids(item, param)

    def _close(self) -> None:
        if self._turn is not None:
            self.add(self._turn.message(), self._turn.where)
            self._turn = None

    def build(self) -> Turns:
        self._close()
        return Turns(tuple(self._messages), tuple(self._locations))


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


def conversation_of(
    request: ResponsesRequest, table: ToolTable
) -> tuple[Conversation, ToolTable, ConversationParams]:
    """The request in neutral terms, the tools on offer, and the names its
    errors give the fields."""
    choice, offered = tool_choice(request, table)
    if not offered.specs and choice is not None and choice.mode is ToolChoiceMode.AUTO:
        # Only hosted tools (not offered): "auto" leaves the model nothing to call.
        choice = None
    turns = turns_of(request)
    conversation = Conversation(
        messages=turns.messages,
        tools=offered.specs,
        tool_choice=choice,
        parallel_tool_calls=request.parallel_tool_calls is not False,
        template_kwargs=request.chat_template_kwargs,
        thinking=thinking(request),
        effort=reasoning_level(request.reasoning.effort if request.reasoning else None),
    )
    params = ConversationParams(
        messages="input", tools="tools", tool_choice="tool_choice", locations=turns.locations
    )
    return conversation, offered, params
