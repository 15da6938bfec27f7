"""The stop-string matcher: ends the output at the first stop string to complete.

Theory of operation: one Aho-Corasick automaton over the stop strings
(:class:`MarkerSet`), stepped once per character. Its state is the longest
suffix of the text that could still begin a stop string, so that suffix -- and
only it -- is held back.

The first stop string to complete ends the output, at the character that
completes it, as OpenAI's API, vLLM and llama.cpp stop at the first stop
string found: the request ends on that token, not one later, and a longer
stop string that started earlier and might still complete is not waited for
(stop strings ``"abcd"`` and ``"bc"`` on ``"abc"``: ``"bc"`` ends it). Among
stop strings completing at the same character, the longest (it starts first)
wins. The cut is the same however the text is split into tokens. The text
before the match is released, the stop string is released
(``include_stop_str_in_output``) or dropped, and every later character is
dropped.

A match that completes in a token with index below ``min_tokens`` does not
count. Text of one channel is matched as one stream; a change of channel (or a
passed-through event) ends it, so no stop string spans reasoning and content.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from types import MappingProxyType

from sluiceway.parsers.events import Channel, Event, Span, dropped
from sluiceway.parsers.markers import INITIAL_STATE, HeldText, MarkerSet
from sluiceway.parsers.stages import IllegalTransitionError, ParserError, SpanStage, spans_of

#: OpenAI's limit is 4; vLLM and others accept more. Sixteen bounds the automaton.
MAX_STOP_STRINGS = 16


class InvalidStopError(ParserError, ValueError):
    """The stop options cannot be matched (empty strings, too many, negative min_tokens)."""


class StopState(enum.Enum):
    SCANNING = "scanning"
    MATCHED = "matched"


_TRANSITIONS: MappingProxyType[StopState, frozenset[StopState]] = MappingProxyType(
    {StopState.SCANNING: frozenset({StopState.MATCHED}), StopState.MATCHED: frozenset()}
)


class StopMatcher(SpanStage):
    """A :class:`~sluiceway.parsers.pipeline.StopStage` for stop strings."""

    def __init__(
        self,
        stop: Sequence[str],
        *,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        match_in_reasoning: bool = False,
    ) -> None:
        if isinstance(stop, str):
            raise InvalidStopError("stop must be a sequence of strings, not one string")
        if not stop or len(stop) > MAX_STOP_STRINGS:
            raise InvalidStopError(f"between 1 and {MAX_STOP_STRINGS} stop strings are allowed")
        if any(not isinstance(s, str) or not s for s in stop):
            raise InvalidStopError("stop strings must be non-empty strings")
        if min_tokens < 0:
            raise InvalidStopError("min_tokens must not be negative")
        handled = (Channel.CONTENT, Channel.REASONING) if match_in_reasoning else (Channel.CONTENT,)
        super().__init__(handled)
        self._markers = MarkerSet(stop)
        self._include = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._state = StopState.SCANNING
        self._automaton = INITIAL_STATE
        self._held = HeldText()
        self._fed = 0  # characters fed in the current segment (one channel's run)
        self._segment: Channel | None = None
        self._matched: str | None = None

    @property
    def matched(self) -> str | None:
        """The stop string that ended the output, once one has."""
        return self._matched

    @property
    def held_from(self) -> int | None:
        return self._held.first_owner_at_least(0)

    def open_channel(self, upstream: Channel) -> Channel:
        return upstream

    def _enter(self, state: StopState) -> None:
        if state not in _TRANSITIONS[self._state]:
            raise IllegalTransitionError(f"stop matcher: {self._state} -> {state}")
        self._state = state

    def _pass(self, event: Event, out: list[Event]) -> None:
        # After the stop, visible text is removed; text dropped upstream keeps
        # its markup (a </think> is still reasoning markup).
        if (
            self._state is StopState.MATCHED
            and isinstance(event, Span)
            and event.channel is not Channel.DROPPED
            and event.text
        ):
            event = dropped(event.token, event.text, None)
        out.append(event)

    def _feed_text(self, span: Span, out: list[Event]) -> None:
        if self._state is StopState.MATCHED:
            out.append(dropped(span.token, span.text, None))
            return
        if span.channel is not self._segment:
            self._flush(out)
            self._segment = span.channel
        self._scan(span.token, span.text, span.channel, out)

    def _scan(self, token: int, text: str, channel: Channel, out: list[Event]) -> None:
        markers = self._markers
        position = 0
        while position < len(text):
            if self._automaton == INITIAL_STATE:
                # Fast path: nothing is held, so a run without a stop string's
                # first character goes out in one slice.
                start = markers.skip_to_candidate(text, position)
                if start > position:
                    out.append(Span(token, text[position:start], channel))
                    self._fed += start - position
                    position = start
                    continue
            char = text[position]
            position += 1
            self._held.append(token, char)
            self._fed += 1
            self._automaton = markers.step(self._automaton, char)
            found = markers.matched(self._automaton)
            if found is not None and token >= self._min_tokens:
                self._conclude(found, channel, out)
                if position < len(text):
                    out.append(dropped(token, text[position:], None))
                return
            self._release_before(self._fed - markers.live_depth(self._automaton), channel, out)

    def _release_before(self, position: int, channel: Channel, out: list[Event]) -> None:
        count = position - (self._fed - self._held.length)
        if count > 0:
            out.extend(spans_of(self._held.take(count), channel))

    def _conclude(self, stop: str, channel: Channel, out: list[Event]) -> None:
        """``stop`` ends the output here: release before it, then the stop string, drop the rest."""
        self._release_before(self._fed - len(stop), channel, out)
        matched = self._held.take(len(stop))
        if self._include:
            out.extend(spans_of(matched, channel))
        else:
            out.extend(spans_of(matched, Channel.DROPPED, None))
        self._enter(StopState.MATCHED)
        self._matched = stop

    def _flush(self, out: list[Event]) -> None:
        if self._state is StopState.SCANNING and self._segment is not None:
            out.extend(spans_of(self._held.take_all(), self._segment))
        self._automaton = INITIAL_STATE
        self._fed = 0
        self._segment = None
