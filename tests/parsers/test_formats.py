"""Every family's parser reads back exactly the calls written in its markup,
whatever the optional whitespace and options, under any tokenization, with
the alignment contract kept; and what is special to some families."""

from __future__ import annotations

import ast
import json
from types import MappingProxyType

import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from sluiceway.parsers.events import Channel, Event, Span, ToolCallOpened
from sluiceway.parsers.formats import FORMATS, FormatParser, parser
from sluiceway.parsers.formats import arguments as reading
from sluiceway.parsers.formats.graph import Graph
from sluiceway.parsers.formats.render import Call, Style, forced_prefix, python_literal, render
from sluiceway.parsers.formats.spec import (
    Choice,
    Index,
    JsonArguments,
    Key,
    Lit,
    Name,
    Opt,
    Part,
    PythonArguments,
    PythonValue,
    Repeat,
    Seq,
    ToolFormat,
    Value,
    choice,
    kinds,
    seq,
)
from sluiceway.parsers.reasoning import DIALECTS
from sluiceway.parsers.registry import TextPathOptions, ToolSchema, build_stages

from .family_calls import REASONING, SCHEMAS, calls, expected_arguments, written
from .harness import (
    Routed,
    StageRun,
    assert_contract,
    emitted_spans,
    examples,
    route,
    run_chain,
    run_pipeline,
    run_whole,
    token_spans,
    tokenizations,
    tokenize,
)

TOOLS = tuple(ToolSchema(name=name, parameters=schema) for name, schema in SCHEMAS.items())


def _options(family: str, *, parallel: bool = True) -> TextPathOptions:
    return TextPathOptions(
        reasoning_parser=REASONING[family],
        tool_parser=family,
        tools=TOOLS,
        parallel_tool_calls=parallel,
    )


def _thinking(family: str) -> str:
    dialect = REASONING[family]
    if dialect is None:
        return ""
    tags = DIALECTS[dialect]
    return f"{tags.open_tag}Let me think.{tags.close_tag}\n\n"


@pytest.mark.parametrize("family", sorted(FORMATS))
@settings(max_examples=examples(60), deadline=None)
@given(drawn=calls(), data=st.data())
def test_written_calls_are_read_back_exactly(
    family: str, drawn: list[Call], data: st.DataObject
) -> None:
    fmt = FORMATS[family]
    lead = "" if fmt.at_start else data.draw(st.sampled_from(["", "Checking. ", "a <b "]))
    markup = written(family, drawn, data)
    text = _thinking(family) + lead + markup
    expected = Routed(
        reasoning="Let me think." if REASONING[family] else "",
        content=lead,
        calls={i: [call.name, expected_arguments(call)] for i, call in enumerate(drawn)},
    )
    note(repr(text))
    tokenized = data.draw(tokenizations(text, eos=False))
    stages, stop = build_stages(_options(family))
    run = run_pipeline(tokenized, stages, stop)
    note(repr((drawn, route(e for s in run.events for e in s).call_list)))
    assert_contract(run, expected)
    whole_stages, _ = build_stages(_options(family))
    whole = route(run_whole(whole_stages, text).events)
    assert (whole.content, whole.call_list) == (lead, expected.call_list)
    for call, (_, arguments) in zip(drawn, whole.call_list, strict=True):
        assert json.loads(arguments) == call.arguments
    if fmt.call_id is not None:
        opened = [e for step in run.events for e in step if isinstance(e, ToolCallOpened)]
        assert [e.call_id for e in opened] == [
            f"functions.{call.name}:{i}" for i, call in enumerate(drawn)
        ]


@pytest.mark.parametrize("family", sorted(FORMATS))
@settings(max_examples=examples(20), deadline=None)
@given(drawn=calls(), data=st.data())
def test_one_call_at_most_without_parallel_calls(
    family: str, drawn: list[Call], data: st.DataObject
) -> None:
    text = written(family, drawn, data)
    stages, _ = build_stages(_options(family, parallel=False))
    routed = route(run_whole(stages, text).events)
    assert routed.call_list == [(drawn[0].name, expected_arguments(drawn[0]))]
    assert routed.content == ""


@pytest.mark.parametrize(
    "family", [f for f in sorted(FORMATS) if REASONING[f] not in (None, "qwen3")]
)
def test_a_call_opened_inside_reasoning_is_not_lost(family: str) -> None:
    call = Call("get_weather", {"city": "Paris"})
    markup = written_canonical(family, [call])
    dialect = DIALECTS[REASONING[family] or ""]
    text = f"{dialect.open_tag}I should look it up.\n{markup}"
    stages, _ = build_stages(_options(family))
    routed = route(run_whole(stages, text).events)
    assert routed.reasoning == "I should look it up.\n"
    assert routed.call_list == [("get_weather", '{"city": "Paris"}')]
    assert routed.content == ""


def written_canonical(family: str, drawn: list[Call]) -> str:
    from sluiceway.parsers.formats.render import render

    return render(FORMATS[family], drawn)


@pytest.mark.parametrize(
    ("family", "text", "arguments"),
    [
        # Qwen3-Coder writes an integer as 140.0 (mlx-lm#1627): the schema types it.
        (
            "qwen3_coder",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n140.0\n</parameter>\n</function>\n</tool_call>",
            {"city": "Paris", "days": 140},
        ),
        # A value written as its type spells it is passed on as written.
        (
            "qwen3_coder",
            "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n"
            "</function>\n</tool_call>",
            {"days": 3},
        ),
        # A value that does not fit its type stays a string; the call is kept.
        (
            "glm45",
            "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>three</arg_value>\n</tool_call>",
            {"city": "Paris", "days": "three"},
        ),
        # GLM does not double-serialise: a JSON value stays a value (vllm#36410).
        (
            "glm47",
            "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
            "<arg_key>hot</arg_key><arg_value>True</arg_value></tool_call>",
            {"city": "Paris", "hot": True},
        ),
        (
            "pythonic",
            "[get_weather(city='Paris', days=3.0, hot=False)]",
            {"city": "Paris", "days": 3, "hot": False},
        ),
    ],
)
def test_values_are_typed_by_the_schema(
    family: str, text: str, arguments: dict[str, object]
) -> None:
    stages, _ = build_stages(_options(family))
    routed = route(run_whole(stages, text).events)
    ((name, written_arguments),) = routed.call_list
    assert name == "get_weather"
    parsed = json.loads(written_arguments)
    assert parsed == arguments
    assert {k: type(v) for k, v in parsed.items()} == {k: type(v) for k, v in arguments.items()}
    # A character a token: the same call, and every token owns what it wrote.
    steps = token_spans(tokenize(text.encode(), range(len(text.encode()))))
    run = run_chain(build_stages(_options(family))[0], steps)
    assert route(run.events).call_list == routed.call_list
    assert_owned(steps, run)


def assert_owned(steps: list[list[Event]], run: StageRun) -> None:
    """Every span is text owned by a token fed (the quotes a typed value
    adds included), and every token fed owns a span (dropped or not)."""
    spans = emitted_spans(run.events)
    written = ["".join(e.text for e in step if isinstance(e, Span)) for step in steps]
    for span in spans:
        assert span.token in range(len(steps)), span
        assert isinstance(span.text, str), span
        if span.channel is Channel.DROPPED:  # removed text is text its token wrote
            assert span.markup is not None, span
            assert span.text in written[span.token], span
    assert {span.token for span in spans} >= {i for i, step in enumerate(steps) if step}


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n \n</parameter>\n",
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n14",
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n14\n</param",
    ],
)
def test_a_blank_or_cut_value_keeps_its_owners(text: str) -> None:
    """A blank value is null; a value the reply ends in goes out as written."""
    steps = token_spans(tokenize(text.encode(), range(len(text.encode()))))
    run = run_chain(build_stages(_options("qwen3_coder"))[0], steps)
    assert_owned(steps, run)
    ((name, written_arguments),) = route(run.events).call_list
    assert name == "get_weather"
    if text.endswith("</parameter>\n"):
        assert written_arguments.replace(" ", "") == '{"days":null'


@pytest.mark.parametrize(
    ("family", "text"),
    [
        ("llama3_json", 'The answer is {"name": "x"}.'),
        ("llama3_json", '{"answer": 42}'),
        ("pythonic", "[1, 2, 3]"),
        ("pythonic", "See [get_weather(city='Paris')] for how."),
        ("kimi_k2", "<|tool_calls_section_begin|> nothing"),
        ("mistral", "[TOOL_CALLS] no"),
    ],
)
def test_text_that_only_looks_like_markup_is_content(family: str, text: str) -> None:
    stages, _ = build_stages(_options(family))
    routed = route(run_whole(stages, text).events)
    assert routed.call_list == []
    assert routed.content == text


def test_a_string_typed_by_the_schema_keeps_each_characters_owner() -> None:
    """``three`` for an integer stays a string: quoted, each character still
    owned by the token that wrote it."""
    text = (
        "<tool_call>get_weather\n<arg_key>days</arg_key>\n<arg_value>three</arg_value>\n"
        "</tool_call>"
    )
    steps = token_spans(tokenize(text.encode(), range(len(text))))
    run = run_chain(build_stages(_options("glm45"))[0], steps)
    assert json.loads(route(run.events).call_list[0][1]) == {"days": "three"}
    start = text.index("three")
    shown = {s.token for s in emitted_spans(run.events) if s.channel is Channel.TOOL_CALL}
    assert set(range(start, start + len("three"))) <= shown


def test_a_parser_reads_parallel_calls_unless_told_not_to() -> None:
    """``parser(name)`` allows parallel calls by default, as the API does."""
    text = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n' * 2
    routed = route(run_whole([parser("hermes")], text).events)
    assert [name for name, _ in routed.call_list] == ["a", "a"]
    single = route(run_whole([parser("hermes", parallel_tool_calls=False)], text).events)
    assert [name for name, _ in single.call_list] == ["a"]


def _parts() -> st.SearchStrategy[Part]:
    leaves: st.SearchStrategy[Part] = st.sampled_from(
        [Lit("x"), Name(), Index(), JsonArguments(), Key(), Value("</v>"), PythonValue()]
    )
    return st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.lists(inner, min_size=1, max_size=3).map(lambda p: seq(*p)),
            st.lists(inner, min_size=1, max_size=3).map(lambda p: choice(*p)),
            inner.map(Opt),
            inner.map(Repeat),
        ),
        max_leaves=8,
    )


def _leaf_kinds(part: Part) -> set[type]:
    if isinstance(part, Seq):
        return {kind for inner in part.parts for kind in _leaf_kinds(inner)}
    if isinstance(part, Choice):
        return {kind for option in part.options for kind in _leaf_kinds(option)}
    if isinstance(part, Opt | Repeat):
        return _leaf_kinds(part.part)
    return {type(part)}


@settings(max_examples=examples(200), deadline=None)
@given(part=_parts())
def test_kinds_are_the_leaves_at_any_depth(part: Part) -> None:
    """What the renderer asks before it writes an optional or repeated part."""
    assert kinds(part) == _leaf_kinds(part)


def test_kinds_look_inside_the_compound_parts() -> None:
    assert kinds(PythonArguments()) == {Lit, Key, PythonValue}
    assert kinds(Opt(PythonArguments())) == {Lit, Key, PythonValue}


def test_pythonic_arguments_render_as_the_models_write_them() -> None:
    drawn = [Call("get_weather", {"city": "Paris", "days": 3, "hot": False})]
    assert render(FORMATS["pythonic"], drawn) == ("[get_weather(city='Paris', days=3, hot=False)]")


@pytest.mark.parametrize("family", sorted(FORMATS))
def test_a_graph_compiled_now_reads_what_the_imported_one_reads(family: str) -> None:
    """GRAPHS is compiled once, on first use; compiling the description
    again in the test reaches the spec's parts from this test itself (mutmut
    ties a function to the tests that call it)."""
    # A string parameter after the first: pythonic keys after a comma are
    # Python keys too (their values are literals, not text).
    drawn = [
        Call("get_weather", {"days": 3, "city": "Paris", "hot": False}),
        Call("get_time", {"tz": "UTC"}),
    ]
    text = render(FORMATS[family], drawn)
    fresh = FormatParser(Graph(FORMATS[family]), tools=TOOLS)
    routed = route(run_whole([fresh], text).events)
    assert routed.content == ""
    assert [(name, json.loads(arguments)) for name, arguments in routed.call_list] == [
        (call.name, call.arguments) for call in drawn
    ]


class _Spread(Style):
    """Every option the last one (optional parts present), two spaces wherever
    whitespace may go, no optional newline."""

    def space(self, pre: str) -> str:
        return "  "

    def newline(self, pre: str) -> str:
        return ""

    def pick(self, count: int) -> int:
        return count - 1


_TWO = [Call("get_weather", {"city": "Paris é", "tags": ["é"]}), Call("get_time", {})]


@pytest.mark.parametrize(
    ("family", "canonical", "spread"),
    [
        (
            "pythonic",
            "[get_weather(city='Paris é', tags=['é']), get_time()]",
            "<|python_start|>  [  get_weather(city='Paris é'  ,  tags=['é']  )  ,"
            "  get_time(  )  ]  <|python_end|>",
        ),
        (
            "mistral",
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris é", "tags": ["é"]}'
            "[TOOL_CALLS]get_time[ARGS]{}",
            '[TOOL_CALLS]  [  {  "name"  :  "get_weather"  ,  "arguments"  :'
            '  {"city": "Paris é", "tags": ["é"]}  }  ,  {  "name"  :  "get_time"  ,'
            '  "arguments"  :  {}  }  ]',
        ),
        (
            "llama3_json",
            '{"name": "get_weather", "parameters": {"city": "Paris é", "tags": ["é"]}}; '
            '{"name": "get_time", "parameters": {}}',
            '<|python_tag|>  {  "name"  :  "get_weather"  ,  "arguments"  :'
            '  {"city": "Paris é", "tags": ["é"]}  }  ;  {  "name"  :  "get_time"  ,'
            '  "arguments"  :  {}  }',
        ),
        (
            "glm47",
            "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris é</arg_value>"
            '<arg_key>tags</arg_key><arg_value>["é"]</arg_value></tool_call>\n'
            "<tool_call>get_time</tool_call>",
            "<tool_call>get_weather  <arg_key>city</arg_key>  <arg_value>Paris é</arg_value>"
            '  <arg_key>tags</arg_key>  <arg_value>["é"]</arg_value>  </tool_call>'
            "  <tool_call>get_time  </tool_call>",
        ),
        (
            "qwen3_coder",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis é\n</parameter>\n"
            '<parameter=tags>\n["é"]\n</parameter>\n</function>\n</tool_call>\n'
            "<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
            "<tool_call>  <function=get_weather>  <parameter=city>Paris é</parameter>"
            '  <parameter=tags>["é"]</parameter>  </function>  </tool_call>'
            "  <tool_call>  <function=get_time>  </function>  </tool_call>",
        ),
    ],
)
def test_a_style_reaches_every_choice_space_and_newline(
    family: str, canonical: str, spread: str
) -> None:
    """The canonical rendering is what the family's models write (the first
    option, optional literals left out, unescaped text); a style draws every
    choice, space and optional newline, and the next call's markup starts
    unspaced like the first."""
    assert render(FORMATS[family], _TWO) == canonical
    assert render(FORMATS[family], _TWO, _Spread()) == spread


@pytest.mark.parametrize("family", ["qwen3_coder", "glm45", "glm47", "minimax_m2"])
def test_a_value_with_newlines_at_its_ends_is_read_back_with_them(family: str) -> None:
    """One newline at either end of a tagged value is markup: a value that
    has its own there gets the markup newline whatever the style."""
    drawn = [Call("get_weather", {"city": "\nParis\n"})]
    for style in (Style(), _Spread()):
        text = render(FORMATS[family], drawn, style)
        routed = route(run_whole(build_stages(_options(family))[0], text).events)
        assert [json.loads(arguments) for _, arguments in routed.call_list] == [
            {"city": "\nParis\n"}
        ]


def test_a_forced_call_stops_before_the_name_or_the_arguments() -> None:
    assert forced_prefix(FORMATS["pythonic"], None) == "["
    assert forced_prefix(FORMATS["pythonic"], "get_weather") == "[get_weather("
    assert forced_prefix(FORMATS["glm45"], "get_weather") == "<tool_call>get_weather\n"
    with pytest.raises(ValueError, match=r"^broken: a call has no name"):
        forced_prefix(ToolFormat(name="broken", body=Lit("x")), None)


_JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=10,
)


@settings(max_examples=examples(200), deadline=None)
@given(value=_JSON_VALUES)
def test_python_literal_is_python_source_of_the_value(value: object) -> None:
    assert ast.literal_eval(python_literal(value)) == value


def test_python_literal_spells_any_mapping_and_no_other_container() -> None:
    assert python_literal(MappingProxyType({"a": [1, None, True]})) == "{'a': [1, None, True]}"
    with pytest.raises(TypeError, match=r"^not a JSON value: \(1,\)$"):
        python_literal((1,))


# --- formats.arguments, function by function (its mutants' survivors) ---


def _integer(text: str) -> str:
    return reading.typed_json(text, {"type": "integer"})


def test_an_integer_written_as_a_float_or_exponent_becomes_an_integer() -> None:
    assert _integer("140.0") == "140"
    assert _integer("1E2") == "100"
    assert _integer("1e2") == "100"
    assert _integer(" 140.0 ") == "140"
    assert _integer(" 140 ") == " 140 "  # already an integer: the text as written
    assert _integer("1.0e-5") == "1.0e-5"  # not an integer: kept
    assert _integer("1e400") == "1e400"  # not finite: kept
    assert reading.typed_json("140.0", {"type": "number"}) == "140.0"
    assert reading.typed_json("140.0", None) == "140.0"
    assert reading.python_json("140.0", {"type": "integer"}) == "140"


def test_text_that_is_no_value_is_kept_as_a_string_without_escaping_letters() -> None:
    assert reading.typed_json("é x", None) == '"é x"'
    assert reading.python_json(" é x ", None) == '"é x"'
    assert reading.python_json("1e999", None) == '"1e999"'  # inf is no JSON
    assert reading.python_json("{'a': (1, None)}", None) == '{"a": [1, null]}'


def test_a_json_extent_ends_where_its_value_does() -> None:
    assert reading.JsonExtent().advance('"ab"', 0) == (4, True)
    assert reading.JsonExtent().advance("x: 12, y", 3) == (5, True)
    assert reading.JsonExtent().advance("XYZ,", 0) == (3, True)
    with pytest.raises(ValueError, match="cannot start a JSON value"):
        reading.JsonExtent().advance("}", 0)


@pytest.mark.parametrize(
    ("text", "end"),
    [
        ("'a\\'b', c", 6),
        ("'a,b', c", 5),
        ("(1, 2), 3", 6),
        ("(1), 2", 3),
        ("((1)), 2", 5),
        ("((1, 2), 3), 4", 11),
        ("[{'a': 1}])", 10),
        ("x)", 1),
        ("0X1F, 2", 4),  # an X is neither a quote nor a bracket
    ],
)
def test_a_python_extent_ends_before_a_comma_or_bracket_outside_others(text: str, end: int) -> None:
    assert reading.PythonExtent().advance(text, 0) == (end, True)


def _nested_any_of(wrappers: int) -> dict[str, object]:
    schema: dict[str, object] = {"type": "integer"}
    for _ in range(wrappers):
        schema = {"anyOf": [schema]}
    return schema


def _is_string(schema: object, **root: object) -> bool:
    tool = reading.ToolSchema(name="f", parameters={"properties": {"a": schema}, **root})
    return reading.is_string_parameter(tool, "a")


def test_a_schema_is_read_as_text_only_when_it_takes_strings_alone() -> None:
    assert _is_string(_nested_any_of(8)) is False  # followed to the limit
    assert _is_string(_nested_any_of(9)) is True  # past it: read as text
    assert _is_string({"type": ["integer", "null"]}) is False
    assert _is_string({"type": []}) is True
    assert _is_string({"oneOf": [{"type": "integer"}]}) is False
    assert _is_string({"enum": "x", "anyOf": [{"type": "integer"}]}) is False
    assert (
        _is_string({"anyOf": [{"$ref": "#/$defs/N"}]}, **{"$defs": {"N": {"type": "integer"}}})
        is False
    )
    assert _is_string({"$ref": "#/a/b"}, a=5) is True
    tool = reading.ToolSchema(name="f", parameters={"properties": []})
    assert reading.is_string_parameter(tool, "a") is True


def test_a_parameter_schema_is_its_reference_resolved() -> None:
    tool = reading.ToolSchema(
        name="f",
        parameters={
            "properties": {"n": {"$ref": "#/$defs/N"}},
            "$defs": {"N": {"type": "integer"}},
        },
    )
    assert reading.parameter_schema(tool, "n") == {"type": "integer"}
