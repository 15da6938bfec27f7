"""The pipeline's shortcut for plain tokens gives exactly what the general path gives.

``ChoicePipeline.feed`` skips the stages and the assembler's routing for a
token whose complete text goes straight to content (no stage, or only stages
that are ``transparent``, such as a reasoning parser past ``</think>``). A
pass-through stage that is never transparent turns the shortcut off, so the
same tokens fed to both pipelines must give the same chunks, step by step,
the same finish and the same channel counts.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from sluiceway.parsers.events import Channel
from sluiceway.parsers.pipeline import ChoicePipeline, TextStage
from sluiceway.parsers.reasoning import deepseek_r1, qwen3

from .harness import (
    MULTIBYTE,
    PLAIN,
    REASONING_NEAR_MISSES,
    Recorder,
    Tokenized,
    examples,
    joined,
    text_atoms,
    tokenizations,
)

ATOMS = text_atoms(PLAIN, MULTIBYTE, REASONING_NEAR_MISSES, ["<think>", "</think>", "\n\n"])


def _run(
    tokenized: Tokenized, stages: Sequence[TextStage], hidden: frozenset[int]
) -> tuple[list[object], object, dict[Channel, int]]:
    pipeline = ChoicePipeline(tokenized.table, stages)
    steps: list[object] = []
    for position, token_id in enumerate(tokenized.ids):
        steps.append(pipeline.feed(token_id, visible=position not in hidden))
    finished = pipeline.finish()
    return steps, finished, pipeline.channel_counts()


@st.composite
def _cases(draw: st.DrawFn) -> tuple[Tokenized, str | None, frozenset[int]]:
    text = draw(joined(ATOMS, max_size=16))
    tokenized = draw(tokenizations(text))
    reasoning = draw(st.sampled_from([None, "qwen3", "deepseek_r1"]))
    hidden = draw(st.sets(st.integers(0, max(0, len(tokenized.ids) - 1)), max_size=2))
    return tokenized, reasoning, frozenset(hidden)


@settings(max_examples=examples(300), deadline=None)
@given(_cases())
def test_shortcut_matches_the_general_path(
    case: tuple[Tokenized, str | None, frozenset[int]],
) -> None:
    tokenized, reasoning, hidden = case
    parsers = {None: lambda: [], "qwen3": lambda: [qwen3()], "deepseek_r1": lambda: [deepseek_r1()]}
    fast = _run(tokenized, parsers[reasoning](), hidden)
    general = _run(tokenized, [*parsers[reasoning](), Recorder()], hidden)
    assert fast == general


def test_a_reasoning_parser_is_transparent_only_in_content() -> None:
    parser = qwen3()
    assert not parser.transparent  # at the start, a <think> may still open
    parser.prime("<think>\nhm</think>\n\nok")
    assert parser.transparent
