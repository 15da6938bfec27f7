"""The agent benchmark's workload and figures (``bench/agent.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))

from agent import Run, Turn, build_workload
from models import synthetic_corpus

from sluiceway.engines.default_model import default_model_dir


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return default_model_dir(tmp_path_factory.mktemp("cache")) / "tokenizer.json"


def test_every_turn_resends_the_shared_system_prompt_and_the_history(
    tokenizer_json: Path,
) -> None:
    from tokenizers import Tokenizer

    workload = build_workload(
        tokenizer_json,
        synthetic_corpus(seed=1, lines=1000),
        system_tokens=2000,
        conversations=3,
        turns=4,
    )
    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    assert 2000 <= len(tokenizer.encode(workload.system).ids) <= 2080
    assert "run_command" in workload.system  # the tools are in it
    for conversation in range(3):
        for turn in range(4):
            messages = workload.messages(conversation, turn)
            assert messages[0] == {"role": "system", "content": workload.system}
            assert [m["role"] for m in messages[1:]] == ["user", "assistant"] * turn + ["user"]
            if turn:  # the previous turn's prompt is a prefix of this one's
                assert messages[:-2] == workload.messages(conversation, turn - 1)
    firsts = {workload.messages(c, 0)[1]["content"] for c in range(3)}
    assert len(firsts) == 3  # conversations differ after the system prompt


def test_first_and_later_turns_are_told_apart() -> None:
    turns = [
        Turn(0, 0, sent=0.0, first=2.0, prompt_tokens=100),
        Turn(0, 1, sent=10.0, first=10.5, prompt_tokens=200, cached_tokens=150),
        Turn(1, 0, sent=20.0, first=21.0, prompt_tokens=100, cached_tokens=50),
        Turn(1, 1, sent=30.0, error="HTTP 500"),
    ]
    run = Run("x", 1, turns, wall=40.0)
    assert run.ttft(50, first=True) == 1.5
    assert run.ttft(50, first=False) == 0.5
    assert run.errors == 1
    assert run.cached_share == 200 / 400
