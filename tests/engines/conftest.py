"""A small random Qwen3 model, built once per session, and both engines over it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sluiceway.engines.base import Engine
from sluiceway.engines.default_model import (
    Qwen3Dims,
    chat_template,
    random_weights,
    train_tokenizer,
    write_qwen3,
    write_tokenizer,
)
from sluiceway.engines.loader import ModelSource, resolve_model
from sluiceway.engines.select import make_engine
from tests.engines.helpers import exact_dtype

ENGINES = ("mlx", "transformers")

#: Small enough to run every test in seconds, big enough to exercise grouped
#: query attention (4 query heads over 2 key/value heads) and several layers.
TINY = Qwen3Dims(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    max_position_embeddings=4096,
)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> ModelSource:
    """A random Qwen3 directory; std 0.1 keeps the top logits well apart, so greedy is stable."""
    target: Path = tmp_path_factory.mktemp("tiny-qwen3")
    tokenizer = train_tokenizer(vocab_size=512)
    write_tokenizer(target, tokenizer, chat_template())
    vocab = tokenizer.get_vocab_size()
    write_qwen3(target, TINY, vocab, random_weights(TINY, vocab, seed=20240607, std=0.1))
    return resolve_model(str(target))


@pytest.fixture(scope="session")
def reference(tiny_model: ModelSource) -> Any:
    """The same model in plain transformers: the oracle both engines are held to."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(tiny_model.path), local_files_only=True)
    model.eval()
    return model


#: The batch buckets the compiled engine compiles (compiling is slow: seconds
#: a bucket); larger batches take its eager step.
COMPILE_MAX_BATCH = 4


@pytest.fixture(scope="session")
def compiled_transformers(tiny_model: ModelSource) -> Iterator[Engine]:
    """The transformers engine with its decode step compiled (``--compile on``):
    one for the session, so that each bucket compiles once."""
    from sluiceway.engines.torch_engine import TransformersEngine

    built = TransformersEngine(
        tiny_model, dtype="float32", compile="on", compile_max_batch=COMPILE_MAX_BATCH
    )
    yield built
    built.close()


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest, tiny_model: ModelSource) -> Iterator[Engine]:
    built = make_engine(
        str(request.param), tiny_model, device="auto", dtype=exact_dtype(str(request.param))
    )
    yield built
    built.close()
