"""The exact date formats: every string a model may write under ``date``,
``time`` or ``date-time`` is one that jsonschema and Python accept, and the
rewrite touches schemas only."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluiceway.engines.date_formats import PATTERNS, exact_date_formats
from sluiceway.engines.grammar import GrammarEngine, allowed_ids, lark_json
from sluiceway.engines.tokenizer import ModelTokenizer
from sluiceway.protocol.constraints import Constraint, ConstraintKind

CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER


@pytest.fixture(scope="module")
def tokenizer(default_model: Path) -> ModelTokenizer:
    return ModelTokenizer(default_model, 1920)


@pytest.fixture(scope="module")
def grammars(tokenizer: ModelTokenizer) -> GrammarEngine:
    return GrammarEngine(tokenizer.hf, 1920, tokenizer.eos_ids)


def _string_schema(form: str) -> Constraint:
    schema = {"type": "string", "format": form, "maxLength": 40}
    return Constraint(kind=ConstraintKind.JSON_SCHEMA, text=json.dumps(schema))


def _accepts(grammars: GrammarEngine, tokenizer: ModelTokenizer, form: str, text: str) -> bool:
    matcher = grammars.compile(_string_schema(form)).matcher()
    ids = tokenizer.encode(json.dumps(text))
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def _walk(grammars: GrammarEngine, constraint: Constraint, data: st.DataObject) -> list[int]:
    matcher = grammars.compile(constraint).matcher()
    masks = grammars.new_masks(1)
    tokens: list[int] = []
    while not matcher.is_stopped() and len(tokens) < 200:
        grammars.fill_masks([matcher], masks)
        allowed = np.flatnonzero(allowed_ids(masks[0], grammars.vocab_size))
        allowed = allowed[~np.isin(allowed, grammars.eos_ids)]
        if not len(allowed):
            break
        token = int(allowed[data.draw(st.integers(0, len(allowed) - 1))])
        assert matcher.consume_token(token)
        tokens.append(token)
    assert matcher.is_accepting()
    return tokens


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(form=st.sampled_from(sorted(PATTERNS)), data=st.data())
def test_every_string_a_walk_writes_is_valid_everywhere(
    grammars: GrammarEngine, tokenizer: ModelTokenizer, form: str, data: st.DataObject
) -> None:
    """llguidance's own patterns let a random walk write ``10:15:60Z`` or the
    year ``0000`` within a few dozen tries; these never do."""
    text = json.loads(tokenizer.hf.decode(_walk(grammars, _string_schema(form), data)))
    assert CHECKER.conforms(text, form), text
    if form == "date":
        datetime.date.fromisoformat(text)
    elif form == "date-time":
        datetime.datetime.fromisoformat(text)
    else:
        datetime.time.fromisoformat(text)


@pytest.mark.parametrize(
    ("form", "text", "accepted"),
    [
        ("date", "2024-02-29", True),
        ("date", "2000-02-29", True),
        ("date", "0400-02-29", True),
        ("date", "0001-01-01", True),
        ("date", "1900-02-29", False),
        ("date", "2023-02-29", False),
        ("date", "2023-04-31", False),
        ("date", "2023-12-32", False),
        ("date", "0000-01-01", False),
        ("time", "23:59:59.125-08:00", True),
        ("time", "00:00:00Z", True),
        ("time", "23:59:60Z", False),
        ("time", "24:00:00Z", False),
        ("time", "10:15:59", False),
        ("date-time", "2023-12-31T23:59:59+14:00", True),
        ("date-time", "2023-12-31T10:15:60Z", False),
        ("date-time", "2023-12-31 10:15:00Z", False),
    ],
)
def test_the_edges_of_each_format(
    grammars: GrammarEngine, tokenizer: ModelTokenizer, form: str, text: str, accepted: bool
) -> None:
    assert _accepts(grammars, tokenizer, form, text) is accepted


def test_the_rewrite_reaches_nested_schemas_and_leaves_data_alone() -> None:
    schema = {
        "type": "object",
        "properties": {
            "format": {"type": "string", "format": "date"},
            "when": {"anyOf": [{"type": "string", "format": "date-time"}, {"type": "null"}]},
            "own": {"type": "string", "format": "date", "pattern": "^2[0-9]{3}"},
            "fixed": {"const": {"format": "date"}},
        },
        "$defs": {"t": {"type": "string", "format": "time"}},
    }
    rewritten = exact_date_formats(schema)
    properties = rewritten["properties"]
    assert properties["format"] == {"type": "string", "pattern": PATTERNS["date"]}
    assert properties["when"]["anyOf"][0] == {"type": "string", "pattern": PATTERNS["date-time"]}
    assert properties["own"] == schema["properties"]["own"]  # type: ignore[index]
    assert properties["fixed"] == {"const": {"format": "date"}}
    assert rewritten["$defs"]["t"]["pattern"] == PATTERNS["time"]
    assert schema["properties"]["format"]["format"] == "date"  # type: ignore[index]
    assert PATTERNS["date"] in lark_json(schema).replace("\\\\", "\\")
