"""A tagged parameter's value, read up to its closing tag and built into JSON.

One newline right after the opening and one right before the closing tag are
markup. A string value streams as it arrives, escaped piece by piece; any
other value is held until the closing tag and then typed by the schema
(:func:`~sluiceway.parsers.formats.arguments.typed_json`). Value characters
are owned by the tokens that wrote them; the built quotes by the token whose
text called for them.
"""

from __future__ import annotations

from collections.abc import Callable

from sluiceway.parsers.events import Channel, Event, Span, dropped
from sluiceway.parsers.formats.arguments import json_escape, typed_json
from sluiceway.parsers.markers import MarkerFound, MarkerScanner, MarkerSet
from sluiceway.parsers.stages import spans_of

#: Makes an argument span of the call in progress.
Argument = Callable[[int, str], Span]


class ValueReader:
    def __init__(self, close: str, *, string: bool, schema: object) -> None:
        self._scanner = MarkerScanner(MarkerSet(("\n" + close, close)))
        self._string = string
        self._schema = schema
        self._started = False
        #: A non-string value's (token, text) pieces, held until it closes.
        self._typed: list[tuple[int, str]] = []

    @property
    def held_from(self) -> int | None:
        typed = self._typed[0][0] if self._typed else None
        held = [owner for owner in (self._scanner.held_from, typed) if owner is not None]
        return min(held) if held else None

    def read(
        self, token: int, text: str, position: int, argument: Argument, out: list[Event]
    ) -> tuple[int, bool]:
        """Read from ``position``; return where it stopped and whether the value closed."""
        if not self._started:
            self._started = True
            if text[position] == "\n":
                out.append(dropped(token, "\n", Channel.TOOL_CALL))
                return position + 1, False
        events, position = self._scanner.scan(token, text, position)
        for event in events:
            if isinstance(event, MarkerFound):
                out.extend(spans_of(event.pieces, Channel.DROPPED, Channel.TOOL_CALL))
                self._close(event.pieces[-1].token, argument, out)
                return position, True
            self._emit(event.token, event.text, argument, out)
        return position, False

    def flush(self, argument: Argument, out: list[Event]) -> None:
        """The reply ends inside the value: what is held goes out as it is."""
        for piece in self._scanner.finish():
            self._emit(piece.token, piece.text, argument, out)
        out.extend(argument(token, text) for token, text in self._typed)
        self._typed = []

    def _emit(self, token: int, text: str, argument: Argument, out: list[Event]) -> None:
        if not text:
            return
        if self._string:
            out.append(argument(token, json_escape(text)))
        else:
            self._typed.append((token, text))

    def _close(self, token: int, argument: Argument, out: list[Event]) -> None:
        if self._string:
            out.append(argument(token, '"'))
            return
        pieces = self._typed
        self._typed = []
        text = "".join(piece for _, piece in pieces)
        value = typed_json(text, self._schema)
        if value == text:
            out.extend(argument(t, piece) for t, piece in pieces)
        elif not text.strip():
            # Whitespace is valid around a JSON value; the value itself is null.
            out.extend(argument(t, piece) for t, piece in pieces)
            out.append(argument(token, value))
        elif value.startswith('"') and not text.startswith('"'):
            out.append(argument(pieces[0][0], '"'))
            out.extend(argument(t, json_escape(piece)) for t, piece in pieces)
            out.append(argument(token, '"'))
        else:
            # A literal spelled otherwise (True, 140.0): the first token owns it.
            out.append(argument(pieces[0][0], value))
            out.extend(dropped(t, piece, Channel.TOOL_CALL) for t, piece in pieces[1:])
