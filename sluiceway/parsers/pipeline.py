"""One choice's text path: detokenizer -> stages -> chunk assembler.

The stages run in a fixed order: the reasoning parser first (so that the stop
matcher can skip reasoning, and tool-call tags inside reasoning stay
reasoning), then the stop matcher, then the tool-call parser. Each stage is a
:class:`TextStage`; the pipeline asks all of them which tokens they still hold
text of, and everything below that watermark is resolved in the assembler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from sluiceway.parsers.assembler import Chunk, ChunkAssembler
from sluiceway.parsers.detokenizer import IncrementalDetokenizer
from sluiceway.parsers.events import Channel, Event, content
from sluiceway.protocol.tokens import TokenTable


class TextStage(Protocol):
    """A sans-IO stage between the detokenizer and the assembler."""

    def feed(self, events: Sequence[Event]) -> list[Event]:
        """Take the next events in order; return what can be released now."""
        ...

    def finish(self) -> list[Event]:
        """The output has ended: release everything still held."""
        ...

    @property
    def held_from(self) -> int | None:
        """The smallest owner token of text this stage holds back, if any."""
        ...

    def open_channel(self, upstream: Channel) -> Channel:
        """The channel open after this stage, given the one open upstream of it."""
        ...

    @property
    def transparent(self) -> bool:
        """Whether the stage now hands content on as it comes: feeding it a
        content span would return that span, it holds nothing, and content
        stays open after it. The pipeline may then not feed it (a reasoning
        parser past ``</think>``)."""
        ...


class TokenReader(Protocol):
    """A first stage that reads token ids as well as text (harmony's special
    tokens are markup by id): each token's released text becomes events."""

    def feed_token(self, token: int, token_id: int | None, text: str) -> list[Event]:
        """Token ``token`` (``token_id`` None: only text flushed on its behalf)."""
        ...

    def finish(self) -> list[Event]: ...

    @property
    def held_from(self) -> int | None: ...

    def open_channel(self, upstream: Channel) -> Channel: ...

    @property
    def transparent(self) -> bool: ...


class StopStage(TextStage, Protocol):
    """A stage that can end the output (the stop-string matcher)."""

    @property
    def matched(self) -> str | None:
        """The stop string that ended the output, once one has."""
        ...


@dataclass(frozen=True, slots=True)
class Finished:
    """What the pipeline released when the output ended."""

    chunks: tuple[Chunk, ...]
    final: Chunk


class ChoicePipeline:
    """Feeds one choice's tokens through the text path, one token at a time."""

    def __init__(
        self,
        table: TokenTable,
        stages: Sequence[TextStage] = (),
        *,
        stop: StopStage | None = None,
        reader: TokenReader | None = None,
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(table)
        self._reader = reader
        self._stages = tuple(stages)
        # Asked what every stage is asked (held text, open channel), reader first.
        self._all: tuple[TextStage | TokenReader, ...] = (
            (reader, *stages) if reader is not None else self._stages
        )
        self._stop = stop
        self._assembler = ChunkAssembler()
        self.tokens_fed = 0
        # The token whose bytes began the incomplete character the detokenizer
        # buffers: it stays unresolved, since a truncated reply flushes that
        # character (as U+FFFD) on its behalf.
        self._partial_from: int | None = None

    @property
    def stopped_by(self) -> str | None:
        """The stop string that ended this choice, if one did."""
        return self._stop.matched if self._stop is not None else None

    @property
    def matches_stops(self) -> bool:
        """Whether this path matches stop strings."""
        return self._stop is not None

    def channel_counts(self) -> dict[Channel, int]:
        """How many tokens have each channel as home (markup included), so far."""
        return dict(self._assembler.counts)

    def feed(self, token_id: int, *, visible: bool = True) -> list[Chunk]:
        """Feed one generated token; ``visible=False`` keeps its text out of the
        output (EOS, a stop token id) while it still counts and keeps its entry."""
        if self.stopped_by is not None:
            raise RuntimeError("the pipeline was fed after a stop string ended it")
        token = self.tokens_fed
        self.tokens_fed += 1
        text = self._detokenizer.feed(token_id) if visible else ""
        if not self._detokenizer.pending:
            self._partial_from = None
            if text and self._transparent():
                # Most tokens of a plain reply: the text is the token's own,
                # complete, no stage would touch it, and nothing waits before it.
                chunk = self._assembler.sole_content(token, text)
                if chunk is not None:
                    return [chunk]
        elif text or self._partial_from is None:
            self._partial_from = token
        events = self._read(token, token_id, text)
        for stage in self._stages:
            events = stage.feed(events)
        self._assembler.register(token, self._open_channel())
        return self._assembler.assemble(events, self._watermark())

    def finish(self) -> Finished:
        """The output has ended (for whatever reason): flush every stage."""
        events: list[Event] = []
        tail = self._detokenizer.finish()
        if tail and self.stopped_by is None and self._partial_from is not None:
            events = self._read(self._partial_from, None, tail)
        if self._reader is not None:
            events += self._reader.finish()
        for stage in self._stages:
            events = stage.feed(events) + stage.finish()
        chunks = self._assembler.assemble(events, self.tokens_fed)
        return Finished(tuple(chunks), self._assembler.final())

    def _read(self, token: int, token_id: int | None, text: str) -> list[Event]:
        if self._reader is not None:
            return self._reader.feed_token(token, token_id, text)
        return [content(token, text)] if text else []

    def _transparent(self) -> bool:
        return all(stage.transparent for stage in self._all)

    def _open_channel(self) -> Channel:
        channel = Channel.CONTENT
        for stage in self._all:
            channel = stage.open_channel(channel)
        return channel

    def _watermark(self) -> int:
        watermark = self.tokens_fed
        if self._partial_from is not None:
            watermark = self._partial_from
        for stage in self._all:
            held = stage.held_from
            if held is not None and held < watermark:
                watermark = held
        return watermark
