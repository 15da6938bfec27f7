"""The Qwen3-Coder tool-call parser: synthesised arguments JSON, any tokenization."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sluiceway.parsers.events import PROMPT_OWNER, Channel, Span, ToolCallOpened, content
from sluiceway.parsers.formats import FormatParser, ToolSchema, parser
from sluiceway.parsers.formats.arguments import is_string_parameter
from sluiceway.parsers.formats.families import QWEN3_CODER
from sluiceway.parsers.formats.render import forced_prefix as render_prefix

from .harness import (
    CODE,
    MULTIBYTE,
    PLAIN,
    TOOL_NEAR_MISSES,
    WS,
    Tokenized,
    examples,
    regroup,
    route,
    run_chain,
    run_whole,
    text_atoms,
    token_spans,
    tokenizations,
    tokenize,
)


def qwen3_coder(
    *, tools: tuple[ToolSchema, ...] = (), parallel_tool_calls: bool = True
) -> FormatParser:
    return parser("qwen3_coder", tools=tools, parallel_tool_calls=parallel_tool_calls)


def forced_prefix(name: str | None) -> str:
    return render_prefix(QWEN3_CODER, name)


WEATHER = ToolSchema(
    name="get_weather",
    parameters={
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "units": {"type": ["string", "null"]},
            "options": {"type": "object"},
            "flag": {"type": "boolean"},
            "note": {"description": "no type: a string"},
        },
    },
)
TOOLS = (WEATHER,)
ATOMS = text_atoms(
    PLAIN,
    MULTIBYTE,
    CODE,
    TOOL_NEAR_MISSES,
    ["<tool_call>\n<function=a b", "<tool_call>\n<func!", "<tool_call>\n<function=>"],
)
STRING_VALUES = st.text(alphabet=st.sampled_from(list('ab \n"\\<>/é漢🙂{}')), max_size=12).filter(
    lambda v: "</parameter>" not in v
)
TYPED_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "city": STRING_VALUES,
    "units": STRING_VALUES,
    "note": STRING_VALUES,
    "days": st.integers(-5, 500),
    "flag": st.booleans(),
    "options": st.dictionaries(st.sampled_from(["a", "b"]), st.integers(0, 9), max_size=2),
}


@st.composite
def coder_call(draw: st.DrawFn) -> tuple[str, str, dict[str, Any]]:
    """(text, name, arguments) of a well-formed call; values typed by WEATHER's schema."""
    named = draw(st.booleans())
    name = "get_weather" if named else draw(st.sampled_from(["f", "other_tool"]))
    keys = draw(st.lists(st.sampled_from(sorted(TYPED_VALUES)), unique=True, max_size=4))
    nl = draw(st.sampled_from(["\n", ""]))
    parts = [f"<tool_call>{nl}<function={name}>{nl}"]
    arguments: dict[str, Any] = {}
    for key in keys:
        value = draw(TYPED_VALUES[key] if named else STRING_VALUES)
        string = isinstance(value, str)
        raw = value if string else json.dumps(value)
        compact = draw(st.booleans()) and not (
            string and (raw.startswith("\n") or raw.endswith("\n"))
        )
        body = raw if compact else f"\n{raw}\n"
        parts.append(f"<parameter={key}>{body}</parameter>{nl}")
        arguments[key] = value
    parts.append(f"</function>{nl}</tool_call>{draw(st.sampled_from(['', chr(10), '  ']))}")
    return "".join(parts), name, arguments


@st.composite
def documents(draw: st.DrawFn) -> tuple[str, str, list[tuple[str, dict[str, Any]]]]:
    """(text, expected content, calls)."""
    text: list[str] = []
    expected: list[str] = []
    calls: list[tuple[str, dict[str, Any]]] = []
    after_call = False
    for _ in range(draw(st.integers(0, 7))):
        if draw(st.integers(0, 2)) == 0:
            call, name, arguments = draw(coder_call())
            text.append(call)
            calls.append((name, arguments))
            after_call = True
        else:
            atom = draw(ATOMS)
            text.append(atom)
            if after_call:  # whitespace after </tool_call> is markup
                atom = atom.lstrip(WS)
                after_call = not atom
            expected.append(atom)
    return "".join(text), "".join(expected), calls


Case = tuple[str, str, list[tuple[str, dict[str, Any]]], bool, Tokenized, set[int]]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    text, expected, calls = draw(documents())
    tokenized = draw(tokenizations(text, eos=False))
    groups = draw(st.sets(st.integers(1, max(1, len(tokenized.ids) - 1)), max_size=5))
    return text, expected, calls, draw(st.booleans()), tokenized, groups


def _pairs(arguments: str) -> list[tuple[str, Any]]:
    """The top-level members in order (the synthesised JSON keeps the model's order)."""
    loaded: dict[str, Any] = json.loads(arguments)
    return list(loaded.items())


@settings(max_examples=examples(300), deadline=None)
@given(case=cases())
@example(
    case=(
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        "",
        [("get_weather", {"days": 3})],
        True,
        tokenize(
            b"<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
            range(1, 100),
        ),
        set(),
    )
)
def test_matches_generated_calls_under_any_tokenization(case: Case) -> None:
    text, expected_content, calls, parallel, tokenized, groups = case
    steps = token_spans(tokenized)
    run = run_chain(
        [qwen3_coder(tools=TOOLS, parallel_tool_calls=parallel)], regroup(steps, groups)
    )
    routed = route(run.events)
    assert routed.content == expected_content
    wanted = calls if parallel else calls[:1]
    assert [name for name, _ in routed.call_list] == [name for name, _ in wanted]
    for (_, got), (_, arguments) in zip(routed.call_list, wanted, strict=True):
        assert _pairs(got) == list(arguments.items())
    whole = route(run_whole([qwen3_coder(tools=TOOLS, parallel_tool_calls=parallel)], text).events)
    assert (whole.content, whole.call_list) == (routed.content, routed.call_list)
    assert all(
        e.markup is Channel.TOOL_CALL
        for e in run.events
        if isinstance(e, Span) and e.channel is Channel.DROPPED
    )


@settings(max_examples=examples(200), deadline=None)
@given(case=cases(), data=st.data())
def test_truncated_replies_stream_like_whole(case: Case, data: st.DataObject) -> None:
    text = case[0]
    prefix = text[: data.draw(st.integers(0, len(text)))]
    steps = token_spans(data.draw(tokenizations(prefix, eos=False)))
    streamed = route(run_chain([qwen3_coder(tools=TOOLS)], steps).events)
    whole = route(run_whole([qwen3_coder(tools=TOOLS)], prefix).events)
    assert (streamed.content, streamed.call_list) == (whole.content, whole.call_list)
    # Content only ever loses envelope text of calls that were committed.
    if not streamed.calls:
        assert streamed.content == prefix


def test_arguments_stream_as_they_are_generated() -> None:
    parser = qwen3_coder(tools=TOOLS)
    assert parser.feed([content(0, "<tool_call>\n<function=get_wea")]) == []
    assert parser.held_from == 0
    events = parser.feed([content(1, "ther>\n<parameter=city>\nPar")])
    assert [e.name for e in events if isinstance(e, ToolCallOpened)] == ["get_weather"]
    assert route(events).calls[0][1] == '{"city": "Par'
    events += parser.feed([content(2, 'is "x"\n</parameter>\n<parameter=days>\n1')])
    # A typed value is held until it closes, so that it can be made valid JSON.
    assert route(events).calls[0][1] == '{"city": "Paris \\"x\\"", "days": '
    assert parser.held_from == 2
    events += parser.feed([content(3, "2\n</parameter>\n</function>\n</tool_call>")])
    events += parser.finish()
    assert json.loads(route(events).calls[0][1]) == {"city": 'Paris "x"', "days": 12}


def test_ownership_of_synthetic_punctuation() -> None:
    parser = qwen3_coder(tools=TOOLS)
    steps = [
        "<tool_call>\n<function=f>\n<parameter=",
        "ci",
        "ty>",
        "\nA",
        "\n</parameter>",
        "\n</function>",
    ]
    spans = [
        (e.token, e.text)
        for i, text in enumerate(steps)
        for e in parser.feed([content(i, text)])
        if isinstance(e, Span) and e.channel is Channel.TOOL_CALL
    ]
    assert spans == [(1, '{"'), (1, "ci"), (2, "ty"), (2, '": "'), (3, "A"), (4, '"'), (5, "}")]


def test_empty_parameters_and_raw_values() -> None:
    text = (
        "<tool_call><function=get_weather></function></tool_call>"
        "<tool_call><function=get_weather><parameter=days></parameter>"
        "<parameter=note>\n\n</parameter></function></tool_call>"
    )
    routed = route(run_whole([qwen3_coder(tools=TOOLS)], text).events)
    assert routed.call_list == [
        ("get_weather", "{}"),
        ("get_weather", '{"days": null, "note": ""}'),
    ]


@pytest.mark.parametrize(
    ("key", "written", "expected"),
    [
        ("days", "12", 12),
        ("days", " 7 ", 7),
        ("days", "three", "three"),
        ("days", "NaN", "NaN"),
        ("days", "1e400x", "1e400x"),
        ("days", "\n \n", None),
        ("flag", "True", True),
        ("flag", "false", False),
        ("flag", "None", None),
        ("options", '{"a": 1', '{"a": 1'),
        ("options", '{"a": [1, 2]}', {"a": [1, 2]}),
        ("options", "{'a': 1}", "{'a': 1}"),
    ],
)
def test_typed_values_always_give_valid_json(key: str, written: str, expected: Any) -> None:
    text = f"<tool_call><function=get_weather><parameter={key}>{written}</parameter></function></tool_call>"
    routed = route(run_whole([qwen3_coder(tools=TOOLS)], text).events)
    ((_, arguments),) = routed.call_list
    assert json.loads(arguments, parse_constant=_no_constants) == {key: expected}


def _no_constants(name: str) -> Any:
    raise AssertionError(f"{name} is not JSON")


@settings(max_examples=examples(200), deadline=None)
@given(
    key=st.sampled_from(["days", "flag", "options"]),
    written=st.text(
        alphabet=st.sampled_from(list("0123456789.-+eE truefalsnNoI{}[]\"':,\n"))
    ).filter(lambda v: "</parameter>" not in v),
    data=st.data(),
)
def test_any_typed_value_under_any_tokenization_is_valid_json(
    key: str, written: str, data: st.DataObject
) -> None:
    text = f"<tool_call>\n<function=get_weather>\n<parameter={key}>\n{written}\n</parameter>\n</function>\n</tool_call>"
    steps = token_spans(data.draw(tokenizations(text, eos=False)))
    streamed = route(run_chain([qwen3_coder(tools=TOOLS)], steps).events)
    whole = route(run_whole([qwen3_coder(tools=TOOLS)], text).events)
    assert streamed.call_list == whole.call_list
    ((_, arguments),) = streamed.call_list
    value = json.loads(arguments, parse_constant=_no_constants)[key]
    stripped = written.strip()
    if stripped and written.strip() not in ("True", "False", "None"):
        try:
            expected = json.loads(written, parse_constant=_no_constants)
        except (ValueError, AssertionError):
            expected = written  # not JSON: kept as a string of the text
        assert value == expected


def test_broken_envelope_after_commit_closes_the_json() -> None:
    text = "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\noops"
    routed = route(run_whole([qwen3_coder()], text).events)
    assert routed.call_list == [("f", '{"a": "1"}')]
    assert routed.content == "oops"


def test_reply_ending_before_the_name_is_complete_is_content() -> None:
    text = "<tool_call>\n<function=get_wea"
    routed = route(run_whole([qwen3_coder()], text).events)
    assert routed.content == text


def test_prime_named_and_required() -> None:
    parser = qwen3_coder(tools=TOOLS)
    parser.prime(forced_prefix("get_weather"))
    out = parser.feed([content(0, "<parameter=days>\n2\n</parameter>\n</function>")])
    assert isinstance(out[0], ToolCallOpened)
    assert out[0].name_spans[0].token == PROMPT_OWNER
    assert route(out).call_list == [("get_weather", '{"days": 2}')]
    parser = qwen3_coder()
    parser.prime(forced_prefix(None))
    out = parser.feed([content(0, "g>\n</function>")])
    assert route(out).call_list == [("g", "{}")]
    assert forced_prefix("x") == "<tool_call>\n<function=x>\n"


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("city", True),
        ("days", False),
        ("units", True),
        ("options", False),
        ("note", True),
        ("zzz", True),
    ],
)
def test_parameter_types(key: str, expected: bool) -> None:
    assert is_string_parameter(WEATHER, key) is expected
    assert is_string_parameter(None, key) is True


TYPED = ToolSchema(
    name="typed",
    parameters={
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green"]},
            "level": {"enum": [1, 2, "max"]},
            "pinned": {"const": 3},
            "label": {"const": "x"},
            "maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            "either": {"oneOf": [{"type": "string"}, {"enum": ["a"]}]},
            "mixed": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
            "unit": {"$ref": "#/$defs/Unit"},
            "place": {"$ref": "#/$defs/Place"},
            "loop": {"$ref": "#/$defs/Loop"},
            "dangling": {"$ref": "#/$defs/Missing"},
        },
        "$defs": {
            "Unit": {"enum": ["c", "f"], "type": "string"},
            "Place": {"type": "object", "properties": {"x": {"type": "number"}}},
            "Loop": {"$ref": "#/$defs/Loop"},
        },
    },
)


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("colour", True),
        ("level", False),
        ("pinned", False),
        ("label", True),
        ("maybe", False),
        ("either", True),
        # A string is one of its values, but so is a number: read as JSON,
        # where text that is not JSON still becomes a string.
        ("mixed", False),
        ("unit", True),
        ("place", False),
        ("loop", True),
        ("dangling", True),
    ],
)
def test_parameter_types_follow_values_alternatives_and_references(
    key: str, expected: bool
) -> None:
    assert is_string_parameter(TYPED, key) is expected
