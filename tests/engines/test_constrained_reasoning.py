"""A constraint waits out the reasoning section, on both reasoning parsers:
with the scripted model (greedy decoding follows a known token script) the
reasoning is exactly the script's, however far from the grammar, and the
content after ``</think>`` validates."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from sluiceway.parsers.reasoning import DEEPSEEK_R1, QWEN3, ReasoningDialect, reasoning_gate
from sluiceway.parsers.registry import TextPathOptions, build_pipeline
from sluiceway.protocol.constraints import Constraint, ConstraintKind, ReasoningGate
from sluiceway.protocol.messages import FinishCause
from tests.engines.conftest import ENGINES
from tests.engines.constrained_rig import Outcome, Rig, generation, open_rig
from tests.fixtures.scripted_model import Script, ScriptedModel, build_scripted_model

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
JSON = Constraint(kind=ConstraintKind.JSON_SCHEMA, text=json.dumps(SCHEMA))

#: The model opens reasoning itself (qwen3); the content is valid as scripted.
OPENS = Script(
    "opens",
    ("<think>", "\nHmm", " {broken", " json", ".\n", "</think>", '{"answer": ', '"yes"', "}"),
)
#: As above, with the blank line Qwen3 writes after ``</think>``, which the
#: grammar does not allow before a JSON document.
BLANK_LINE = Script(
    "blank_line",
    ("<think>", "\nOk", "</think>", "\n\n", '{"answer": ', '"no"', "}"),
)
#: The prompt left the output inside reasoning (deepseek_r1).
INSIDE = Script("inside", (" I", " reason", " {x", "</think>", '{"answer": ', '"no"', "}"))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> ScriptedModel:
    return build_scripted_model(tmp_path_factory.mktemp("reasoning"), (OPENS, BLANK_LINE, INSIDE))


@pytest.fixture(scope="module", params=ENGINES)
def rig(request: pytest.FixtureRequest, model: ScriptedModel) -> Iterator[Rig]:
    yield from open_rig(Path(model.path), str(request.param), in_child=False)


def run(rig: Rig, model: ScriptedModel, script: str, constraint: Constraint) -> Outcome:
    prompt = rig.tokenizer.encode_prompt(model.selector(script))
    request = generation(rig, script, constraint, prompt_ids=prompt, temperature=0.0)
    (outcome,) = rig.run([request])[script]
    assert outcome.failure is None
    assert outcome.finish in (FinishCause.EOS, FinishCause.GRAMMAR)
    return outcome


def channels(rig: Rig, dialect: ReasoningDialect, prefix: str, outcome: Outcome) -> tuple[str, str]:
    """The reasoning and the content the text path makes of the tokens."""
    pipeline = build_pipeline(
        rig.tokenizer.table,
        TextPathOptions(reasoning_parser=dialect.name, assistant_prefix=prefix),
    )
    chunks = []
    for token in outcome.tokens:
        chunks += pipeline.feed(token, visible=token not in rig.tokenizer.eos_ids)
    chunks += pipeline.finish().chunks
    return "".join(c.reasoning for c in chunks), "".join(c.content for c in chunks)


def gate(rig: Rig, dialect: ReasoningDialect, prefix: str) -> ReasoningGate | None:
    return reasoning_gate(dialect, prefix, rig.tokenizer.single_token)


def with_gate(constraint: Constraint, reasoning: ReasoningGate | None) -> Constraint:
    return Constraint(kind=constraint.kind, text=constraint.text, reasoning=reasoning)


def test_qwen3_reasoning_is_free_and_valid_content_is_left_alone(
    rig: Rig, model: ScriptedModel
) -> None:
    reasoning_gate_ = gate(rig, QWEN3, "")
    assert reasoning_gate_ is not None
    assert reasoning_gate_.start_id == rig.tokenizer.single_token("<think>")
    outcome = run(rig, model, "opens", with_gate(JSON, reasoning_gate_))
    reasoning, content = channels(rig, QWEN3, "", outcome)
    assert reasoning == "\nHmm {broken json.\n"
    assert content == '{"answer": "yes"}'
    # The script's very tokens; the closed document ends the row before the script's EOS.
    assert outcome.tokens == model.token_ids("opens")[:-1]
    assert outcome.finish is FinishCause.GRAMMAR


def test_qwen3_content_is_held_to_the_grammar_after_reasoning(
    rig: Rig, model: ScriptedModel
) -> None:
    outcome = run(rig, model, "blank_line", with_gate(JSON, gate(rig, QWEN3, "")))
    reasoning, content = channels(rig, QWEN3, "", outcome)
    assert reasoning == "\nOk"
    jsonschema.validate(json.loads(content), SCHEMA)
    assert not content.startswith("\n")


def test_deepseek_r1_reasoning_left_open_by_the_prompt_is_free(
    rig: Rig, model: ScriptedModel
) -> None:
    for prefix in ("", "<think>\n"):
        reasoning_gate_ = gate(rig, DEEPSEEK_R1, prefix)
        assert reasoning_gate_ is not None
        assert reasoning_gate_.inside
        outcome = run(rig, model, "inside", with_gate(JSON, reasoning_gate_))
        reasoning, content = channels(rig, DEEPSEEK_R1, prefix, outcome)
        assert reasoning == " I reason {x"
        assert content == '{"answer": "no"}'


def test_a_prompt_that_closed_reasoning_constrains_from_the_first_token(
    rig: Rig, model: ScriptedModel
) -> None:
    """No gate: the model cannot open reasoning, the whole output is the document."""
    prefix = "<think>\n\n</think>\n\n"
    assert gate(rig, QWEN3, prefix) is None
    outcome = run(rig, model, "opens", with_gate(JSON, gate(rig, QWEN3, prefix)))
    assert rig.tokenizer.single_token("<think>") not in outcome.tokens
    reasoning, content = channels(rig, QWEN3, prefix, outcome)
    assert reasoning == ""
    jsonschema.validate(json.loads(content), SCHEMA)


def test_a_closing_tag_of_several_tokens_cannot_gate(rig: Rig) -> None:
    from sluiceway.parsers.reasoning import UnsupportedGateError

    with pytest.raises(UnsupportedGateError):
        reasoning_gate(QWEN3, "", lambda text: None)
    assert reasoning_gate(QWEN3, "<think>\n", lambda text: 7) == ReasoningGate(
        end_id=7, inside=True
    )
