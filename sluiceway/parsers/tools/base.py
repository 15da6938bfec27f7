"""What the tool-call parsers share: the ``<tool_call>`` envelope machinery.

Theory of operation. A tool-call parser reads content (reasoning and other
channels pass through) in *phases*, one enum per dialect with an explicit
transition table. In the text phase a :class:`MarkerScanner` looks for
``<tool_call>``. From there the dialect's envelope is matched character by
character:

- Before the function name is complete the call is *uncommitted*: every
  character is held, since if the envelope breaks it is all ordinary content.
  On a break the first held character is released as content and the rest is
  read again in the text phase (it holds no ``<`` but the tag's own, and the
  breaking character, so nothing is read more than twice); prompt text from
  :meth:`prime` is dropped instead, it was never output.
- When the name is complete the call is *committed*: :class:`ToolCallOpened`
  goes out and the held envelope is dropped as tool-call markup. From then on
  whitespace between envelope parts is dropped at once, and only a literal in
  progress (``</tool_ca``) is held. A committed call whose envelope breaks ends
  there; the partial literal is read again as content.
- Arguments stream as they are generated; the dialect decides how.

With ``parallel_tool_calls=False`` a second committed call is *suppressed*: the
same grammar runs, but its name and arguments are dropped as tool-call markup.
"""

from __future__ import annotations

import abc
import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from sluiceway.parsers.events import (
    PROMPT_OWNER,
    Channel,
    Event,
    Span,
    ToolCallOpened,
    content,
    dropped,
)
from sluiceway.parsers.markers import HeldText, MarkerFound, MarkerScanner, MarkerSet, OwnedText
from sluiceway.parsers.stages import (
    WHITESPACE,
    IllegalTransitionError,
    PrimeError,
    SpanStage,
    spans_of,
)

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"

_OPEN_MARKERS = MarkerSet((OPEN_TAG,))


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolSchema:
    """A tool the request offers: its function name and JSON schema of parameters."""

    name: str
    parameters: Mapping[str, Any]


P = TypeVar("P", bound=enum.Enum)


@dataclass(frozen=True, slots=True)
class Grammar(Generic[P]):
    """A dialect's phases, as data.

    ``literals`` maps a phase to the literals it accepts after optional
    whitespace, each with the phase that follows it. ``committed`` are the
    phases inside a committed call.
    """

    text: P
    envelope: P
    literals: Mapping[P, tuple[tuple[str, P], ...]]
    committed: frozenset[P]
    transitions: Mapping[P, frozenset[P]]


class ToolCallParser(SpanStage, Generic[P]):
    """The last stage of a choice's text path: content -> content/tool calls/markup."""

    def __init__(
        self,
        grammar: Grammar[P],
        *,
        tools: tuple[ToolSchema, ...] = (),
        parallel_tool_calls: bool = True,
    ) -> None:
        super().__init__((Channel.CONTENT,))
        self._grammar = grammar
        self._phase = grammar.text
        self._tools = {tool.name: tool for tool in tools}
        self._parallel = parallel_tool_calls
        self._scanner = MarkerScanner(_OPEN_MARKERS)
        self._held = HeldText()  # the envelope held back (see the module comment)
        self._literal = ""  # the part of the current phase's literal matched so far
        self._reported = 0  # calls reported so far; the next call's index
        self._index = -1  # the committed call's index (-1 when suppressed or none)
        self._suppressed = False
        self._primed: list[Event] = []

    # -- the TextStage surface

    @property
    def held_from(self) -> int | None:
        owners = [self._scanner.held_from, self._held.first_owner_at_least(0), self._extra_held()]
        real = [owner for owner in owners if owner is not None and owner >= 0]
        return min(real) if real else None

    def open_channel(self, upstream: Channel) -> Channel:
        return Channel.TOOL_CALL if self._phase in self._grammar.committed else upstream

    def feed(self, events: Sequence[Event]) -> list[Event]:
        out = super().feed(events)
        if self._primed:
            out[:0] = self._primed
            self._primed = []
        return out

    def finish(self) -> list[Event]:
        out = super().finish()
        if self._primed:
            out[:0] = self._primed
            self._primed = []
        return out

    def prime(self, text: str) -> None:
        """Read a forced assistant prefix (a tool call the prompt already opened)."""
        if self._started:
            raise PrimeError("a tool-call parser can only be primed before it is fed")
        out: list[Event] = []
        self._feed_owned(PROMPT_OWNER, text, out)
        for event in out:
            if isinstance(event, ToolCallOpened):
                self._primed.append(event)
            elif event.channel is not Channel.DROPPED:
                raise PrimeError(f"{text!r} does not start a tool call")
        if text and self._phase is self._grammar.text:
            raise PrimeError(f"{text!r} does not leave a tool call open")

    # -- dialect hooks

    @abc.abstractmethod
    def _step(self, token: int, text: str, position: int, out: list[Event]) -> int:
        """Consume from ``position`` in the current (non-literal) phase; return where it stopped."""

    def _extra_held(self) -> int | None:
        """The first owner of text a dialect holds outside the envelope."""
        return None

    def _flush_call(self, out: list[Event]) -> None:
        """The handled text ends inside a committed call: release what the dialect holds."""

    def _abandon_call(self, token: int, out: list[Event]) -> None:
        """A committed call's envelope broke at a character of ``token``."""

    def _after_literal(self, token: int, literal: str, out: list[Event]) -> None:
        """A literal of the envelope completed (the last character owned by ``token``)."""

    # -- routing

    def _feed_text(self, span: Span, out: list[Event]) -> None:
        self._feed_owned(span.token, span.text, out)

    def _feed_owned(self, token: int, text: str, out: list[Event]) -> None:
        position = 0
        literals = self._grammar.literals
        while position < len(text):
            if self._phase is self._grammar.text:
                position = self._scan_text(token, text, position, out)
            elif self._phase in literals:
                position = self._expect(token, text, position, out)
            else:
                position = self._step(token, text, position, out)

    def _flush(self, out: list[Event]) -> None:
        # An uncommitted envelope is content; reading it again may hold
        # another one, so repeat (each round releases at least one character).
        while self._phase is not self._grammar.text and not self._committed and self._held:
            self._break_uncommitted(out)
        if self._committed:
            # The rest of a literal in progress is envelope markup of a
            # committed call: it cannot become anything else any more.
            self._literal = ""
            out.extend(self._markup(self._held.take_all()))
            self._flush_call(out)
        out.extend(_content_or_dropped(self._scanner.finish()))

    @property
    def _committed(self) -> bool:
        return self._phase in self._grammar.committed

    def _enter(self, phase: P) -> None:
        if phase not in self._grammar.transitions[self._phase]:
            raise IllegalTransitionError(f"{type(self).__name__}: {self._phase} -> {phase}")
        self._phase = phase

    def _scan_text(self, token: int, text: str, position: int, out: list[Event]) -> int:
        events, position = self._scanner.scan(token, text, position)
        for event in events:
            if isinstance(event, MarkerFound):
                for piece in event.pieces:
                    self._held.append(piece.token, piece.text)
                self._enter(self._grammar.envelope)
            else:
                out.extend(_content_or_dropped((event,)))
        return position

    def _expect(self, token: int, text: str, position: int, out: list[Event]) -> int:
        """Optional whitespace, then one of the phase's literals."""
        options = self._grammar.literals[self._phase]
        while position < len(text):
            char = text[position]
            if not self._literal and char in WHITESPACE:
                self._hold_or_drop(token, char, out)
                position += 1
                continue
            candidate = self._literal + char
            alive = [(literal, nxt) for literal, nxt in options if literal.startswith(candidate)]
            if not alive:
                self._break(token, out)
                return position  # the breaking character is read again
            self._held.append(token, char)
            self._literal = candidate
            position += 1
            for literal, nxt in alive:
                if literal == candidate:
                    self._literal = ""
                    if self._committed:
                        out.extend(self._markup(self._held.take_all()))
                    self._enter(nxt)
                    self._after_literal(token, literal, out)
                    return position
        return position

    def _hold_or_drop(self, token: int, text: str, out: list[Event]) -> None:
        """Envelope text that is markup if the call commits (or already has)."""
        if self._committed:
            out.append(dropped(token, text, Channel.TOOL_CALL))
        else:
            self._held.append(token, text)

    def _break(self, token: int, out: list[Event]) -> None:
        if self._committed:
            self._abandon_call(token, out)
            self._end_call()
            self._literal = ""
            self._enter(self._grammar.text)
            for piece in self._held.take_all():
                self._feed_owned(piece.token, piece.text, out)
        else:
            self._break_uncommitted(out)

    def _break_uncommitted(self, out: list[Event]) -> None:
        """The envelope broke before the name was complete: it was ordinary content."""
        self._literal = ""
        self._enter(self._grammar.text)
        pieces = self._held.take_all()
        if pieces and pieces[0].token != PROMPT_OWNER:
            # The held text starts with the model's own <tool_call>: release its
            # "<" so that reading the rest again cannot find the same tag.
            first = pieces[0]
            out.append(content(first.token, first.text[0]))
            pieces[0] = OwnedText(first.token, first.text[1:])
        for piece in pieces:
            if piece.token == PROMPT_OWNER:
                out.append(dropped(piece.token, piece.text, Channel.TOOL_CALL))
            elif piece.text:
                self._feed_owned(piece.token, piece.text, out)

    # -- committing and ending calls

    def _commit(self, name_from: int, out: list[Event]) -> None:
        """The name is complete: held[:name_from] is markup, the rest is the name."""
        out.extend(self._markup(self._held.take(name_from)))
        name = self._held.take_all()
        self._suppressed = not self._parallel and self._reported > 0
        if self._suppressed:
            self._index = -1
            out.extend(self._markup(name))
            return
        self._index = self._reported
        self._reported += 1
        spans = tuple(
            Span(piece.token, piece.text, Channel.TOOL_CALL, tool_index=self._index)
            for piece in name
        )
        out.append(ToolCallOpened(self._index, spans))

    def _on_trailing(self, token: int, text: str, position: int, out: list[Event]) -> int:
        """Whitespace after ``</tool_call>`` is markup; anything else is text again."""
        end = position
        while end < len(text) and text[end] in WHITESPACE:
            end += 1
        if end > position:
            out.append(dropped(token, text[position:end], Channel.TOOL_CALL))
        if end < len(text):
            self._enter(self._grammar.text)
        return end

    def _end_call(self) -> None:
        self._index = -1
        self._suppressed = False

    def _argument(self, token: int, text: str) -> Span:
        if self._suppressed:
            return dropped(token, text, Channel.TOOL_CALL)
        return Span(token, text, Channel.TOOL_CALL, tool_index=self._index)

    def _markup(self, pieces: list[OwnedText]) -> list[Span]:
        return spans_of(pieces, Channel.DROPPED, Channel.TOOL_CALL)

    def _tool(self, name: str) -> ToolSchema | None:
        return self._tools.get(name)


def name_run(pattern: re.Pattern[str], text: str, position: int) -> int:
    """The end of the run of name characters at ``position``."""
    found = pattern.match(text, position)
    return position if found is None else found.end()


def _content_or_dropped(pieces: tuple[OwnedText, ...] | list[OwnedText]) -> list[Span]:
    # Prompt text (from prime) is never output.
    return [
        dropped(piece.token, piece.text, Channel.TOOL_CALL)
        if piece.token == PROMPT_OWNER
        else content(piece.token, piece.text)
        for piece in pieces
        if piece.text
    ]
