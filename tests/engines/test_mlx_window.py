"""A window mlx-lm's model class would ignore holds the mlx engine's context
to the window: a longer prompt is refused as too long, never answered with
whole-sequence attention where the model was made to attend over a window."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sluiceway.engines.loader import ModelSource, resolve_model
from sluiceway.engines.mlx_engine import MlxEngine, unhonoured_window


@dataclass
class _NoWindow:  # mlx-lm's Qwen3 arguments: no window at all
    model_type: str


@dataclass
class _Windowed:  # mlx-lm's Llama arguments: it honours layer_types
    model_type: str
    layer_types: list[str] | None = None
    sliding_window: int | None = None


QWEN3_WINDOWED = {
    "sliding_window": 128,
    "use_sliding_window": True,
    "layer_types": ["sliding_attention", "sliding_attention"],
}


@pytest.mark.parametrize(
    ("config", "args", "window"),
    [
        (QWEN3_WINDOWED, _NoWindow("qwen3"), 128),
        ({**QWEN3_WINDOWED, "use_sliding_window": False}, _NoWindow("qwen3"), None),
        # Qwen3's shipped configs: a window given, switched off.
        ({"sliding_window": 4096, "use_sliding_window": False}, _NoWindow("qwen3"), None),
        ({**QWEN3_WINDOWED, "layer_types": ["full_attention"] * 2}, _NoWindow("qwen3"), None),
        # Mistral 7B v0.1: a window given is a window used.
        ({"sliding_window": 4096}, _NoWindow("mistral"), 4096),
        ({"sliding_window": None}, _NoWindow("mistral"), None),
        (QWEN3_WINDOWED, _Windowed("llama"), None),
        # Mistral 7B v0.1 read as Llama: without layer_types mlx-lm ignores it.
        ({"sliding_window": 4096}, _Windowed("llama"), 4096),
        (QWEN3_WINDOWED, None, 128),
    ],
)
def test_unhonoured_window(config: dict[str, Any], args: Any, window: int | None) -> None:
    assert unhonoured_window(config, args) == window


def test_the_mlx_engine_holds_its_context_to_the_window(
    tiny_model: ModelSource, tmp_path: Path
) -> None:
    plain = MlxEngine(tiny_model)
    assert plain.info.max_context == tiny_model.config["max_position_embeddings"]
    plain.close()
    copy = tmp_path / "windowed"
    shutil.copytree(tiny_model.path, copy)
    config = json.loads((copy / "config.json").read_text())
    layers = config["num_hidden_layers"]
    window = {**QWEN3_WINDOWED, "layer_types": ["sliding_attention"] * layers, "sliding_window": 64}
    (copy / "config.json").write_text(json.dumps({**config, **window}))
    windowed = MlxEngine(resolve_model(str(copy)))
    assert windowed.info.max_context == 64
    windowed.close()
