"""gpt-oss's *harmony* format, read by token id.

Theory of operation. A harmony reply is a run of messages, each
``<|start|>ROLE[ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT][ TYPE]
[<|constrain|>TYPE]<|message|>BODY`` closed by ``<|end|>`` (more messages
follow), ``<|call|>`` (a tool call: the reply ends) or ``<|return|>`` (the
reply ends). The generation prompt ends with ``<|start|>assistant``, so the
reply starts inside a header whose role is already given.

The markers are special tokens: they are recognised by token id (found in the
vocabulary by name, :class:`HarmonyTokens`), never by decoded text, so no
text the model writes can open or close a message and no token split of a
channel name (``comment`` + ``ary``) matters. Header text is held until
``<|message|>`` decides what the message is:

- a recipient (``to=NAME`` in the role or after the channel) -> a tool call,
  named ``NAME`` without a ``functions.`` prefix (any other recipient keeps
  its full name); the body is its arguments, streamed as written. A content
  type (``<|constrain|>json``, `` json``) is never part of a name.
- channel ``analysis`` -> reasoning; ``final``, ``commentary`` without a
  recipient (a preamble) and anything else -> content.

Malformed output never raises: text where no header can be (no
``<|start|>``, no channel header) is content as it comes, and a header the
output ends inside is released as content.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from sluiceway.parsers.events import PROMPT_OWNER, Channel, Event, Span, ToolCallOpened, dropped
from sluiceway.parsers.markers import OwnedText
from sluiceway.parsers.stages import StageFinishedError
from sluiceway.protocol.tokens import TokenTable

__all__ = ["HarmonyParser", "HarmonyTokens", "Marker"]


class Marker(enum.Enum):
    """Harmony's special tokens, by their names in the vocabulary."""

    START = "<|start|>"
    CHANNEL = "<|channel|>"
    MESSAGE = "<|message|>"
    END = "<|end|>"
    CONSTRAIN = "<|constrain|>"
    CALL = "<|call|>"
    RETURN = "<|return|>"


@dataclass(frozen=True, slots=True)
class HarmonyTokens:
    """Which token id is which marker (ids the vocabulary lacks are absent)."""

    markers: dict[int, Marker]

    @classmethod
    def of(cls, table: TokenTable) -> HarmonyTokens:
        """The markers of ``table``'s vocabulary, looked up once per vocabulary."""
        memo = table.memo("harmony.markers")
        found = memo.get(0)
        if found is None:
            found = memo[0] = cls._scan(table)
        assert isinstance(found, HarmonyTokens)
        return found

    @classmethod
    def _scan(cls, table: TokenTable) -> HarmonyTokens:
        names = {marker.value.encode(): marker for marker in Marker}
        markers: dict[int, Marker] = {}
        for token_id, raw in enumerate(table.raw_bytes):
            marker = names.get(raw)
            # A special (hidden) token wins over a plain one spelling the same.
            if marker is not None and (marker not in markers.values() or token_id in table.hidden):
                markers = {k: v for k, v in markers.items() if v is not marker}
                markers[token_id] = marker
        return cls(markers)

    def id_of(self, marker: Marker) -> int | None:
        return next((token for token, found in self.markers.items() if found is marker), None)


class _State(enum.Enum):
    BETWEEN = "between"  # outside a message; the role may be implied
    HEADER = "header"  # after <|start|>: the role and maybe a recipient
    CHANNEL = "channel"  # after <|channel|>: the channel, recipient, content type
    BODY = "body"  # after <|message|>
    RAW = "raw"  # text with no header: content until the next marker


#: A recipient in a header (``to=functions.get_weather``).
_RECIPIENT = re.compile(r"to=([^\s]+)")
_FUNCTIONS = "functions."


@dataclass(slots=True)
class _Header:
    """The header in progress: its text by part, and every token it holds."""

    #: (part, text) in order; a part is "role", "channel" or "type" (a content type).
    pieces: list[tuple[str, OwnedText]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # specials and text owners, in order
    part: str = "role"
    #: The role came with the prompt (``<|start|>assistant``): text may be content.
    implied: bool = False

    def add_text(self, token: int, text: str) -> None:
        self.pieces.append((self.part, OwnedText(token, text)))
        self.add_token(token)

    def add_token(self, token: int) -> None:
        if not self.tokens or self.tokens[-1] != token:
            self.tokens.append(token)

    def text(self, part: str, *, generated: bool = False) -> str:
        return "".join(
            piece.text
            for where, piece in self.pieces
            if where == part and (piece.token >= 0 or not generated)
        )


@dataclass(frozen=True, slots=True)
class _Body:
    """Where the open message's text goes."""

    channel: Channel
    tool_index: int = -1
    suppressed: bool = False  # a second call with parallel_tool_calls=False


class HarmonyParser:
    """The text path's reader of harmony: token ids and their text -> routed events.

    It stands first in a :class:`~sluiceway.parsers.pipeline.ChoicePipeline`
    (as its ``reader``) and does the work of both a reasoning and a
    tool-call parser.
    """

    def __init__(self, tokens: HarmonyTokens, *, parallel_tool_calls: bool = True) -> None:
        self._markers = tokens.markers
        self._parallel = parallel_tool_calls
        self._state = _State.BETWEEN
        self._header = _Header(implied=True)
        self._body = _Body(Channel.CONTENT)
        self._calls = 0
        self._finished = False
        self._primed: list[Event] = []  # a call the prompt opened, for the first feed

    # -- the reader surface

    def prime(self, text: str) -> None:
        """Start where the prompt's end leaves the reply (``<|start|>assistant``)."""
        for piece in _MARKER_SPLIT.split(text):
            marker = _BY_NAME.get(piece)
            if marker is not None:
                self._marker(PROMPT_OWNER, marker, self._primed)
            elif piece:
                self._text(PROMPT_OWNER, piece, self._primed)
        if self._state is _State.HEADER:
            self._state = _State.BETWEEN
            self._header.implied = True
        self._primed = [e for e in self._primed if isinstance(e, ToolCallOpened)]

    def feed_token(self, token: int, token_id: int | None, text: str) -> list[Event]:
        """One generated token (``token_id=None``: text flushed for ``token``)."""
        if self._finished:
            raise StageFinishedError("HarmonyParser was fed after finish()")
        out, self._primed = self._primed, []
        marker = self._markers.get(token_id) if token_id is not None else None
        if marker is not None:
            self._marker(token, marker, out)
        elif text:
            self._text(token, text, out)
        return out

    def finish(self) -> list[Event]:
        if self._finished:
            raise StageFinishedError("HarmonyParser was finished twice")
        self._finished = True
        out, self._primed = self._primed, []
        if self._state is not _State.BODY and self._state is not _State.RAW:
            self._break_header(out)
        return out

    @property
    def held_from(self) -> int | None:
        if self._state is _State.BODY or self._state is _State.RAW:
            return None
        return next((token for token in self._header.tokens if token >= 0), None)

    def open_channel(self, upstream: Channel) -> Channel:
        if self._state is _State.BODY:
            return self._body.channel
        return Channel.CONTENT

    @property
    def transparent(self) -> bool:
        return False  # every token id must be seen: any may be a marker

    # -- text

    def _text(self, token: int, text: str, out: list[Event]) -> None:
        state = self._state
        if state is _State.BODY:
            body = self._body
            if body.suppressed:
                out.append(dropped(token, text, Channel.TOOL_CALL))
            else:
                out.append(Span(token, text, body.channel, tool_index=body.tool_index))
        elif state is _State.RAW:
            out.append(_content(token, text))
        else:
            self._header.add_text(token, text)
            if state is _State.BETWEEN and not _may_head(self._header):
                self._break_header(out)
                self._state = _State.RAW

    # -- markers

    def _marker(self, token: int, marker: Marker, out: list[Event]) -> None:
        state = self._state
        in_header = state is not _State.BODY and state is not _State.RAW
        if marker is Marker.MESSAGE and in_header:
            self._header.add_token(token)
            self._open_body(out)
        elif marker is Marker.CHANNEL and state in (_State.BETWEEN, _State.HEADER):
            self._header.add_token(token)
            self._header.part = "channel"
            self._state = _State.CHANNEL
        elif marker is Marker.CONSTRAIN and state in (_State.HEADER, _State.CHANNEL):
            self._header.add_token(token)
            self._header.part = "type"
        elif marker is Marker.START or marker is Marker.CHANNEL:
            # A new header where the last was not closed: what was open ends here.
            if in_header:
                self._break_header(out)
            self._header.add_token(token)
            self._header.part = "channel" if marker is Marker.CHANNEL else "role"
            self._state = _State.CHANNEL if marker is Marker.CHANNEL else _State.HEADER
        elif marker in _ENDS:
            if in_header:
                self._break_header(out)
            out.append(dropped(token, "", self.open_channel(Channel.CONTENT)))
            self._state = _State.BETWEEN
        else:  # a stray <|message|> or <|constrain|> in a body or raw text
            out.append(dropped(token, "", self.open_channel(Channel.CONTENT)))

    def _break_header(self, out: list[Event]) -> None:
        """Release a header that heads no message: its text is content, but
        for the prompt's and whitespace between messages (markup)."""
        header = self._header
        blank = not header.implied and not "".join(p.text for _, p in header.pieces).strip()
        for _, piece in header.pieces:
            if piece.token == PROMPT_OWNER or blank:
                out.append(dropped(piece.token, piece.text, None))
            else:
                out.append(_content(piece.token, piece.text))
        out.extend(dropped(token, "", Channel.CONTENT) for token in header.tokens)
        self._header = _Header()

    def _open_body(self, out: list[Event]) -> None:
        header = self._header
        self._header = _Header()
        self._state = _State.BODY
        for part in ("role", "channel"):
            found = _RECIPIENT.search(header.text(part))
            if found is not None:
                start, end = found.span(1)
                if found.group(1).startswith(_FUNCTIONS):
                    start += len(_FUNCTIONS)
                self._open_call(header, (part, start, end), out)
                return
        words = header.text("channel").split()
        kind = Channel.REASONING if words[:1] == ["analysis"] else Channel.CONTENT
        self._body = _Body(kind)
        out.extend(dropped(piece.token, piece.text, kind) for _, piece in header.pieces)
        out.extend(dropped(token, "", kind) for token in header.tokens)

    def _open_call(self, header: _Header, name: tuple[str, int, int], out: list[Event]) -> None:
        index = self._calls
        self._calls += 1
        suppressed = index > 0 and not self._parallel
        self._body = _Body(Channel.TOOL_CALL, -1 if suppressed else index, suppressed)
        inside, outside = _cut(header.pieces, *name)
        out.extend(dropped(piece.token, piece.text, Channel.TOOL_CALL) for piece in outside)
        out.extend(dropped(token, "", Channel.TOOL_CALL) for token in header.tokens)
        if suppressed:
            out.extend(dropped(piece.token, piece.text, Channel.TOOL_CALL) for piece in inside)
            return
        spans = tuple(Span(p.token, p.text, Channel.TOOL_CALL, tool_index=index) for p in inside)
        out.append(ToolCallOpened(index, spans))


_ENDS = frozenset({Marker.END, Marker.CALL, Marker.RETURN})
_BY_NAME = {marker.value: marker for marker in Marker}
_MARKER_SPLIT = re.compile("(" + "|".join(re.escape(name) for name in _BY_NAME) + ")")


def _content(token: int, text: str) -> Span:
    return Span(token, text, Channel.CONTENT)


def _may_head(header: _Header) -> bool:
    """Whether text after an implied role (no ``<|start|>`` in the output)
    can still be the rest of its header (`` to=NAME``) rather than content."""
    text = header.text("role", generated=True).lstrip()
    return "to=".startswith(text) or text.startswith("to=")


def _cut(
    pieces: Sequence[tuple[str, OwnedText]], part: str, start: int, end: int
) -> tuple[list[OwnedText], list[OwnedText]]:
    """Characters ``[start, end)`` of one part's text (owners kept), and all the others."""
    inside: list[OwnedText] = []
    outside: list[OwnedText] = []
    position = 0
    for where, piece in pieces:
        if where != part:
            outside.append(piece)
            continue
        a, b = position, position + len(piece.text)
        position = b
        lo, hi = max(a, start), min(b, end)
        if lo >= hi:
            outside.append(piece)
            continue
        inside.append(OwnedText(piece.token, piece.text[lo - a : hi - a]))
        outside.extend(
            OwnedText(piece.token, text)
            for text in (piece.text[: lo - a], piece.text[hi - a :])
            if text
        )
    return inside, outside
