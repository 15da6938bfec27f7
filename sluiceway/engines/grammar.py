"""The grammar engine of constrained decoding: llguidance over the model's tokenizer.

Theory of operation. llguidance (a Rust library) reads the tokenizer once and
builds a trie of every token's bytes. Compiling a constraint turns the schema,
regex, choice or Lark grammar into a lexer and an Earley parser; a matcher
walks that grammar token by token and, for its current state, writes the set
of token ids that keep the output inside the grammar as a bitmask (bit ``i``
of word ``i // 32`` for token ``i``), walking the trie rather than the
vocabulary. EOS is in the mask only where the grammar accepts.

Compiling costs from a fraction of a millisecond to seconds for a
pathological schema, so it never runs on the event loop, and compiled
grammars are cached by ``(kind, text)``: a compile builds one pristine
matcher, and each constrained choice gets a deep copy of it (the compiled
grammar is shared, not rebuilt). llguidance bounds its own work (lexer fuel,
grammar size, Earley items per step); on top of that a compile slower than
``compile_seconds`` counts as failed, and stays failed while it is cached,
so the same schema does not pass once and fail the next time.

JSON is generated on one line, with ``", "`` and ``": "`` between items
(what ``json.dumps`` writes): free whitespace lets a model loop on spaces or
newlines until ``max_tokens`` without ever breaking the grammar.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import numpy.typing as npt

from sluiceway.engines.date_formats import exact_date_formats
from sluiceway.protocol.constraints import Constraint, ConstraintKind

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

Bitmask = npt.NDArray[np.int32]

#: How JSON schemas are compiled (see the module docstring).
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class GrammarError(Exception):
    """A constraint the engine cannot compile; the message is the engine's."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GrammarConfig:
    #: A compile slower than this fails (and the client gets a 400).
    compile_seconds: float = 5.0
    #: Compiled grammars kept (least recently used ones go first).
    cache_size: int = 64


class Grammar:
    """A compiled constraint: hands out a fresh matcher per choice."""

    __slots__ = ("_template",)

    def __init__(self, template: llguidance.LLMatcher) -> None:
        self._template = template

    def matcher(self) -> llguidance.LLMatcher:
        return self._template.deep_copy()


class _Entry:
    """A cache slot; the first caller compiles, later ones wait for it."""

    __slots__ = ("_done", "_error", "_grammar")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._grammar: Grammar | None = None
        self._error: str | None = None

    def settle(self, grammar: Grammar | None, error: str | None) -> None:
        self._grammar, self._error = grammar, error
        self._done.set()

    def wait(self) -> Grammar:
        self._done.wait()
        if self._grammar is None:
            raise GrammarError(self._error or "the grammar did not compile")
        return self._grammar


class GrammarEngine:
    """llguidance for one model's tokenizer: compiles constraints (cached,
    thread-safe) and fills masks for a batch of matchers."""

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos_ids: Collection[int],
        config: GrammarConfig | None = None,
    ) -> None:
        self.config = config or GrammarConfig()
        #: The width of the model's logits (the tokenizer's vocabulary may be smaller).
        self.vocab_size = vocab_size
        self.mask_words = (vocab_size + 31) // 32
        self.eos_ids = tuple(sorted(eos_ids))
        #: llguidance's view of the tokenizer: every id's bytes, in a trie.
        self.tokenizer = llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=vocab_size, eos_token=list(self.eos_ids)
        )
        self._executor = llguidance.LLExecutor()
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[ConstraintKind, str], _Entry] = OrderedDict()

    def compile(self, constraint: Constraint) -> Grammar:
        """The compiled grammar of ``constraint``; blocks (never call it on the event loop)."""
        key = constraint.key
        with self._lock:
            entry = self._cache.get(key)
            owner = entry is None
            if entry is None:
                entry = self._cache[key] = _Entry()
                while len(self._cache) > self.config.cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        if owner:
            self._build(constraint, entry)
        return entry.wait()

    def _build(self, constraint: Constraint, entry: _Entry) -> None:
        started = time.perf_counter()
        try:
            template = llguidance.LLMatcher(self.tokenizer, grammar_text(constraint), log_level=0)
        except (ValueError, TypeError) as error:  # text that is not even the right syntax
            entry.settle(None, str(error))
            return
        elapsed = time.perf_counter() - started
        if template.is_error():
            entry.settle(None, template.get_error())
        elif elapsed > self.config.compile_seconds:
            entry.settle(
                None,
                f"compiling took {elapsed:.1f} s, over the limit of "
                f"{self.config.compile_seconds:g} s; simplify it",
            )
        else:
            entry.settle(Grammar(template), None)

    def markup(self, text: str, token: int | None) -> str:
        """A Lark symbol for tag text that a parser reads (``<tool_call>``).

        Where the text is one added token of the model (``token``),
        llguidance reads that token as a special one, which no string
        literal matches: the symbol is then the token (``<[id]>``);
        otherwise it is the literal.
        """
        if token is not None and self.tokenizer.is_special_token(token):
            return f"<[{token}]>"
        return lark_literal(text)

    def new_masks(self, rows: int) -> Bitmask:
        return np.zeros((rows, self.mask_words), dtype=np.int32)

    def fill_masks(self, matchers: Sequence[llguidance.LLMatcher], masks: Bitmask) -> None:
        """Write the mask of ``matchers[i]`` into ``masks[i]``; the GIL is
        released for the whole batch."""
        llguidance.numpy.fill_next_token_bitmask_par(
            self._executor, [(matcher, i) for i, matcher in enumerate(matchers)], masks
        )


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar of ``constraint`` (raises ``ValueError`` on bad syntax)."""
    kind, text = constraint.kind, constraint.text
    if kind is ConstraintKind.JSON_OBJECT:
        kind, text = ConstraintKind.JSON_SCHEMA, '{"type": "object"}'
    if kind is ConstraintKind.JSON_SCHEMA:
        return llguidance.LLMatcher.grammar_from_json_schema(
            _exact_text(text), overrides=JSON_OPTIONS
        )
    if kind is ConstraintKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind is ConstraintKind.CHOICE:
        return llguidance.LLMatcher.grammar_from_lark(_choice_lark(text))
    return llguidance.LLMatcher.grammar_from_lark(text)


def _exact_text(schema_text: str) -> str:
    """The schema with exact date formats (text that is not JSON goes on to
    llguidance, whose error names what is wrong)."""
    try:
        schema = json.loads(schema_text)
    except ValueError:
        return schema_text
    return json.dumps(exact_date_formats(schema))


def _choice_lark(text: str) -> str:
    return "start: " + _choice_rule(text)


def _choice_rule(text: str) -> str:
    options = json.loads(text)
    if not isinstance(options, list) or not options:
        raise ValueError("a choice needs a non-empty list of strings")
    if not all(isinstance(option, str) for option in options):
        raise ValueError("every choice must be a string")
    return " | ".join(lark_literal(option) for option in options)


# --- pieces of Lark grammars that other grammars embed ------------------------


def lark_literal(text: str) -> str:
    """A Lark string literal (it takes JSON's escapes)."""
    return json.dumps(text)


def lark_regex(pattern: str) -> str:
    """A Lark regex terminal matching what ``pattern`` matches (Rust syntax)."""
    return f"/{llguidance.regex_to_lark(pattern, '')}/"


def lark_json(schema: Mapping[str, Any]) -> str:
    """A JSON schema inlined in a Lark grammar, generated as
    :data:`JSON_OPTIONS` says (one line, ``json.dumps`` separators)."""
    return "%json " + json.dumps({**exact_date_formats(schema), "x-guidance": JSON_OPTIONS})


def embedded_rule(constraint: Constraint) -> str:
    """The body of a Lark rule matching what ``constraint`` matches, for a
    grammar that offers it beside other things (raises ``ValueError`` for a
    kind that cannot be embedded, or bad syntax)."""
    kind, text = constraint.kind, constraint.text
    if kind is ConstraintKind.JSON_OBJECT:
        return lark_json({"type": "object"})
    if kind is ConstraintKind.JSON_SCHEMA:
        schema = json.loads(text)
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema must be an object")
        return lark_json(schema)
    if kind is ConstraintKind.REGEX:
        return lark_regex(text)
    if kind is ConstraintKind.CHOICE:
        return _choice_rule(text)
    raise ValueError("a Lark grammar cannot be combined with other alternatives")


#: The bits of float32 ``-inf``.
_NEG_INF_BITS = np.uint32(0xFF800000)
_ALL_BITS = np.uint32(0xFFFFFFFF)


def mask_logits(x: npt.NDArray[np.float32], mask: Bitmask) -> None:
    """Set, in place, every logit of a contiguous row that ``mask`` does not
    allow to ``-inf``.

    Bitwise on the floats' bits, with no branch per id: a boolean-indexed
    assignment costs ~0.9 ms on a 150k vocabulary whose mask is half set
    (a misprediction per id), this ~0.13 ms whatever the mask.
    """
    keep = np.unpackbits(mask.view(np.uint8), bitorder="little")[: x.shape[0]].astype(np.uint32)
    keep *= _ALL_BITS  # every bit set where the id is allowed
    bits = x.view(np.uint32)
    bits &= keep
    keep ^= _ALL_BITS  # every bit set where it is not
    keep &= _NEG_INF_BITS
    bits |= keep


def allow(mask: Bitmask, token: int) -> Bitmask:
    """A copy of ``mask`` that also allows ``token``."""
    widened = mask.copy()
    widened.view(np.uint32)[token // 32] |= np.uint32(1 << (token % 32))
    return widened


def every_token(vocab_size: int, *, but: Collection[int] = ()) -> Bitmask:
    """A mask that allows every id below ``vocab_size`` except ``but``."""
    keep = np.ones(vocab_size, dtype=np.bool_)
    keep[list(but)] = False
    return pack(keep)


def pack(keep: npt.NDArray[np.bool_]) -> Bitmask:
    """One bool per token id as a mask row (the inverse of :func:`allowed_ids`)."""
    words = (keep.shape[0] + 31) // 32
    bits = np.zeros(words * 32, dtype=np.bool_)
    bits[: keep.shape[0]] = keep
    return np.packbits(bits, bitorder="little").view(np.int32)


def without(mask: Bitmask, ids: Collection[int]) -> Bitmask:
    """A copy of ``mask`` that does not allow ``ids``."""
    narrowed = mask.copy()
    words = narrowed.view(np.uint32)
    for token in ids:
        words[token // 32] &= ~np.uint32(1 << (token % 32))
    return narrowed


def allowed_ids(mask: Bitmask, vocab_size: int) -> npt.NDArray[np.bool_]:
    """A mask row as one bool per token id."""
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab_size]
    return bits.view(np.bool_)
