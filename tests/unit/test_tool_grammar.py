"""The grammar of tool calls agrees with the tool-call parsers: whatever a
walk through its masks writes, the parser reads calls whose arguments
validate against their schemas (hermes and qwen3_coder), and free text
never opens a call the grammar does not hold."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluiceway.engines.grammar import GrammarEngine, allowed_ids, lark_json
from sluiceway.engines.tokenizer import ModelTokenizer
from sluiceway.parsers.formats import FORMATS, arguments
from sluiceway.parsers.formats.render import Call
from sluiceway.parsers.registry import TextPathOptions, ToolSchema, build_pipeline
from sluiceway.protocol.constraints import Constraint, ConstraintKind
from sluiceway.surfaces.tool_grammar import CallableTool, CallPlan, call_grammar
from tests.fixtures.json_schemas import assert_valid, object_schemas
from tests.parsers.family_calls import SCHEMAS, calls, written

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = (CallableTool(name="get_weather", parameters=WEATHER), CallableTool(name="get_time"))

HERMES_CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "unit": "c"}}'
    "\n</tool_call>"
)
HERMES_FREE = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
CODER_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=unit>\nc\n</parameter>\n</function>\n"
    "</tool_call>"
)
CODER_FREE = (
    "<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n</function>\n</tool_call>"
)

# Keep the default model's tokenizer out of a function-scoped fixture: the
# property tests below use it.
_STATE: dict[str, Any] = {}


@pytest.fixture(scope="module", autouse=True)
def _engine(default_model: Path) -> None:
    tokenizer = ModelTokenizer(default_model, 1920)
    _STATE["tokenizer"] = tokenizer
    _STATE["engine"] = GrammarEngine(tokenizer.hf, 1920, tokenizer.eos_ids)


def tokenizer() -> ModelTokenizer:
    value: ModelTokenizer = _STATE["tokenizer"]
    return value


def engine() -> GrammarEngine:
    value: GrammarEngine = _STATE["engine"]
    return value


def grammar(dialect: str, plan: CallPlan) -> Constraint:
    def markup(text: str) -> str:
        return engine().markup(text, tokenizer().single_token(text))

    return Constraint(kind=ConstraintKind.GRAMMAR, text=call_grammar(dialect, plan, markup))


def accepts(constraint: Constraint, text: str) -> bool:
    matcher = engine().compile(constraint).matcher()
    ids = tokenizer().encode(text)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def parse(dialect: str, tokens: list[int], tools: tuple[CallableTool, ...]) -> tuple[str, list]:
    """The content and the ``(name, arguments)`` calls the parser reads."""
    options = TextPathOptions(
        tool_parser=dialect,
        tools=tuple(ToolSchema(name=t.name, parameters=dict(t.parameters or {})) for t in tools),
    )
    pipeline = build_pipeline(tokenizer().table, options)
    chunks = []
    for token in tokens:
        chunks += pipeline.feed(token, visible=True)
    chunks += pipeline.finish().chunks
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for fragment in chunk.tool_calls:
            entry = calls.setdefault(fragment.index, ["", ""])
            entry[0] += fragment.name or ""
            entry[1] += fragment.arguments
    content = "".join(chunk.content for chunk in chunks)
    return content, [(name, json.loads(arguments)) for name, arguments in calls.values()]


@pytest.mark.parametrize(
    ("dialect", "call", "free_call"),
    [("hermes", HERMES_CALL, HERMES_FREE), ("qwen3_coder", CODER_CALL, CODER_FREE)],
)
def test_what_each_tool_choice_lets_through(dialect: str, call: str, free_call: str) -> None:
    auto = grammar(dialect, CallPlan(tools=TOOLS, required=False, parallel=True))
    single = grammar(dialect, CallPlan(tools=TOOLS, required=False, parallel=False))
    required = grammar(dialect, CallPlan(tools=TOOLS, required=True, parallel=False))
    content = lark_json({"type": "object", "required": ["a"]})
    either = grammar(dialect, CallPlan(tools=TOOLS, required=False, parallel=True, content=content))
    bad = call.replace("Paris", "Paris, in France").replace('"c"', '"k"')
    cases = {
        "": (True, True, False, False),
        "No call needed.": (True, True, False, False),
        call: (True, True, True, True),
        f"Checking. {call}\n{free_call} Done.": (True, False, False, False),
        f"{call}\n{free_call}": (True, False, False, True),
        bad: (False, False, False, False),
        '{"a": 1}': (True, True, False, True),
        # The opening tag written as text would open a call in the parser.
        "x <tool_call> y": (False, False, False, False),
    }
    for text, expected in cases.items():
        seen = tuple(accepts(g, text) for g in (auto, single, required, either))
        assert seen == expected, (text, seen)


def test_a_strict_enum_held_in_a_reference_is_held_in_the_xml_form() -> None:
    schema = {
        "type": "object",
        "properties": {"unit": {"$ref": "#/$defs/Unit"}, "at": {"$ref": "#/$defs/At"}},
        "required": ["unit", "at"],
        "$defs": {
            "Unit": {"enum": ["c", "f"], "type": "string"},
            "At": {"type": "integer", "minimum": 0, "maximum": 9},
        },
    }
    plan = CallPlan(
        tools=(CallableTool(name="t", parameters=schema),), required=True, parallel=False
    )
    constraint = grammar("qwen3_coder", plan)
    call = "<tool_call>\n<function=t>\n<parameter=unit>\n{}\n</parameter>\n"
    call += "<parameter=at>\n{}\n</parameter>\n</function>\n</tool_call>"
    assert accepts(constraint, call.format("f", "7"))
    assert not accepts(constraint, call.format("k", "7"))
    assert not accepts(constraint, call.format("c", "10"))


def walk(constraint: Constraint, data: st.DataObject, limit: int = 600) -> list[int]:
    """Tokens from a random walk through the grammar's masks, to its end."""
    grammars = engine()
    matcher = grammars.compile(constraint).matcher()
    masks = grammars.new_masks(1)
    tokens: list[int] = []
    while not matcher.is_stopped():
        assert len(tokens) < limit, "the walk did not end"
        grammars.fill_masks([matcher], masks)
        allowed = np.flatnonzero(allowed_ids(masks[0], grammars.vocab_size))
        allowed = allowed[~np.isin(allowed, grammars.eos_ids)]
        if not len(allowed):
            break  # only EOS: the grammar accepts here
        token = int(allowed[data.draw(st.integers(0, len(allowed) - 1))])
        assert matcher.consume_token(token)
        tokens.append(token)
    assert matcher.is_accepting()
    return tokens


#: What raw text can hold of a string parameter's schema.
_RAW_HOLDS = frozenset({"type", "minLength", "maxLength", "enum", "const"})


def _raw_text_free(schema: dict[str, Any]) -> bool:
    """Every parameter the XML form writes as raw text says no more than
    raw text can hold: its length and its values. A pattern, a format, or
    the branches of an ``anyOf`` that counts as a string are not held (the
    text is unbounded there: a walk found one that never ended)."""
    tool = ToolSchema(name="f", parameters=schema)
    for key, prop in schema["properties"].items():
        if not arguments.is_string_parameter(tool, key):
            continue
        target = arguments.resolved(prop, schema)
        if not isinstance(target, dict) or not set(target) <= _RAW_HOLDS:
            return False
    return True


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dialect=st.sampled_from(["hermes", "qwen3_coder"]),
    schema=object_schemas,
    data=st.data(),
)
def test_every_walk_through_a_required_call_parses_to_valid_arguments(
    dialect: str, schema: dict[str, Any], data: st.DataObject
) -> None:
    if dialect == "qwen3_coder" and not _raw_text_free(schema):
        # ``required`` must go too: it may name a property this replaces
        schema = {
            **schema,
            "properties": {"plain": {"type": "string", "maxLength": 3}},
            "required": ["plain"],
        }
    tools = (CallableTool(name="f", parameters=schema), CallableTool(name="g", parameters=WEATHER))
    constraint = grammar(dialect, CallPlan(tools=tools, required=True, parallel=False))
    content, calls = parse(dialect, walk(constraint, data), tools)
    assert content == ""
    ((name, arguments),) = calls
    assert_valid(arguments, schema if name == "f" else WEATHER)


BOUNDED_CLOCK = {
    "type": "object",
    "properties": {"tz": {"type": "string", "maxLength": 5}, "at": {"type": "boolean"}},
    "additionalProperties": False,
}
FAMILY_TOOLS = tuple(CallableTool(name=name, parameters=schema) for name, schema in SCHEMAS.items())


@pytest.mark.parametrize("family", sorted(FORMATS))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(drawn=calls(), data=st.data())
def test_the_grammar_accepts_every_call_the_parser_reads(
    family: str, drawn: list[Call], data: st.DataObject
) -> None:
    """Parser and grammar come from one description: whatever whitespace and
    options the family allows, the grammar of a required call accepts the
    calls the parser reads back exactly (tests/parsers/test_formats.py)."""
    text = written(family, drawn, data)
    plan = CallPlan(tools=FAMILY_TOOLS, required=True, parallel=True)
    assert accepts(grammar(family, plan), text), text
    single = CallPlan(tools=FAMILY_TOOLS, required=True, parallel=False)
    assert accepts(grammar(family, single), written(family, drawn[:1], data))


@pytest.mark.parametrize("family", sorted(FORMATS))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_walk_through_a_family_grammar_parses_to_valid_arguments(
    family: str, data: st.DataObject
) -> None:
    # Bounded values and one call, so that every walk ends.
    tools = (
        CallableTool(name="get_weather", parameters=WEATHER),
        CallableTool(name="get_time", parameters=BOUNDED_CLOCK),
    )
    constraint = grammar(family, CallPlan(tools=tools, required=True, parallel=False))
    content, calls_read = parse(family, walk(constraint, data), tools)
    assert content == ""
    assert calls_read
    for name, read in calls_read:
        assert_valid(read, WEATHER if name == "get_weather" else BOUNDED_CLOCK)
