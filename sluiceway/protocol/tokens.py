"""What each token id of a vocabulary stands for: a pure description, built
once per tokenizer (``sluiceway.engines.tokenizer``) and read by the
detokenizer, the logprob entries and the surfaces' encoders.

It sits in ``protocol`` because both the engines (which build it) and the
parsers (which read it) need it, and neither may import the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


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
    #: :meth:`entry_parts` by id. Top-k alternatives repeat across requests
    #: far more than within one, so the memo lives as long as the tokenizer.
    _parts: dict[int, tuple[str, tuple[int, ...]]] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )
    #: :meth:`memo`'s dicts by name.
    _memos: dict[str, dict[int, Any]] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )

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

    def entry_parts(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        """A logprob entry's ``token`` (:meth:`display`) and ``bytes``, made
        once per id: the same objects every time, so encoders can key on them."""
        parts = self._parts.get(token_id)
        if parts is None:
            parts = self._parts[token_id] = (self.display(token_id), tuple(self.bytes_of(token_id)))
        return parts

    def memo(self, name: str) -> dict[int, Any]:
        """A dict by token id that lives as long as this vocabulary, for what
        an encoder makes once per id (a JSON piece of a logprob entry).

        Keyed on the vocabulary, such a memo needs no check that an id still
        stands for the text it was made from, and no bound beyond the
        vocabulary's size. ``name`` keeps apart the encoders (and their
        settings) that share a vocabulary.
        """
        found = self._memos.get(name)
        if found is None:
            found = self._memos[name] = {}
        return found

    def decode(self, token_ids: Sequence[int]) -> str:
        """Whole-sequence decode with the incremental detokenizer's rules:
        hidden tokens left out, the first space stripped where the vocabulary
        says so, an incomplete character at the end shown as U+FFFD."""
        data = b"".join(self.output_bytes(token_id) for token_id in token_ids)
        if self.strip_first_space and data.startswith(b" "):
            data = data[1:]
        return data.decode("utf-8", errors="replace")
