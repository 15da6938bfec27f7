"""What a grammar mask costs per token, per constrained row, off the engine.

    .venv/bin/python bench/grammar_mask.py [--rows 1 16] [--tokens 300]

For each vocabulary (the embedded default model's 1,920 ids, and a
byte-level BPE vocabulary of ~150k pieces, the size of Qwen3's, made up from
random word pieces since no real one is on disk) it reports the grammar
engine's set-up, the compile time of a few constraints, and per generated
token of a constrained row:

- ``fill``: llguidance computing the row's mask (what runs while the engine
  computes the next step);
- ``apply``: the sampler turning the bitmask into ``-inf`` on the logits row;
- ``consume``: advancing the matcher by the chosen token.

The rows walk their grammars with tokens drawn uniformly among the allowed
ones (a random model, at worst), until the grammar completes; ``--rows``
rows advance together, their masks filled in one batch as the sampler does.
Times are the process's CPU time (see :func:`walk`).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sluiceway.engines.default_model import (
    EOS_TOKEN,
    MARKUP_TOKENS,
    SPECIAL_TOKENS,
    default_model_dir,
    padded_vocab,
)
from sluiceway.engines.grammar import GrammarEngine, allowed_ids, mask_logits
from sluiceway.engines.tokenizer import ModelTokenizer
from sluiceway.protocol.constraints import Constraint, ConstraintKind

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email", "maxLength": 40},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}  # fmt: skip

CONSTRAINTS = {
    "json_schema": Constraint(kind=ConstraintKind.JSON_SCHEMA, text=json.dumps(SCHEMA)),
    "json_object": Constraint(kind=ConstraintKind.JSON_OBJECT),
    "regex": Constraint(
        kind=ConstraintKind.REGEX, text=r"[A-Z][a-z]{2,12}( [A-Z][a-z]{2,12}){0,3}\."
    ),
    "choice": Constraint.choice(["positive", "negative", "neutral"]),
}


def synthetic_tokenizer(target: Path, size: int, seed: int = 7) -> Path:
    """A byte-level BPE ``tokenizer.json`` of ``size`` pieces: the 256 byte
    symbols, then random pieces shaped like a real vocabulary's (words with
    and without a leading space, digits, punctuation runs, some accented and
    CJK text); no merges, since only the pieces' bytes matter to a mask."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from sluiceway.engines.default_model import write_tokenizer
    from sluiceway.engines.tokenizer import _byte_level_alphabet

    rng = np.random.default_rng(seed)
    alphabet = {byte: char for char, byte in _byte_level_alphabet().items()}
    pools = [
        "abcdefghijklmnopqrstuvwxyz",
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz",
        "0123456789",
        "{}[]():;,.\"'!?-_/\\<>=+*&%$#@",
        "éèàüöäñçßøå",
        "的一是不了人我在有他这中",
    ]
    weights = np.array([0.55, 0.15, 0.08, 0.1, 0.07, 0.05])
    vocab: dict[str, int] = {alphabet[b]: b for b in range(256)}
    while len(vocab) < size:
        pool = pools[int(rng.choice(len(pools), p=weights))]
        piece = "".join(rng.choice(list(pool), size=int(rng.integers(2, 9))))
        if rng.random() < 0.4:
            piece = " " + piece
        symbols = "".join(alphabet[b] for b in piece.encode())
        vocab.setdefault(symbols, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    write_tokenizer(target, tokenizer, "")
    return target


def timed(function: Callable[[], Any]) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def walk(
    engine: GrammarEngine, constraint: Constraint, rows: int, tokens: int, seed: int
) -> dict[str, list[float]]:
    """Per-token times (µs per row) for ``rows`` rows walking one grammar together.

    CPU time of the whole process (llguidance's fill threads included), not
    wall time: on a shared host a call's wall time is mostly the time it
    waited for a core."""
    clock = time.process_time
    rng = np.random.default_rng(seed)
    grammar = engine.compile(constraint)
    matchers = [grammar.matcher() for _ in range(rows)]
    logits = rng.normal(size=(rows, engine.vocab_size)).astype(np.float32)
    times: dict[str, list[float]] = {"fill": [], "apply": [], "consume": []}
    produced = 0
    while produced < tokens:
        live = [m for m in matchers if not m.is_stopped()]
        if not live:
            matchers = [grammar.matcher() for _ in range(rows)]
            continue
        masks = engine.new_masks(len(live))
        started = clock()
        engine.fill_masks(live, masks)
        times["fill"].append((clock() - started) / len(live))
        rows_logits = logits[: len(live)].copy()
        started = clock()
        for i in range(len(live)):
            mask_logits(rows_logits[i], masks[i])
        times["apply"].append((clock() - started) / len(live))
        chosen = [
            int(rng.choice(np.flatnonzero(allowed_ids(masks[i], engine.vocab_size))))
            for i in range(len(live))
        ]
        started = clock()
        for matcher, token in zip(live, chosen, strict=True):
            matcher.consume_token(token)
        times["consume"].append((clock() - started) / len(live))
        produced += len(live)
    return times


def report(name: str, tokenizer: ModelTokenizer, vocab: int, rows: list[int], tokens: int) -> None:
    build = time.perf_counter()
    engine = GrammarEngine(tokenizer.hf, vocab, tokenizer.eos_ids)
    print(f"\n{name}: {vocab} ids; grammar engine built in {time.perf_counter() - build:.2f} s")
    for label, constraint in CONSTRAINTS.items():
        seconds = timed(functools.partial(engine.compile, constraint))
        print(f"  compile {label:12s} {seconds * 1e3:8.2f} ms")
    print(
        f"  {'constraint':12s} {'rows':>4s} {'fill µs':>10s} {'apply µs':>10s} {'consume µs':>11s}   (median, p90; per row and token)"
    )
    for label, constraint in CONSTRAINTS.items():
        for count in rows:
            times = walk(engine, constraint, count, tokens, seed=1)
            cells = []
            for key in ("fill", "apply", "consume"):
                values = sorted(times[key])
                p90 = values[int(len(values) * 0.9)]
                cells.append(f"{statistics.median(values) * 1e6:6.1f}/{p90 * 1e6:<5.0f}")
            print(f"  {label:12s} {count:4d} " + " ".join(f"{c:>11s}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--tokens", type=int, default=300, help="tokens per measurement")
    parser.add_argument(
        "--vocab", type=int, default=151_643, help="size of the synthetic vocabulary"
    )
    args = parser.parse_args()
    default = default_model_dir()
    config = json.loads((default / "config.json").read_text())
    report(
        "default model",
        ModelTokenizer(default, config["vocab_size"]),
        config["vocab_size"],
        args.rows,
        args.tokens,
    )
    with tempfile.TemporaryDirectory() as scratch:
        target = synthetic_tokenizer(Path(scratch), args.vocab)
        tokenizer = ModelTokenizer(
            target, padded_vocab(args.vocab + len(SPECIAL_TOKENS) + len(MARKUP_TOKENS))
        )
        assert EOS_TOKEN in tokenizer.hf.get_vocab()
        report(
            "synthetic byte-level BPE",
            tokenizer,
            padded_vocab(len(tokenizer.hf.get_vocab())),
            args.rows,
            args.tokens,
        )


if __name__ == "__main__":
    main()
