"""One choice's deltas -> the output items of a Responses reply, in the order
the model wrote them, and the item events that build them.

Theory of operation: one item is open at a time. Reasoning text goes to a
``reasoning`` item, content to a ``message``, each tool call to a
``function_call`` or ``custom_tool_call`` item; text of another kind than
the open item's closes it and opens the next (a choice's delta carries
reasoning, then content, then tool calls, the order the parsers release
them in). The choice's last delta closes the open item: ``incomplete`` when
the token limit cut it off.

Logprob entries of content tokens travel with the content they arrive with
(the alignment contract). Entries that arrive without text -- tokens that
own no visible character, which the text path hands over with the
choice's final delta -- ride on an empty ``output_text.delta`` of the open
message, so the deltas' entries always add up to the message's; with no
message open they are not reported (the Responses API has logprobs for
message text only).

The choice's generated ids (``return_token_ids``) are gathered whole: they
ride on the item the choice's end closes, the turn's last (issue K).

Sans-IO: the stream encoder frames the events, the whole-reply accumulator
keeps only the items.
"""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass, field

from sluiceway.protocol.messages import ChoiceDelta, FinishCause, LogprobEntry, ToolCallDelta
from sluiceway.surfaces.responses.tools import ToolTable, custom_input


class ItemKind(enum.Enum):
    MESSAGE = "msg"
    REASONING = "rs"
    FUNCTION_CALL = "fc"
    CUSTOM_TOOL_CALL = "ctc"


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


@dataclass(slots=True, kw_only=True)
class OutputItem:
    """An output item being built (or built: ``status`` is no longer
    ``in_progress``). ``parts`` is its text: message text, reasoning text,
    or a call's arguments as the model wrote them."""

    kind: ItemKind
    id: str
    index: int
    parts: list[str] = field(default_factory=list)
    entries: list[LogprobEntry] = field(default_factory=list)
    status: str = "in_progress"
    call_index: int = -1
    call_id: str = ""
    name: str = ""
    namespace: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def custom_input(self) -> str:
        return custom_input(self.text)

    @property
    def is_call(self) -> bool:
        return self.kind in (ItemKind.FUNCTION_CALL, ItemKind.CUSTOM_TOOL_CALL)


@dataclass(frozen=True, slots=True)
class ItemAdded:
    item: OutputItem


@dataclass(frozen=True, slots=True)
class ItemDone:
    item: OutputItem


@dataclass(frozen=True, slots=True)
class TextAdded:
    """Text added to the item: message or reasoning text, or call arguments
    (``entries``: the logprob entries that travel with message text)."""

    item: OutputItem
    text: str
    entries: tuple[LogprobEntry, ...] = ()


ItemEvent = ItemAdded | ItemDone | TextAdded


class OutputItems:
    """The sans-IO core: ``feed`` each delta of the choice, in order."""

    def __init__(self, tools: ToolTable, *, logprobs: bool) -> None:
        self._tools = tools
        self._logprobs = logprobs
        self.items: list[OutputItem] = []
        self._open: OutputItem | None = None
        #: Why the choice ended, once it has.
        self.finish: FinishCause | None = None
        #: The choice's generated ids, as the deltas bring them.
        self.token_ids: list[int] = []
        #: The item the choice's end closed: the turn's last.
        self.last: OutputItem | None = None

    def feed(self, delta: ChoiceDelta) -> list[ItemEvent]:
        events: list[ItemEvent] = []
        self.token_ids += delta.token_ids
        if delta.reasoning:
            item = self._item(ItemKind.REASONING, events)
            events.append(self._add(item, delta.reasoning))
        entries = delta.logprobs.content if self._logprobs and delta.logprobs else ()
        if delta.content:
            item = self._item(ItemKind.MESSAGE, events)
            events.append(self._add(item, delta.content, entries))
        elif entries and self._open is not None and self._open.kind is ItemKind.MESSAGE:
            events.append(self._add(self._open, "", entries))
        for call in delta.tool_calls:
            events += self._call(call)
        if delta.finish is not None:
            self.finish = delta.finish
            incomplete = delta.finish is FinishCause.MAX_TOKENS
            self.last = self._open
            events += self._close("incomplete" if incomplete else "completed")
        return events

    def _add(
        self, item: OutputItem, text: str, entries: tuple[LogprobEntry, ...] = ()
    ) -> TextAdded:
        item.parts.append(text)
        item.entries += entries
        return TextAdded(item, text, entries)

    def _item(self, kind: ItemKind, events: list[ItemEvent]) -> OutputItem:
        """The open item if it is of this kind, else a new one."""
        if self._open is not None and self._open.kind is kind:
            return self._open
        return self._start(
            OutputItem(kind=kind, id=new_id(kind.value), index=len(self.items)), events
        )

    def _start(self, item: OutputItem, events: list[ItemEvent]) -> OutputItem:
        events += self._close("completed")
        self.items.append(item)
        self._open = item
        events.append(ItemAdded(item))
        return item

    def _call(self, call: ToolCallDelta) -> list[ItemEvent]:
        events: list[ItemEvent] = []
        if call.name is not None:
            ref = self._tools.ref(call.name)
            kind = ItemKind.CUSTOM_TOOL_CALL if ref.custom else ItemKind.FUNCTION_CALL
            item = OutputItem(
                kind=kind,
                id=new_id(kind.value),
                index=len(self.items),
                call_index=call.index,
                call_id=call.call_id or new_id("call"),
                name=ref.name,
                namespace=ref.namespace,
            )
            self._start(item, events)
        else:
            item = self._call_item(call.index)
        if call.arguments:
            events.append(self._add(item, call.arguments))
        return events

    def _call_item(self, index: int) -> OutputItem:
        """The item of a call whose name went out earlier (the parsers finish
        one call before the next starts, so it is the open one)."""
        for item in reversed(self.items):
            if item.is_call and item.call_index == index:
                return item
        raise ValueError(f"arguments for tool call {index} before its name")

    def _close(self, status: str) -> list[ItemEvent]:
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status
        return [ItemDone(item)]
