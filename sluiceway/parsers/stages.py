"""Scaffolding shared by the text stages (reasoning, stop, tool-call parsers).

Theory of operation: a stage *handles* the spans of some channels and passes
every other event through. To keep order, an event it passes through is a
barrier: whatever the stage holds is released first (as if the handled text
ended there), then the event goes out. With the fixed stage order this only
happens at real boundaries -- reasoning markup before any content, a removed
stop string after all of it -- so no tag or stop string is ever split by one.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence

from sluiceway.parsers.events import Channel, Event, Span
from sluiceway.parsers.markers import OwnedText

#: Whitespace as the grammars here (and JSON) know it.
WHITESPACE = frozenset(" \t\r\n")


class ParserError(Exception):
    """Illegal use of a text stage (a programming error in the caller)."""


class StageFinishedError(ParserError):
    """A stage was fed (or finished) after it had finished."""


class PrimeError(ParserError):
    """A stage was primed after it was fed, or with text its grammar cannot start with."""


class IllegalTransitionError(ParserError):
    """A state machine was asked for a transition its table does not allow."""


class SpanStage(abc.ABC):
    """A :class:`~sluiceway.parsers.pipeline.TextStage` that handles some channels.

    Subclasses implement the grammar on owned text (``_feed_text``) and the
    release of held text (``_flush``); this class routes events, keeps the
    barrier rule and refuses use after :meth:`finish`.
    """

    def __init__(self, handled: Iterable[Channel]) -> None:
        self._handled = frozenset(handled)
        self._started = False
        self._finished = False

    def feed(self, events: Sequence[Event]) -> list[Event]:
        if self._finished:
            raise StageFinishedError(f"{type(self).__name__} was fed after finish()")
        self._started = True
        out: list[Event] = []
        for event in events:
            if isinstance(event, Span) and event.channel in self._handled:
                if event.text:
                    self._feed_text(event, out)
            else:
                self._flush(out)
                self._pass(event, out)
        return out

    def finish(self) -> list[Event]:
        if self._finished:
            raise StageFinishedError(f"{type(self).__name__} was finished twice")
        self._started = True
        out: list[Event] = []
        self._flush(out)
        self._finished = True
        return out

    @property
    def transparent(self) -> bool:
        """See :class:`~sluiceway.parsers.pipeline.TextStage`; no by default."""
        return False

    @property
    @abc.abstractmethod
    def held_from(self) -> int | None:
        """The smallest owner token of text this stage holds back, if any."""

    @abc.abstractmethod
    def open_channel(self, upstream: Channel) -> Channel:
        """The channel open after this stage, given the one open upstream of it."""

    @abc.abstractmethod
    def _feed_text(self, span: Span, out: list[Event]) -> None:
        """Take one non-empty span of a handled channel."""

    @abc.abstractmethod
    def _flush(self, out: list[Event]) -> None:
        """Release everything held, as the end of the handled text would."""

    def _pass(self, event: Event, out: list[Event]) -> None:
        out.append(event)


def spans_of(
    pieces: Iterable[OwnedText], channel: Channel, markup: Channel | None = None
) -> list[Span]:
    """Owned pieces as spans of one channel (or dropped with ``markup``)."""
    return [Span(piece.token, piece.text, channel, markup) for piece in pieces if piece.text]
