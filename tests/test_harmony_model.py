"""The harmony fixture model (tests/fixtures/harmony_model.py): its build is
deterministic (a fresh build equals the cached one, weights and all), and
every script decodes greedily from prompts of the harmony template in both
engines' terms (checked end to end in tests/e2e/test_harmony.py)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from sluiceway.engines.default_model import default_cache_dir, default_model_dir
from sluiceway.engines.tokenizer import ModelTokenizer
from sluiceway.parsers.harmony import HarmonyTokens, Marker
from tests.fixtures.harmony_model import (
    HARMONY_SCRIPTS,
    MARKERS,
    build_harmony_model,
    cached_harmony_model,
)

#: Training takes minutes on a busy 2-core host.
pytestmark = pytest.mark.timeout(1200)

#: Training steps of the determinism check: enough for AdamW's state to matter.
SHORT = 30

FILES = ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_building_twice_gives_the_same_model(tmp_path: Path) -> None:
    """The build is deterministic: two builds of a short training write the
    same bytes (the full training is the same code for more steps; building
    it twice would cost the suite minutes)."""
    one, two = (
        build_harmony_model(
            tmp_path / name, HARMONY_SCRIPTS, max_steps=SHORT, min_margin=float("-inf")
        )
        for name in ("one", "two")
    )
    assert {f: _digest(one.path / f) for f in FILES} == {f: _digest(two.path / f) for f in FILES}
    assert dict(one.piece_ids) == dict(two.piece_ids)


def test_the_markers_are_special_tokens_found_by_name() -> None:
    model = cached_harmony_model(default_cache_dir() / "test-models", HARMONY_SCRIPTS)
    tokenizer = ModelTokenizer(model.path, 512)
    found = HarmonyTokens.of(tokenizer.table)
    assert {marker.value: found.id_of(marker) for marker in Marker} == dict(model.marker_ids)
    assert all(model.marker_ids[m] in tokenizer.table.hidden for m in MARKERS)
    # <|call|> and <|return|> end generation; <|end|> does not.
    ends = {model.marker_ids["<|call|>"], model.marker_ids["<|return|>"]}
    assert ends <= tokenizer.eos_ids
    assert model.marker_ids["<|end|>"] not in tokenizer.eos_ids


def test_call_and_return_end_the_reply_whatever_the_generation_config(tmp_path: Path) -> None:
    """A checkpoint whose generation_config lists only ``<|return|>`` (or no
    end at all) still stops at ``<|call|>``: the ends come from the vocabulary."""
    model = cached_harmony_model(default_cache_dir() / "test-models", HARMONY_SCRIPTS)
    copy = tmp_path / "model"
    shutil.copytree(model.path, copy)
    ends = {model.marker_ids["<|call|>"], model.marker_ids["<|return|>"]}
    for listed in ([model.marker_ids["<|return|>"]], []):
        (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": listed}))
        config = json.loads((copy / "config.json").read_text())
        (copy / "config.json").write_text(json.dumps({**config, "eos_token_id": None}))
        assert ends <= ModelTokenizer(copy, 512).eos_ids
    # A vocabulary without harmony's markers keeps the ends it lists.
    plain = default_model_dir()
    listed = json.loads((plain / "generation_config.json").read_text())["eos_token_id"]
    assert ModelTokenizer(plain, 2048).eos_ids == set(listed)


def test_a_selector_in_the_text_picks_the_script() -> None:
    """A client that cannot send ``chat_template_kwargs`` (the Codex CLI)
    names the script in its text: the last selector written wins, and each
    is cut out of the text, so the model sees one, where it was trained to."""
    from transformers import AutoTokenizer

    model = cached_harmony_model(default_cache_dir() / "test-models", HARMONY_SCRIPTS)
    hf = AutoTokenizer.from_pretrained(str(model.path))
    messages = [
        {"role": "system", "content": "Be <|script:no_header|>terse."},
        {"role": "user", "content": "Go <|script:analysis_final|>now."},
        {"role": "tool", "name": "f", "content": "out<|script:multibyte|>"},
    ]

    def render(**kwargs: Any) -> str:
        text = hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )
        assert isinstance(text, str)
        return text

    text = render()
    assert text.endswith("<|end|><|script:multibyte|><|start|>assistant")
    assert text.count("<|script:") == 1
    assert "Be terse." in text
    assert "Go now." in text
    assert "<|message|>out<|end|>" in text
    # A script named by the request's kwargs outranks the text.
    assert render(script="two_calls").endswith("<|script:two_calls|><|start|>assistant")
