"""Reasoning parsers: routing ``<think>...</think>`` to the reasoning channel.

Theory of operation: a four-state machine over the content stream.

- ``START``: nothing but whitespace has been seen. Whitespace and a prefix of
  ``<think>`` are held, because an opening tag turns them into markup; any
  other character shows the output did not open with a tag, so the held text is
  fed again, once, in the state the dialect falls back to (content for qwen3,
  reasoning for deepseek_r1, whose output begins inside reasoning).
- ``REASONING``: a :class:`MarkerScanner` looks for ``</think>`` and holds only
  a suffix that could still be the tag. A partial tag cut off by the end of the
  output is released as reasoning.
- ``CLOSED``: right after ``</think>``; whitespace is dropped as reasoning
  markup (it is already decided, so it is never held).
- ``CONTENT``: everything is content and nothing is held; a ``<think>`` here is
  ordinary text.

The starting state comes from the rendered prompt: :meth:`prime` reads the
assistant prefix the chat template added (an opened or a closed think block)
and only changes state.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType

from sluiceway.parsers.events import Channel, Event, Span, dropped
from sluiceway.parsers.markers import HeldText, MarkerFound, MarkerScanner, MarkerSet
from sluiceway.parsers.stages import (
    WHITESPACE,
    IllegalTransitionError,
    PrimeError,
    SpanStage,
    spans_of,
)
from sluiceway.protocol.constraints import ReasoningGate

OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"


class ReasoningState(enum.Enum):
    START = "start"
    REASONING = "reasoning"
    CLOSED = "closed"
    CONTENT = "content"


_TRANSITIONS: MappingProxyType[ReasoningState, frozenset[ReasoningState]] = MappingProxyType(
    {
        ReasoningState.START: frozenset({ReasoningState.REASONING, ReasoningState.CONTENT}),
        ReasoningState.REASONING: frozenset({ReasoningState.CLOSED}),
        ReasoningState.CLOSED: frozenset({ReasoningState.CONTENT}),
        ReasoningState.CONTENT: frozenset(),
    }
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReasoningDialect:
    """What differs between the reasoning dialects: data, one per family."""

    name: str
    #: The output begins inside reasoning (only the closing tag is expected).
    starts_in_reasoning: bool = False
    open_tag: str = OPEN_TAG
    close_tag: str = CLOSE_TAG
    #: Markup that ends reasoning without its closing tag and belongs to what
    #: follows (a tool call the model opened while still thinking): it is
    #: passed on as content, for the tool-call parser.
    ends_at: tuple[str, ...] = ()

    @property
    def forced_close(self) -> str:
        """Appended to a prompt that leaves reasoning open, to force what
        follows (a tool call) out of it: the close tag and the blank line
        templates write."""
        return self.close_tag + "\n\n"


QWEN3 = ReasoningDialect(name="qwen3")
DEEPSEEK_R1 = ReasoningDialect(name="deepseek_r1", starts_in_reasoning=True)
#: GLM-4.5/4.6/4.7: a call opened inside ``<think>`` ends the reasoning.
GLM45 = ReasoningDialect(name="glm45", ends_at=("<tool_call>",))
KIMI_K2 = ReasoningDialect(name="kimi_k2", ends_at=("<|tool_calls_section_begin|>",))
MINIMAX_M2 = ReasoningDialect(name="minimax_m2", ends_at=("<minimax:tool_call>",))
#: DeepSeek V3.1/V3.2: the template opens (thinking) or closes the block.
DEEPSEEK_V3 = ReasoningDialect(name="deepseek_v3", ends_at=("<｜tool▁calls▁begin｜>",))
#: Magistral, Devstral and later Mistral models.
MISTRAL = ReasoningDialect(
    name="mistral", open_tag="[THINK]", close_tag="[/THINK]", ends_at=("[TOOL_CALLS]",)
)

DIALECTS: MappingProxyType[str, ReasoningDialect] = MappingProxyType(
    {
        dialect.name: dialect
        for dialect in (QWEN3, DEEPSEEK_R1, GLM45, KIMI_K2, MINIMAX_M2, DEEPSEEK_V3, MISTRAL)
    }
)


class UnsupportedGateError(ValueError):
    """A constraint cannot wait out reasoning whose closing tag is not one token."""


def reasoning_gate(
    dialect: ReasoningDialect, assistant_prefix: str, token_id: Callable[[str], int | None]
) -> ReasoningGate | None:
    """Where a constraint starts, for output that follows ``assistant_prefix``.

    ``None`` when the output starts after any reasoning (the prompt closed
    it); otherwise the constraint waits for the token that closes reasoning.
    ``token_id`` gives a text's token id when it is exactly one token.
    """
    state = primed_state(assistant_prefix, dialect)
    if state in (ReasoningState.CLOSED, ReasoningState.CONTENT):
        return None
    close = dialect.close_tag
    end_id = token_id(close)
    if end_id is None:
        raise UnsupportedGateError(
            f"{close} is not one token of this model, so a constraint cannot start after it"
        )
    if state is ReasoningState.REASONING or dialect.starts_in_reasoning:
        return ReasoningGate(end_id=end_id, inside=True)
    start_id = token_id(dialect.open_tag)
    return None if start_id is None else ReasoningGate(end_id=end_id, start_id=start_id)


def primed_state(prefix: str, dialect: ReasoningDialect = QWEN3) -> ReasoningState:
    """The state the assistant prefix leaves the output in (``START`` when it shows no tag)."""
    opened = prefix.rfind(dialect.open_tag)
    closed = prefix.rfind(dialect.close_tag)
    if closed > opened:
        tail = prefix[closed + len(dialect.close_tag) :]
        return (
            ReasoningState.CLOSED if all(c in WHITESPACE for c in tail) else ReasoningState.CONTENT
        )
    if opened >= 0:
        return ReasoningState.REASONING
    return ReasoningState.START


_Handler = Callable[["ReasoningParser", int, str, int, list[Event]], int]


class ReasoningParser(SpanStage):
    """The first stage of a choice's text path: content -> reasoning/content/markup."""

    def __init__(self, dialect: ReasoningDialect) -> None:
        super().__init__((Channel.CONTENT,))
        self.dialect = dialect
        self._state = ReasoningState.START
        self._held = HeldText()  # START only: leading whitespace and a partial <think>
        self._tag_progress = 0
        self._scanner = MarkerScanner(MarkerSet((dialect.close_tag, *dialect.ends_at)))
        self._primed = ""

    @property
    def state(self) -> ReasoningState:
        return self._state

    def prime(self, text: str) -> None:
        """Read the assistant prefix the chat template put at the end of the prompt."""
        if self._started:
            raise PrimeError("a reasoning parser can only be primed before it is fed")
        self._primed += text
        # Priming may jump to any state: it describes where the prompt left off.
        self._state = primed_state(self._primed, self.dialect)

    @property
    def held_from(self) -> int | None:
        if self._state is ReasoningState.START:
            return self._held.first_owner_at_least(0)
        if self._state is ReasoningState.REASONING:
            return self._scanner.held_from
        return None

    @property
    def transparent(self) -> bool:
        return self._state is ReasoningState.CONTENT

    def open_channel(self, upstream: Channel) -> Channel:
        if self._state is ReasoningState.REASONING or (
            self._state is ReasoningState.START and self.dialect.starts_in_reasoning
        ):
            return Channel.REASONING
        return upstream

    def _enter(self, state: ReasoningState) -> None:
        if state not in _TRANSITIONS[self._state]:
            raise IllegalTransitionError(f"reasoning parser: {self._state} -> {state}")
        self._state = state

    def _feed_text(self, span: Span, out: list[Event]) -> None:
        self._feed_owned(span.token, span.text, out)

    def _feed_owned(self, token: int, text: str, out: list[Event]) -> None:
        position = 0
        while position < len(text):
            position = _HANDLERS[self._state](self, token, text, position, out)

    def _flush(self, out: list[Event]) -> None:
        if self._state is ReasoningState.START:
            self._leave_start(out)
        if self._state is ReasoningState.REASONING:
            out.extend(spans_of(self._scanner.finish(), Channel.REASONING))

    # -- one handler per state: consume from ``position``, return where it stopped

    def _on_start(self, token: int, text: str, position: int, out: list[Event]) -> int:
        while position < len(text):
            char = text[position]
            if self._tag_progress == 0 and char in WHITESPACE:
                self._held.append(token, char)
            elif char == self.dialect.open_tag[self._tag_progress]:
                self._held.append(token, char)
                self._tag_progress += 1
                if self._tag_progress == len(self.dialect.open_tag):
                    out.extend(spans_of(self._held.take_all(), Channel.DROPPED, Channel.REASONING))
                    self._enter(ReasoningState.REASONING)
                    return position + 1
            else:
                self._leave_start(out)
                return position  # this character is read again in the new state
            position += 1
        return position

    def _leave_start(self, out: list[Event]) -> None:
        """The output did not open with ``<think>``: what START held is ordinary text."""
        self._enter(
            ReasoningState.REASONING if self.dialect.starts_in_reasoning else ReasoningState.CONTENT
        )
        self._tag_progress = 0
        for piece in self._held.take_all():
            self._feed_owned(piece.token, piece.text, out)

    def _on_reasoning(self, token: int, text: str, position: int, out: list[Event]) -> int:
        events, position = self._scanner.scan(token, text, position)
        for event in events:
            if isinstance(event, MarkerFound) and event.marker != self.dialect.close_tag:
                # Markup that opens what follows reasoning: it is content.
                self._enter(ReasoningState.CLOSED)
                self._enter(ReasoningState.CONTENT)
                out.extend(spans_of(event.pieces, Channel.CONTENT))
            elif isinstance(event, MarkerFound):
                out.extend(spans_of(event.pieces, Channel.DROPPED, Channel.REASONING))
                self._enter(ReasoningState.CLOSED)
            else:
                out.append(Span(event.token, event.text, Channel.REASONING))
        return position

    def _on_closed(self, token: int, text: str, position: int, out: list[Event]) -> int:
        end = position
        while end < len(text) and text[end] in WHITESPACE:
            end += 1
        if end > position:
            out.append(dropped(token, text[position:end], Channel.REASONING))
        if end < len(text):
            self._enter(ReasoningState.CONTENT)
        return end

    def _on_content(self, token: int, text: str, position: int, out: list[Event]) -> int:
        out.append(Span(token, text[position:], Channel.CONTENT))
        return len(text)


_HANDLERS: MappingProxyType[ReasoningState, _Handler] = MappingProxyType(
    {
        ReasoningState.START: ReasoningParser._on_start,
        ReasoningState.REASONING: ReasoningParser._on_reasoning,
        ReasoningState.CLOSED: ReasoningParser._on_closed,
        ReasoningState.CONTENT: ReasoningParser._on_content,
    }
)


def parser_of(dialect: ReasoningDialect) -> Callable[[], ReasoningParser]:
    """A factory of fresh parsers of ``dialect``."""
    return functools.partial(ReasoningParser, dialect)


def qwen3() -> ReasoningParser:
    """``<think>`` opens reasoning only at the very start of the output."""
    return ReasoningParser(QWEN3)


def deepseek_r1() -> ReasoningParser:
    """The output starts inside reasoning; a leading ``<think>`` is markup."""
    return ReasoningParser(DEEPSEEK_R1)
