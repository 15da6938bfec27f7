"""The scaffolding every text stage shares (``SpanStage``): handled spans go
to the grammar, any other event is a barrier that flushes what is held, and
a finished stage refuses more use, saying which stage it is."""

from __future__ import annotations

import pytest

from sluiceway.parsers.events import Channel, Event, Span, content
from sluiceway.parsers.stages import SpanStage, StageFinishedError


class Holding(SpanStage):
    """Holds every handled span until flushed; records the flushes."""

    def __init__(self) -> None:
        super().__init__({Channel.CONTENT})
        self.held: list[Span] = []
        self.flushes = 0

    @property
    def started(self) -> bool:
        # Subclasses read it to refuse priming once used (reasoning, tools).
        return self._started

    @property
    def held_from(self) -> int | None:
        return self.held[0].token if self.held else None

    def open_channel(self, upstream: Channel) -> Channel:
        return upstream

    def _feed_text(self, span: Span, out: list[Event]) -> None:
        self.held.append(span)

    def _flush(self, out: list[Event]) -> None:
        self.flushes += 1
        out += self.held
        self.held = []


def test_other_channels_are_barriers_and_empty_spans_are_skipped() -> None:
    stage = Holding()
    other = Span(1, "r", Channel.REASONING)
    assert stage.feed([content(0, "a"), content(0, ""), other, content(2, "b")]) == [
        content(0, "a"),
        other,
    ]
    assert stage.held == [content(2, "b")]
    assert stage.finish() == [content(2, "b")]


def test_feeding_or_finishing_starts_a_stage() -> None:
    fed, finished = Holding(), Holding()
    assert not fed.started
    assert not finished.started
    fed.feed([])
    finished.finish()
    assert fed.started is True
    assert finished.started is True


def test_a_finished_stage_refuses_more_use_by_name() -> None:
    stage = Holding()
    stage.finish()
    with pytest.raises(StageFinishedError, match=r"^Holding was fed after finish\(\)$"):
        stage.feed([content(0, "a")])
    with pytest.raises(StageFinishedError, match=r"^Holding was finished twice$"):
        stage.finish()
    assert stage.flushes == 1
