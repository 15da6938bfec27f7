"""Turning routed spans into client chunks, and deciding where entries travel.

Theory of operation (the alignment contract, docs/alignment.md):

- A token's *home* is the channel of the first visible character it owns. The
  first time a span of a visible channel arrives for a token without a home,
  the token gets that home and its entry joins the chunk carrying that span.
- A token that owns only dropped characters (or none) is a *markup* token. We
  only know that once none of its text is held by any stage, which the pipeline
  tells us with a watermark: every token below it is fully resolved. A markup
  token belongs to the channel of its markup (``<think>`` -> reasoning,
  ``<tool_call>`` -> tool calls), else to the channel that was open when it was
  fed. It waits for the next chunk of that channel, or the final chunk.

Within each channel, entries therefore leave in token order, each exactly once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from sluiceway.parsers.events import (
    PROMPT_OWNER,
    VISIBLE_CHANNELS,
    Channel,
    Event,
    Span,
    ToolCallOpened,
)


@dataclass(frozen=True, slots=True)
class ToolFragment:
    """One piece of one tool call; ``name`` is set only on the call's first."""

    index: int
    name: str | None
    arguments: str
    #: The id the model wrote for the call (first fragment only); None: minted.
    call_id: str | None = None


@dataclass(frozen=True, slots=True)
class Chunk:
    """One delta for one choice, with the token indices whose entries it carries.

    ``content_offsets[i]`` is where ``content_tokens[i]`` sits in this chunk's
    content: the offset of its first character, or -- for a markup token --
    of the first character of a later token (the end if there is none). The
    legacy completions API reports these as ``text_offset``.
    """

    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolFragment, ...] = ()
    reasoning_tokens: tuple[int, ...] = ()
    content_tokens: tuple[int, ...] = ()
    tool_call_tokens: tuple[int, ...] = ()
    content_offsets: tuple[int, ...] = ()

    def tokens(self, channel: Channel) -> tuple[int, ...]:
        if channel is Channel.REASONING:
            return self.reasoning_tokens
        if channel is Channel.CONTENT:
            return self.content_tokens
        if channel is Channel.TOOL_CALL:
            return self.tool_call_tokens
        return ()

    @property
    def has_text(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    @property
    def is_empty(self) -> bool:
        return not (
            self.has_text or self.reasoning_tokens or self.content_tokens or self.tool_call_tokens
        )


@dataclass(slots=True)
class _ChunkBuilder:
    text: dict[Channel, list[str]] = field(
        default_factory=lambda: {channel: [] for channel in VISIBLE_CHANNELS}
    )
    tokens: dict[Channel, list[int]] = field(
        default_factory=lambda: {channel: [] for channel in VISIBLE_CHANNELS}
    )
    fragments: list[ToolFragment] = field(default_factory=list)
    #: (owner, offset) of each content span, in order.
    content_starts: list[tuple[int, int]] = field(default_factory=list)
    content_length: int = 0

    def add_text(self, channel: Channel, token: int, text: str) -> None:
        if channel is Channel.CONTENT:
            self.content_starts.append((token, self.content_length))
            self.content_length += len(text)
        self.text[channel].append(text)

    def _content_offsets(self, tokens: list[int]) -> tuple[int, ...]:
        first: dict[int, int] = {}
        for owner, offset in self.content_starts:
            first.setdefault(owner, offset)
        offsets = []
        for token in tokens:
            if token in first:
                offsets.append(first[token])
            else:
                later = (offset for owner, offset in self.content_starts if owner > token)
                offsets.append(next(later, self.content_length))
        return tuple(offsets)

    def has_header(self, tool_index: int) -> bool:
        return any(f.index == tool_index and f.name is not None for f in self.fragments)

    def carries(self, channel: Channel) -> bool:
        if channel is Channel.TOOL_CALL:
            return bool(self.fragments)
        return bool(self.text[channel])

    def add_arguments(self, tool_index: int, text: str) -> None:
        last = self.fragments[-1] if self.fragments else None
        if last is not None and last.index == tool_index and last.name is None:
            self.fragments[-1] = ToolFragment(tool_index, None, last.arguments + text)
        else:
            self.fragments.append(ToolFragment(tool_index, None, text))

    def build(self) -> Chunk:
        content_tokens = sorted(self.tokens[Channel.CONTENT])
        return Chunk(
            reasoning="".join(self.text[Channel.REASONING]),
            content="".join(self.text[Channel.CONTENT]),
            tool_calls=tuple(self.fragments),
            reasoning_tokens=tuple(sorted(self.tokens[Channel.REASONING])),
            content_tokens=tuple(content_tokens),
            tool_call_tokens=tuple(sorted(self.tokens[Channel.TOOL_CALL])),
            content_offsets=self._content_offsets(content_tokens),
        )


class AlignmentError(AssertionError):
    """A stage emitted text for a token it had declared fully released."""


class ChunkAssembler:
    """Per-choice state: homes, markup bookkeeping, pending markup entries."""

    def __init__(self) -> None:
        self._floor = 0
        self._unresolved: deque[int] = deque()
        self._home: dict[int, Channel] = {}
        self._markup: dict[int, Channel] = {}
        self._open: dict[int, Channel] = {}
        self._pending: dict[Channel, list[int]] = {channel: [] for channel in VISIBLE_CHANNELS}
        self.counts: dict[Channel, int] = dict.fromkeys(VISIBLE_CHANNELS, 0)

    def register(self, token: int, open_channel: Channel) -> None:
        """Note a fed token and the channel open when it was fed."""
        self._unresolved.append(token)
        self._open[token] = open_channel

    def sole_content(self, token: int, text: str) -> Chunk | None:
        """The chunk of a token whose text all goes to content and resolves
        at once, when no earlier token waits: what ``register`` then
        ``assemble`` give for it, without routing a span. ``None`` when an
        earlier token is unresolved or an entry waits for a chunk (then the
        general path decides)."""
        pending = self._pending
        if (
            self._unresolved
            or pending[Channel.CONTENT]
            or pending[Channel.REASONING]
            or pending[Channel.TOOL_CALL]
        ):
            return None
        self._floor = token + 1
        self.counts[Channel.CONTENT] += 1
        return Chunk(content=text, content_tokens=(token,), content_offsets=(0,))

    def assemble(self, events: Iterable[Event], watermark: int) -> list[Chunk]:
        """Route one step's events into chunks; then resolve tokens below ``watermark``."""
        builders = [_ChunkBuilder()]
        for event in events:
            if isinstance(event, ToolCallOpened):
                self._open_tool_call(builders, event)
            else:
                self._route_span(builders, event)
        self._resolve(watermark)
        self._attach_pending(builders)
        return [chunk for chunk in (b.build() for b in builders) if not chunk.is_empty]

    def final(self) -> Chunk:
        """Resolve everything; the returned chunk carries every entry still waiting."""
        self._resolve(None)
        builder = _ChunkBuilder()
        for channel in VISIBLE_CHANNELS:
            builder.tokens[channel].extend(self._pending[channel])
            self._pending[channel].clear()
        return builder.build()

    def _open_tool_call(self, builders: list[_ChunkBuilder], event: ToolCallOpened) -> None:
        builder = builders[-1]
        for span in event.name_spans:
            self._claim(builder, span.token, Channel.TOOL_CALL)
        builder.fragments.append(ToolFragment(event.tool_index, event.name, "", event.call_id))

    def _route_span(self, builders: list[_ChunkBuilder], span: Span) -> None:
        if span.channel is Channel.DROPPED:
            if span.markup is not None and span.token != PROMPT_OWNER:
                self._markup.setdefault(span.token, span.markup)
            return
        if not span.text:
            return
        builder = builders[-1]
        if span.channel is Channel.TOOL_CALL:
            if builder.has_header(span.tool_index):
                builder = _ChunkBuilder()
                builders.append(builder)
            builder.add_arguments(span.tool_index, span.text)
        else:
            builder.add_text(span.channel, span.token, span.text)
        self._claim(builder, span.token, span.channel)

    def _claim(self, builder: _ChunkBuilder, token: int, channel: Channel) -> None:
        if token == PROMPT_OWNER or token in self._home:
            return
        if token < self._floor:
            raise AlignmentError(f"text of token {token} arrived after it was resolved")
        self._home[token] = channel
        builder.tokens[channel].append(token)
        self.counts[channel] += 1

    def _resolve(self, watermark: int | None) -> None:
        while self._unresolved and (watermark is None or self._unresolved[0] < watermark):
            token = self._unresolved.popleft()
            self._floor = token + 1
            open_channel = self._open.pop(token)
            markup = self._markup.pop(token, None)
            if self._home.pop(token, None) is not None:
                continue
            channel = markup if markup is not None else open_channel
            self._pending[channel].append(token)
            self.counts[channel] += 1

    def _attach_pending(self, builders: list[_ChunkBuilder]) -> None:
        for channel in VISIBLE_CHANNELS:
            pending = self._pending[channel]
            if not pending:
                continue
            for builder in builders:
                if builder.carries(channel):
                    builder.tokens[channel].extend(pending)
                    pending.clear()
                    break
