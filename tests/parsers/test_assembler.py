"""The assembler on its own: text that arrives for a token already resolved
is a stage's bug, and the assembler says so instead of misplacing an entry."""

from __future__ import annotations

import pytest

from sluiceway.parsers.assembler import AlignmentError, Chunk, ChunkAssembler, ToolFragment
from sluiceway.parsers.events import Channel, Span, ToolCallOpened, content


def test_text_after_the_fast_path_resolved_its_token_is_an_alignment_error() -> None:
    assembler = ChunkAssembler()
    assert assembler.sole_content(0, "a") == Chunk(
        content="a", content_tokens=(0,), content_offsets=(0,)
    )
    with pytest.raises(AlignmentError, match="token 0"):
        assembler.assemble([content(0, "b")], watermark=1)


def test_text_after_the_watermark_resolved_its_token_is_an_alignment_error() -> None:
    assembler = ChunkAssembler()
    assembler.register(0, Channel.CONTENT)
    assembler.register(1, Channel.CONTENT)
    assert assembler.assemble([content(0, "a")], watermark=1) == [
        Chunk(content="a", content_tokens=(0,), content_offsets=(0,))
    ]
    assert assembler.assemble([content(1, "b")], watermark=1) == [
        Chunk(content="b", content_tokens=(1,), content_offsets=(0,))
    ]
    with pytest.raises(AlignmentError, match="token 0"):
        assembler.assemble([content(0, "c")], watermark=2)


def test_a_call_keeps_the_id_its_model_wrote() -> None:
    assembler = ChunkAssembler()
    assembler.register(0, Channel.TOOL_CALL)
    opened = ToolCallOpened(0, (Span(0, "f", Channel.TOOL_CALL),), call_id="functions.f:0")
    (chunk,) = assembler.assemble([opened], watermark=1)
    assert chunk.tool_calls == (ToolFragment(0, "f", "", "functions.f:0"),)


def test_removed_text_before_a_tag_leaves_the_token_to_the_tag() -> None:
    # A token owning a removed character (no channel's markup) and then
    # "<think>" is a reasoning markup token, whatever was open when it came.
    assembler = ChunkAssembler()
    assembler.register(0, Channel.CONTENT)
    removed = Span(0, " ", Channel.DROPPED)
    tag = Span(0, "<think>", Channel.DROPPED, markup=Channel.REASONING)
    assert assembler.assemble([removed, tag], watermark=1) == []
    assert assembler.final() == Chunk(reasoning_tokens=(0,))


def test_entries_waiting_in_two_channels_both_join_the_next_chunk_of_theirs() -> None:
    assembler = ChunkAssembler()
    assembler.register(0, Channel.REASONING)
    assembler.register(1, Channel.CONTENT)
    tag = Span(0, "<think>", Channel.DROPPED, markup=Channel.REASONING)
    assert assembler.assemble([tag, Span(1, "x", Channel.DROPPED)], watermark=2) == []
    assembler.register(2, Channel.REASONING)
    assembler.register(3, Channel.CONTENT)
    spans = [Span(2, "r", Channel.REASONING), content(3, "c")]
    assert assembler.assemble(spans, watermark=4) == [
        Chunk(
            reasoning="r",
            content="c",
            reasoning_tokens=(0, 2),
            content_tokens=(1, 3),
            content_offsets=(0, 0),
        )
    ]
