"""Edges of ChoicePipeline that the random documents reach rarely: a token
whose text is kept out of the output, a reply cut inside a multi-byte
character, and one whose stop string arrived with the start of one."""

from __future__ import annotations

from collections.abc import Sequence

from sluiceway.parsers.assembler import Chunk
from sluiceway.parsers.pipeline import ChoicePipeline
from sluiceway.parsers.stop import StopMatcher
from sluiceway.protocol.tokens import TokenTable


def run(
    pieces: Sequence[bytes], fed: Sequence[tuple[int, bool]], stop: str | None = None
) -> tuple[str, list[int], ChoicePipeline]:
    """The content of the whole output, and its content tokens in order."""
    table = TokenTable(tuple(pieces), frozenset())
    matcher = StopMatcher([stop]) if stop is not None else None
    pipeline = ChoicePipeline(table, [matcher] if matcher else [], stop=matcher)
    chunks: list[Chunk] = []
    for token_id, visible in fed:
        chunks += pipeline.feed(token_id, visible=visible)
    finished = pipeline.finish()
    chunks += [*finished.chunks, finished.final]
    text = "".join(chunk.content for chunk in chunks)
    return text, [t for chunk in chunks for t in chunk.content_tokens], pipeline


def test_an_invisible_token_counts_but_its_text_stays_out() -> None:
    text, tokens, pipeline = run([b"a", b"END"], [(0, True), (1, False)])
    assert text == "a"
    # Its entry still goes out (with the open channel's), after the text's.
    assert tokens == [0, 1]
    assert pipeline.tokens_fed == 2


def test_a_reply_cut_inside_a_character_ends_with_its_replacement() -> None:
    # The second token begins "é" (0xC3 0xA9) and the reply ends there: the
    # flushed U+FFFD is the text of the token that began the character.
    text, tokens, _ = run([b"a", b"\xc3", b"b"], [(0, True), (1, True)])
    assert text == "a\ufffd"
    assert tokens == [0, 1]


def test_a_cut_character_after_the_stop_string_is_not_released() -> None:
    text, _, pipeline = run([b"a", b"STOP\xc3"], [(0, True), (1, True)], stop="STOP")
    assert pipeline.stopped_by == "STOP"
    assert text == "a"
