"""The id -> bytes table agrees with the Hugging Face tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluiceway.engines.tokenizer import ModelTokenizer, build_token_table


@pytest.fixture(scope="module")
def tokenizer(default_model: Path) -> ModelTokenizer:
    return ModelTokenizer(default_model, 1920)


def test_every_token_decodes_like_the_reference(tokenizer: ModelTokenizer) -> None:
    hf = tokenizer.hf
    for token_id in range(len(hf)):
        expected = hf.decode([token_id], skip_special_tokens=True)
        ours = tokenizer.table.output_bytes(token_id).decode("utf-8", errors="replace")
        assert ours == expected, token_id


def test_sequences_decode_like_the_reference(tokenizer: ModelTokenizer) -> None:
    text = "Hello <think>caf\u00e9</think> \U0001f600 \u65e5\u672c\u8a9e <tool_call>{}</tool_call>"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == tokenizer.hf.decode(ids, skip_special_tokens=True) == text


def test_markup_tokens_are_single_visible_tokens(tokenizer: ModelTokenizer) -> None:
    for tag in ("<think>", "</think>", "<tool_call>", "</tool_call>"):
        (token_id,) = tokenizer.encode(tag)
        assert tokenizer.table.output_bytes(token_id) == tag.encode()
    assert tokenizer.eos_ids  # <|im_end|> and <|endoftext|>
    for eos in tokenizer.eos_ids:
        assert tokenizer.table.output_bytes(eos) == b""


def test_metaspace_byte_fallback_vocabulary() -> None:
    document = {
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
            ],
        },
        "model": {"type": "BPE", "vocab": {"<0xC3>": 0, "<0xA9>": 1, "\u2581caf": 2}},
        "added_tokens": [{"id": 3, "content": "</s>", "special": True}],
    }
    table = build_token_table(document, 4)
    assert table.raw_bytes[:3] == (b"\xc3", b"\xa9", b" caf")
    assert table.strip_first_space
    assert table.decode([2, 0, 1, 3]) == "caf\u00e9"
