"""The turns of a conversation in neutral terms: what every chat-like surface
maps its messages onto (``conversation.py`` renders them, ``exact_turns.py``
splices the ids an earlier reply returned)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class Role(enum.Enum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCall:
    """A call an assistant turn made (passed back in the history)."""

    id: str
    name: str
    #: The arguments as the model wrote them: a JSON object's text.
    arguments: str


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnIds:
    """The ids of the reply an assistant turn came from, sent back by the
    client (issue K): the prompt the model saw and the ids it generated.
    Either may be missing on the wire; the splice reports which."""

    prompt: tuple[int, ...] | None = None
    generation: tuple[int, ...] | None = None


def turn_ids(prompt: Sequence[int] | None, generation: Sequence[int] | None) -> TurnIds | None:
    """The ids a message carries on the wire (None: it carries none)."""
    if prompt is None and generation is None:
        return None
    return TurnIds(
        prompt=None if prompt is None else tuple(prompt),
        generation=None if generation is None else tuple(generation),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """One turn of a conversation, in any surface's terms.

    A system turn may sit anywhere in the history; an assistant turn may
    carry the reasoning (thinking) it produced and the tool calls it made; a
    tool turn is the result of the call ``tool_call_id``, ``is_error`` when
    the tool reports a failure. ``ids``: the ids an assistant turn's reply
    came with, when the client sends them back.
    """

    role: Role
    text: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    is_error: bool = False
    ids: TurnIds | None = None
