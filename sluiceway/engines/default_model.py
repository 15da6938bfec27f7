"""The embedded default model: built deterministically on first use, cached.

It is a small Qwen3-architecture model with *random* weights and a byte-level
BPE tokenizer trained on a corpus shipped with the package. Its text is noise;
it exists so that ``sluiceway serve`` proves the whole path works on a fresh
machine with nothing downloaded. It is written as an ordinary Hugging Face
model directory and loaded through the same code path as any other.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

logger = logging.getLogger(__name__)

BUILD_VERSION = "1"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MARKUP_TOKENS = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

Weights = dict[str, npt.NDArray[np.float32]]


@dataclass(frozen=True, slots=True)
class Qwen3Dims:
    """The shape of a Qwen3 model (``vocab_size`` is rounded up to 64)."""

    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384
    max_position_embeddings: int = 8192


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sluiceway"


def default_model_dir(cache_dir: Path | None = None) -> Path:
    """Return the default model's directory, building it if needed."""
    root = cache_dir or default_cache_dir()
    target = root / f"default-qwen3-v{BUILD_VERSION}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    logger.info("building the embedded default model (random weights) in %s ...", target)
    with tempfile.TemporaryDirectory(dir=root) as scratch:
        staging = Path(scratch) / "model"
        tokenizer = train_tokenizer(vocab_size=2048)
        write_tokenizer(staging, tokenizer, chat_template())
        vocab_size = tokenizer.get_vocab_size()
        dims = Qwen3Dims()
        write_qwen3(staging, dims, vocab_size, random_weights(dims, vocab_size, seed=1234))
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # lost a race only if the winner finished
                raise
    logger.info("default model ready in %.1f s", time.perf_counter() - started)
    return target


def chat_template() -> str:
    return resources.files("sluiceway.engines").joinpath("data/chat_template.jinja").read_text()


def train_tokenizer(vocab_size: int, corpus: str | None = None) -> Any:
    """Train a byte-level BPE tokenizer (deterministic for a given corpus)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    text = corpus
    if text is None:
        text = resources.files("sluiceway.engines").joinpath("data/corpus.txt").read_text()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tokenizer


def write_tokenizer(target: Path, tokenizer: Any, template: str) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN
    )
    fast.chat_template = template
    target.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(target))


def padded_vocab(vocab_size: int) -> int:
    return (vocab_size + 63) // 64 * 64


def write_qwen3(
    target: Path,
    dims: Qwen3Dims,
    tokenizer_vocab_size: int,
    weights: Weights,
    *,
    eos_ids: tuple[int, ...] | None = None,
    rope_theta: float = 1000000.0,
) -> None:
    """Write ``config.json``, ``generation_config.json`` and the weights."""
    from safetensors.numpy import save_file

    target.mkdir(parents=True, exist_ok=True)
    tokenizer_json = json.loads((target / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tokenizer_json["added_tokens"]}
    eos = eos_ids if eos_ids is not None else (ids[EOS_TOKEN], ids[PAD_TOKEN])
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": padded_vocab(tokenizer_vocab_size),
        **asdict(dims),
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": ids[PAD_TOKEN],
        "eos_token_id": eos[0],
        "torch_dtype": "float32",
    }
    (target / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": ids[PAD_TOKEN], "eos_token_id": list(eos)}
    (target / "generation_config.json").write_text(json.dumps(generation, indent=2))
    save_file(
        {name: np.ascontiguousarray(array, dtype=np.float32) for name, array in weights.items()},
        str(target / "model.safetensors"),
        metadata={"format": "pt"},
    )


def weight_shapes(dims: Qwen3Dims, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Every Qwen3 parameter name with its shape, in Hugging Face layout."""
    vocab = padded_vocab(vocab_size)
    h, hd = dims.hidden_size, dims.head_dim
    q, kv = dims.num_attention_heads * hd, dims.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for layer in range(dims.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (dims.intermediate_size, h),
            p + "mlp.up_proj.weight": (dims.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, dims.intermediate_size),
        }
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (vocab, h)
    return shapes


def random_weights(dims: Qwen3Dims, vocab_size: int, *, seed: int, std: float = 0.05) -> Weights:
    """Normal weights from a fixed seed; norms are ones."""
    rng = np.random.default_rng(seed)
    return fill_weights(
        dims,
        vocab_size,
        lambda name, shape: rng.normal(0.0, std, size=shape).astype(np.float32),
    )


def fill_weights(
    dims: Qwen3Dims,
    vocab_size: int,
    matrix: Callable[[str, tuple[int, ...]], npt.NDArray[np.float32]],
    overrides: Mapping[str, npt.NDArray[np.float32]] | None = None,
) -> Weights:
    """Build every weight: norms are ones, matrices come from ``matrix``."""
    weights: Weights = {}
    for name, shape in weight_shapes(dims, vocab_size).items():
        if overrides and name in overrides:
            weights[name] = overrides[name]
        elif name.endswith("norm.weight"):
            weights[name] = np.ones(shape, dtype=np.float32)
        else:
            weights[name] = matrix(name, shape)
    return weights


def clear_cache(cache_dir: Path | None = None) -> None:
    shutil.rmtree((cache_dir or default_cache_dir()) / f"default-qwen3-v{BUILD_VERSION}", True)
