"""The incremental detokenizer never splits a UTF-8 character and never re-decodes."""

from __future__ import annotations

import itertools

from hypothesis import example, given
from hypothesis import strategies as st

from sluiceway.parsers.detokenizer import IncrementalDetokenizer
from sluiceway.protocol.tokens import TokenTable


def table_of(pieces: list[bytes], hidden: frozenset[int] = frozenset()) -> TokenTable:
    return TokenTable(tuple(pieces), hidden)


@st.composite
def split_text(draw: st.DrawFn) -> tuple[str, list[bytes]]:
    text = draw(st.text(min_size=0, max_size=40))
    data = text.encode("utf-8")
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(data) - 1)), max_size=len(data))))
    bounds = [0, *[c for c in cuts if 0 < c < len(data)], len(data)]
    pieces = [data[a:b] for a, b in itertools.pairwise(bounds) if b > a]
    return text, pieces


@given(split_text())
@example(("é", [b"\xc3", b"\xa9"]))
@example(("a😀b", [b"a\xf0", b"\x9f", b"\x98\x80b"]))
def test_any_split_reassembles_the_text(case: tuple[str, list[bytes]]) -> None:
    text, pieces = case
    detokenizer = IncrementalDetokenizer(table_of(pieces))
    released = [detokenizer.feed(i) for i in range(len(pieces))]
    assert "".join(released) + detokenizer.finish() == text


@given(split_text())
def test_a_token_owns_exactly_the_characters_it_completes(case: tuple[str, list[bytes]]) -> None:
    text, pieces = case
    detokenizer = IncrementalDetokenizer(table_of(pieces))
    consumed = 0
    for index, piece in enumerate(pieces):
        consumed += len(piece)
        released = detokenizer.feed(index)
        # Everything released so far is exactly the characters whose last
        # byte has arrived: the longest decodable prefix of the bytes seen.
        prefix = text.encode("utf-8")[:consumed]
        complete = prefix.decode("utf-8", errors="ignore")
        while complete.encode("utf-8") != prefix[: len(complete.encode("utf-8"))]:
            complete = complete[:-1]  # pragma: no cover - defensive
        assert released == "" or complete.endswith(released)
    assert not detokenizer.pending


def test_fragment_releases_nothing_until_completed() -> None:
    detokenizer = IncrementalDetokenizer(table_of([b"caf", b"\xc3", b"\xa9!"]))
    assert detokenizer.feed(0) == "caf"
    assert detokenizer.feed(1) == ""
    assert detokenizer.pending
    assert detokenizer.feed(2) == "é!"
    assert not detokenizer.pending


def test_hidden_tokens_release_nothing_but_keep_their_bytes() -> None:
    table = table_of([b"hi", b"<|im_end|>"], hidden=frozenset({1}))
    detokenizer = IncrementalDetokenizer(table)
    assert detokenizer.feed(0) == "hi"
    assert detokenizer.feed(1) == ""
    assert table.bytes_of(1) == b"<|im_end|>"
    assert table.display(1) == "<|im_end|>"


def test_truncated_character_is_flushed_as_replacement() -> None:
    detokenizer = IncrementalDetokenizer(table_of([b"ok", b"\xe2\x82"]))
    assert detokenizer.feed(0) + detokenizer.feed(1) == "ok"
    assert detokenizer.finish() == "\ufffd"


def test_sentencepiece_style_first_space_is_stripped_once() -> None:
    table = TokenTable((b" Hello", b" world"), frozenset(), strip_first_space=True)
    assert table.decode([0, 1]) == "Hello world"


def test_out_of_vocabulary_ids_are_empty() -> None:
    table = table_of([b"a"])
    assert table.bytes_of(5) == b""
    assert table.decode([0, 5, 0]) == "aa"


def test_entry_parts_are_made_once_per_id_and_table() -> None:
    first = TokenTable((b"ab", b"\xe2\x82"), frozenset())
    other = TokenTable((b"zz", b"\xe2\x82"), frozenset())
    parts = first.entry_parts(1)
    assert parts == (first.display(1), (0xE2, 0x82))
    assert parts[0] == "\ufffd"
    assert first.entry_parts(1) is parts
    assert first.entry_parts(0) == ("ab", (97, 98))
    assert other.entry_parts(0) == ("zz", (122, 122))
    assert first == TokenTable((b"ab", b"\xe2\x82"), frozenset())


@given(case=split_text(), strip=st.booleans(), spaced=st.booleans(), hidden_first=st.booleans())
@example(case=("ab", [b"a", b"b"]), strip=True, spaced=True, hidden_first=True)
def test_streamed_text_is_the_whole_decode_first_space_rule_included(
    case: tuple[str, list[bytes]], strip: bool, spaced: bool, hidden_first: bool
) -> None:
    """A SentencePiece-style table drops the space that begins the first
    visible token only (a hidden token before it releases nothing, and does
    not count as first); every later token keeps its own."""
    _, pieces = case
    pieces = [b" " + piece if spaced else piece for piece in pieces]
    ids = list(range(len(pieces)))
    hidden: frozenset[int] = frozenset()
    if hidden_first:
        pieces, ids, hidden = [b"<s>", *pieces], [0, *(i + 1 for i in ids)], frozenset({0})
    table = TokenTable(tuple(pieces), hidden, strip_first_space=strip)
    detokenizer = IncrementalDetokenizer(table)
    streamed = "".join(detokenizer.feed(i) for i in ids) + detokenizer.finish()
    assert streamed == table.decode(ids)
