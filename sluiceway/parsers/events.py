"""The event vocabulary shared by the text stages and the chunk assembler.

Every character of generated text is *owned* by the token whose step released
it (see the alignment contract in docs/alignment.md). Stages never lose that
ownership: whatever they hold back, split, drop or transform, each span they
emit still names its owning token, so the assembler can decide in which chunk
each token's logprob entry travels.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

#: Owner of text that came from the prompt (priming a parser with the assistant
#: prefix); such text has no logprob entry.
PROMPT_OWNER = -1


class Channel(enum.Enum):
    """Where a character of generated text ends up."""

    CONTENT = "content"
    REASONING = "reasoning"
    TOOL_CALL = "tool_call"
    DROPPED = "dropped"

    # Channels key the assembler's dicts several times per token; Enum's own
    # hash is a Python-level call. Members are singletons compared by
    # identity, so the identity hash is consistent with equality.
    __hash__ = object.__hash__


#: The channels a client sees, in the order they appear within one delta.
VISIBLE_CHANNELS = (Channel.REASONING, Channel.CONTENT, Channel.TOOL_CALL)


@dataclass(frozen=True, slots=True)
class Span:
    """A run of text owned by one token, routed to one channel.

    ``markup`` is set on dropped spans that are tag markup: the channel whose
    markup it is (``<think>`` belongs to reasoning, ``<tool_call>`` to tool
    calls). A dropped span with ``markup=None`` is removed text that belongs to
    no channel, such as a matched stop string.
    """

    token: int
    text: str
    channel: Channel
    markup: Channel | None = None
    tool_index: int = -1


@dataclass(frozen=True, slots=True)
class ToolCallOpened:
    """A tool call whose function name is now complete.

    ``name_spans`` are the (tool-call channel) spans whose text is the name;
    their tokens are tool-call-home tokens, and the name travels in the call's
    first fragment.
    """

    tool_index: int
    name_spans: tuple[Span, ...]
    #: The call's id where the format writes one (Kimi K2's ``functions.NAME:IDX``).
    call_id: str | None = None

    @property
    def name(self) -> str:
        return "".join(span.text for span in self.name_spans)


Event = Span | ToolCallOpened


def content(token: int, text: str) -> Span:
    return Span(token, text, Channel.CONTENT)


def dropped(token: int, text: str, markup: Channel | None) -> Span:
    return Span(token, text, Channel.DROPPED, markup)
