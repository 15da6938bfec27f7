"""A reply's content blocks from its deltas (sans-IO), shared by the stream
encoder and the whole reply, so that both give the same blocks.

Blocks follow one another, each opened, written and closed before the next
opens, in the order the model wrote them: reasoning is a ``thinking`` block,
content a ``text`` block, each tool call a ``tool_use`` block (its id minted
where it opens). A delta may carry several channels (the token that closes
the reasoning and starts the content): the rest of an open tool call's
arguments goes first (text after ``</tool_call>``), then reasoning, content
and new tool calls, the order a model writes them in.

A tool call's arguments pass through an :class:`ObjectGuard`, so a block's
input is one JSON object even where the model's arguments are not: the
Messages API promises clients an object.
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from sluiceway.parsers.json_object import ObjectGuard
from sluiceway.protocol.messages import ChoiceDelta, FinishCause, ToolCallDelta
from sluiceway.surfaces.anthropic.wire import StopReason


class BlockKind(enum.Enum):
    THINKING = "thinking"
    TEXT = "text"
    TOOL_USE = "tool_use"


@dataclass(frozen=True, slots=True, kw_only=True)
class Opened:
    index: int
    kind: BlockKind
    #: A tool_use block's id and function name.
    tool_id: str = ""
    name: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Added:
    """Text of the open block (a tool_use block's: a fragment of its input JSON)."""

    index: int
    kind: BlockKind
    text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Closed:
    index: int
    kind: BlockKind


BlockEvent = Opened | Added | Closed


def tool_use_id() -> str:
    """A new tool_use block's id, in Anthropic's ``toolu_`` form."""
    return f"toolu_{secrets.token_hex(12)}"


def stop_reason(delta: ChoiceDelta) -> tuple[StopReason, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a choice's last delta.

    A choice the scheduler cut off (``CANCELLED``: the server shutting down)
    reads ``end_turn``; the API's enum has no value for it.
    """
    cause = delta.finish
    if cause is FinishCause.MAX_TOKENS:
        return "max_tokens", None
    if cause is FinishCause.STOP_STRING and isinstance(delta.matched_stop, str):
        return "stop_sequence", delta.matched_stop
    return ("tool_use" if delta.called_tools else "end_turn"), None


@dataclass(slots=True)
class _Open:
    index: int
    kind: BlockKind
    call: int = -1  # the tool call a tool_use block carries
    guard: ObjectGuard | None = None


class Blocks:
    """Deltas of one choice -> block events."""

    def __init__(self, mint_id: Callable[[], str] = tool_use_id) -> None:
        self._mint_id = mint_id
        self._open: _Open | None = None
        self._count = 0

    def feed(self, delta: ChoiceDelta) -> list[BlockEvent]:
        """The block events of one delta (the last closes the open block)."""
        events: list[BlockEvent] = []
        calls = list(delta.tool_calls)
        current = self._open
        if current is not None and current.kind is BlockKind.TOOL_USE:
            # The open call's arguments end before any text after the call.
            while calls and calls[0].index == current.call and calls[0].name is None:
                self._arguments(calls.pop(0).arguments, events)
        self._add(BlockKind.THINKING, delta.reasoning, events)
        self._add(BlockKind.TEXT, delta.content, events)
        for call in calls:
            self._call(call, events)
        if delta.finish is not None:
            self._close(events)
        return events

    def _add(self, kind: BlockKind, text: str, events: list[BlockEvent]) -> None:
        if not text:
            return
        current = self._open
        if current is None or current.kind is not kind:
            current = self._start(kind, events)
        events.append(Added(index=current.index, kind=kind, text=text))

    def _call(self, call: ToolCallDelta, events: list[BlockEvent]) -> None:
        current = self._open
        if call.name is not None:
            current = self._start(BlockKind.TOOL_USE, events, call=call)
        elif current is None or current.call != call.index:
            raise RuntimeError(
                f"arguments of tool call {call.index} arrived after its block closed"
            )
        self._arguments(call.arguments, events)

    def _arguments(self, text: str, events: list[BlockEvent]) -> None:
        current = self._open
        assert current is not None
        assert current.guard is not None
        self._emit(current, current.guard.feed(text), events)

    def _emit(self, current: _Open, text: str, events: list[BlockEvent]) -> None:
        if text:
            events.append(Added(index=current.index, kind=current.kind, text=text))

    def _start(
        self, kind: BlockKind, events: list[BlockEvent], call: ToolCallDelta | None = None
    ) -> _Open:
        self._close(events)
        opened = _Open(self._count, kind)
        self._count += 1
        if call is None:
            events.append(Opened(index=opened.index, kind=kind))
        else:
            opened.call, opened.guard = call.index, ObjectGuard()
            tool_id = self._mint_id()
            events.append(
                Opened(index=opened.index, kind=kind, tool_id=tool_id, name=call.name or "")
            )
        self._open = opened
        return opened

    def _close(self, events: list[BlockEvent]) -> None:
        current = self._open
        if current is None:
            return
        if current.guard is not None:
            self._emit(current, current.guard.finish(), events)
        events.append(Closed(index=current.index, kind=current.kind))
        self._open = None
