"""Incremental detokenization that never splits a UTF-8 character.

Each token id maps to the exact bytes it stands for (a :class:`TokenTable`
built once per tokenizer). Feeding a token pushes its bytes through an
incremental UTF-8 decoder and returns only the characters that are now
complete: a token that ends inside a multi-byte character releases nothing,
and the token that completes it releases the whole character. The text of
earlier tokens is never decoded again.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TokenTable:
    """What each token id stands for, built once per tokenizer.

    ``raw_bytes[i]`` are token ``i``'s exact bytes as the model sees it
    (for an added or special token, its literal text). ``hidden`` are the ids
    whose text is not part of the output (special tokens such as
    ``<|im_end|>``); they still have ``raw_bytes`` for logprob entries.
    ``strip_first_space`` is for SentencePiece-style vocabularies whose decoder
    drops the space that begins the first token.
    """

    raw_bytes: tuple[bytes, ...]
    hidden: frozenset[int]
    strip_first_space: bool = False

    def __len__(self) -> int:
        return len(self.raw_bytes)

    def bytes_of(self, token_id: int) -> bytes:
        if 0 <= token_id < len(self.raw_bytes):
            return self.raw_bytes[token_id]
        return b""

    def output_bytes(self, token_id: int) -> bytes:
        if token_id in self.hidden:
            return b""
        return self.bytes_of(token_id)

    def display(self, token_id: int) -> str:
        """The token as a string for logprob entries (fragments of a character
        show as U+FFFD; their exact bytes travel in the ``bytes`` field)."""
        return self.bytes_of(token_id).decode("utf-8", errors="replace")

    def decode(self, token_ids: Sequence[int]) -> str:
        """Whole-sequence decode with the same rules as the incremental path."""
        detokenizer = IncrementalDetokenizer(self)
        return "".join(detokenizer.feed(token_id) for token_id in token_ids) + detokenizer.finish()


class IncrementalDetokenizer:
    """Feeds token ids, returns the text each one releases."""

    def __init__(self, table: TokenTable) -> None:
        self._table = table
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._at_start = table.strip_first_space

    def feed(self, token_id: int) -> str:
        data = self._table.output_bytes(token_id)
        if not data:
            return ""
        if self._at_start:
            self._at_start = False
            if data.startswith(b" "):
                data = data[1:]
        return self._decoder.decode(data)

    @property
    def pending(self) -> bool:
        """True while the bytes of an incomplete character are buffered."""
        buffered: bytes = self._decoder.getstate()[0]
        return bool(buffered)

    def finish(self) -> str:
        """Flush a trailing incomplete character (as U+FFFD)."""
        return self._decoder.decode(b"", final=True)
