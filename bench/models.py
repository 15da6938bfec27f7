"""Benchmark models: random Qwen3-shaped models, built once and cached.

Every model here is written under ``$XDG_CACHE_HOME/sluiceway`` (or
``~/.cache/sluiceway``) as an ordinary Hugging Face model directory, from a
fixed seed, so that reruns (and other benchmarks) reuse it.

* :func:`serving_model` -- ~42M parameters, with a byte-level BPE tokenizer that
  covers every one of the 16,384 ids, so that any generated id decodes to
  text in every server (ours and the peers) and a text prompt tokenizes the
  same way everywhere.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from sluiceway.engines.default_model import (
    Qwen3Dims,
    chat_template,
    default_cache_dir,
    random_weights,
    train_tokenizer,
    weight_shapes,
    write_qwen3,
    write_tokenizer,
)

#: hidden 512, 8 layers, 8 heads over 4 KV heads: ~42M parameters at a 16k vocabulary.
DIMS = Qwen3Dims(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=1536,
)
#: 16k keeps the model at ~40M parameters with untied embeddings (32k would be 58M).
VOCAB = 16384


def parameter_count(vocab: int, dims: Qwen3Dims = DIMS) -> int:
    return sum(int(np.prod(shape)) for shape in weight_shapes(dims, vocab).values())


def serving_model(vocab: int = VOCAB) -> Path:
    """The serving benchmark's model: a tokenizer with exactly ``vocab`` ids."""
    name = f"bench-serve-qwen3-{DIMS.hidden_size}x{DIMS.num_hidden_layers}-{vocab}"

    def build(target: Path) -> None:
        # train_tokenizer adds the markup tokens after training.
        tokenizer = train_tokenizer(vocab - 6, synthetic_corpus(seed=0))
        _write(target, tokenizer, tokenizer.get_vocab_size(), seed=7)

    return _cached(name, build)


def synthetic_corpus(seed: int, lines: int = 20000) -> str:
    """Deterministic text of made-up words with a Zipf-like frequency, rich
    enough in distinct pairs for a BPE vocabulary of 16k and more."""
    rng = np.random.default_rng(seed)
    onsets = ["", *"bcdfghjklmnprstvwz", "br", "cl", "st", "th", "sh", "ch", "pr", "tr", "gr", "fl"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "y", "io"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "x"]
    syllables = [o + v + c for o in onsets for v in vowels for c in codas]
    lexicon = [
        "".join(syllables[i] for i in rng.integers(0, len(syllables), int(rng.integers(1, 4))))
        for _ in range(60000)
    ]
    weights = 1.0 / np.arange(1, len(lexicon) + 1) ** 1.05
    lengths = rng.integers(6, 18, lines)
    picks = iter(rng.choice(len(lexicon), int(lengths.sum()), p=weights / weights.sum()))
    numbers = rng.integers(0, 10000, lines)
    marks = rng.choice([".", ",", "!", "?", ";"], lines)
    with_number = rng.random(lines) < 0.3
    out = []
    for line in range(lines):
        words = [lexicon[next(picks)] for _ in range(int(lengths[line]))]
        if with_number[line]:
            words.append(str(numbers[line]))
        out.append(" ".join(words).capitalize() + str(marks[line]) + "\n")
    return "".join(out)


def shipped_corpus() -> str:
    """The text the embedded default model's tokenizer was trained on."""
    return resources.files("sluiceway.engines").joinpath("data/corpus.txt").read_text()


def _write(target: Path, tokenizer: Any, vocab: int, *, seed: int) -> None:
    write_tokenizer(target, tokenizer, chat_template())
    write_qwen3(target, DIMS, vocab, random_weights(DIMS, vocab, seed=seed))


def _cached(name: str, build: Callable[[Path], None]) -> Path:
    """``default_cache_dir() / name``, built into a scratch directory and
    renamed into place, so that an interrupted build leaves nothing behind."""
    target = default_cache_dir() / name
    if (target / "model.safetensors").is_file():
        return target
    print(f"building {target} ...", flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        staging = Path(scratch) / "model"
        build(staging)
        if target.exists():  # a half-built directory from an older builder
            shutil.rmtree(target)
        staging.rename(target)
    return target
