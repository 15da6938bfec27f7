"""The GGUF's tokenizer for llama-server (bench/llama_peer.py), against the
Hugging Face tokenizer it is written from."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))

from llama_peer import CONTROL, NORMAL, PRE_TOKENIZER, UNUSED, USER_DEFINED, add_tokenizer

from sluiceway.engines.default_model import chat_template, train_tokenizer, write_tokenizer


class Recorder:
    """Stands in for gguf's GGUFWriter: keeps what each ``add_*`` was given."""

    def __init__(self) -> None:
        self.fields: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        return lambda value: self.fields.__setitem__(name.removeprefix("add_"), value)


def test_the_tokens_kinds_and_merges_follow_the_tokenizer(tmp_path: Path) -> None:
    tokenizer = train_tokenizer(vocab_size=300)
    write_tokenizer(tmp_path, tokenizer, chat_template())
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    size = tokenizer.get_vocab_size() + 20  # the embedding's padding rows
    written = Recorder()
    config = {"vocab_size": size, "bos_token_id": 0, "eos_token_id": 2}
    add_tokenizer(written, tmp_path, config)
    fields = written.fields
    assert (fields["tokenizer_model"], fields["tokenizer_pre"]) == ("gpt2", PRE_TOKENIZER)
    tokens, kinds = fields["token_list"], fields["token_types"]
    assert len(tokens) == len(kinds) == size
    for token, index in data["model"]["vocab"].items():
        assert tokens[index] == token
    for added in data["added_tokens"]:
        assert tokens[added["id"]] == added["content"]
        assert kinds[added["id"]] == (CONTROL if added["special"] else USER_DEFINED)
    assert tokens[-1] == f"[PAD{size - 1}]"
    assert kinds[-1] == UNUSED
    assert kinds.count(NORMAL) == len(data["model"]["vocab"]) - len(
        [a for a in data["added_tokens"] if a["id"] < len(data["model"]["vocab"])]
    )
    assert fields["token_merges"] == [" ".join(pair) for pair in data["model"]["merges"]]
    eos = json.loads((tmp_path / "tokenizer_config.json").read_text())["eos_token"]
    assert tokens[fields["eos_token_id"]] == eos
    assert fields["add_bos_token"] is False
