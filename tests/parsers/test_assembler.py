"""The assembler on its own: text that arrives for a token already resolved
is a stage's bug, and the assembler says so instead of misplacing an entry."""

from __future__ import annotations

import pytest

from sluiceway.parsers.assembler import AlignmentError, Chunk, ChunkAssembler
from sluiceway.parsers.events import Channel, content


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
