"""Incremental detokenization that never splits a UTF-8 character.

Each token id maps to the exact bytes it stands for (a ``TokenTable``,
built once per tokenizer). Feeding a token pushes its bytes through an
incremental UTF-8 decoder and returns only the characters that are now
complete: a token that ends inside a multi-byte character releases nothing,
and the token that completes it releases the whole character. The text of
earlier tokens is never decoded again.
"""

from __future__ import annotations

import codecs

from sluiceway.protocol.tokens import TokenTable


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
