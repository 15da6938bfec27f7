"""The families as the formats package builds them on first use, and the
graphs compiled from them: each family's canonical rendering (what its
models write) read back by its parser, the markers its tokenizers hold as
one token, and what the compiled graph offers at each place."""

from __future__ import annotations

import json

import pytest

from sluiceway.parsers import formats
from sluiceway.parsers.events import Event, content
from sluiceway.parsers.formats import FORMATS, GRAPHS, parser
from sluiceway.parsers.formats.arguments import ToolSchema
from sluiceway.parsers.formats.families import OnFirstUse
from sluiceway.parsers.formats.graph import Graph, State
from sluiceway.parsers.formats.render import Call, render
from sluiceway.parsers.formats.spec import (
    Index,
    Lit,
    Name,
    Opt,
    Part,
    Repeat,
    ToolFormat,
    Value,
    choice,
    seq,
)

from .harness import Routed, route
from .test_formats import _Spread

_TWO = [Call("get_weather", {"city": "Paris é", "tags": ["é"]}), Call("get_time", {})]

_TOOLS = (
    ToolSchema(
        name="get_weather",
        parameters={
            "type": "object",
            "properties": {"city": {"type": "string"}, "tags": {"type": "array"}},
        },
    ),
    ToolSchema(name="get_time", parameters={"type": "object", "properties": {}}),
)


def _read(family: str, text: str, *, parallel: bool = True) -> Routed:
    """What ``family``'s parser makes of ``text``, fed a character a token."""
    reading = parser(family, tools=_TOOLS, parallel_tool_calls=parallel)
    events: list[Event] = []
    for index, char in enumerate(text):
        events += reading.feed([content(index, char)])
    return route([*events, *reading.finish()])


def _calls(family: str, text: str, *, parallel: bool = True) -> list[tuple[str, object]]:
    return [
        (name, json.loads(arguments))
        for name, arguments in _read(family, text, parallel=parallel).call_list
    ]


# test_formats.py pins pythonic, mistral, llama3_json, glm47 and qwen3_coder.
@pytest.mark.parametrize(
    ("family", "canonical"),
    [
        (
            "hermes",
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris é", "tags": ["é"]}}'
            '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        ),
        (
            "glm45",
            "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris é</arg_value>\n"
            '<arg_key>tags</arg_key>\n<arg_value>["é"]</arg_value>\n</tool_call>\n'
            "<tool_call>get_time\n</tool_call>",
        ),
        (
            "kimi_k2",
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
            '<|tool_call_argument_begin|>{"city": "Paris é", "tags": ["é"]}<|tool_call_end|>'
            "<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}"
            "<|tool_call_end|><|tool_calls_section_end|>",
        ),
        (
            "minimax_m2",
            '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris é'
            '</parameter>\n<parameter name="tags">["é"]</parameter>\n</invoke>\n'
            '<invoke name="get_time">\n</invoke>\n</minimax:tool_call>',
        ),
        (
            "deepseek_v31",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
            '{"city": "Paris é", "tags": ["é"]}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time'
            "<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        ),
        (
            "deepseek_v3",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
            '{"city": "Paris é", "tags": ["é"]}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function'
            "<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        ),
    ],
)
def test_each_family_renders_what_its_models_write_and_reads_it_back(
    family: str, canonical: str
) -> None:
    assert render(FORMATS[family], _TWO) == canonical
    expected = [(call.name, call.arguments) for call in _TWO]
    for text in (canonical, render(FORMATS[family], _TWO, _Spread())):
        assert _calls(family, "Sure. " + text) == expected
        assert _calls(family, "Sure. " + text, parallel=False) == expected[:1]


@pytest.mark.parametrize(
    ("family", "section"),
    [
        ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>"),
        ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>"),
        ("kimi_k2", "<|tool_calls_section_begin|><|tool_calls_section_end|>"),
        ("minimax_m2", "<minimax:tool_call>\n</minimax:tool_call>"),
    ],
)
def test_a_section_of_calls_holds_at_least_one_so_an_empty_one_is_text(
    family: str, section: str
) -> None:
    """The closing marker right after the opening one breaks the markup: the
    text is released then, not held to see how the reply goes on."""
    reading = parser(family, tools=_TOOLS)
    text = f"Sure. {section}"
    events: list[Event] = []
    for index, char in enumerate(text):
        events += reading.feed([content(index, char)])
    routed = route(events)
    assert (routed.content, routed.call_list, routed.dropped) == (text, [], "")
    assert reading.finish() == []


_GLM = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
#: The markers each family's tokenizers hold as one token (vLLM's parsers
#: match them as such): the tokenizer must show them in the text it decodes.
_SPECIAL = {
    "hermes": ("<tool_call>", "</tool_call>"),
    "qwen3_coder": ("<tool_call>", "</tool_call>"),
    "glm45": _GLM,
    "glm47": _GLM,
    "kimi_k2": (
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
    ),
    "minimax_m2": ("<minimax:tool_call>", "</minimax:tool_call>"),
    "deepseek_v31": (
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁calls▁end｜>",
        "<｜tool▁call▁begin｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁sep｜>",
    ),
    "deepseek_v3": (
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁calls▁end｜>",
        "<｜tool▁call▁begin｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁sep｜>",
    ),
    "llama3_json": ("<|python_tag|>",),
    "pythonic": ("<|python_start|>", "<|python_end|>"),
    "mistral": ("[TOOL_CALLS]", "[ARGS]"),
}


def _markup(graph: Graph) -> set[str]:
    """The text of every literal the graph reaches from its start, and every
    closing tag a value reader ends at."""
    found: set[str] = set()
    seen: set[int] = set()
    todo: list[State] = [graph.start]
    while todo:
        state = todo.pop()
        if id(state) in seen:
            continue
        seen.add(id(state))
        options = state.options
        found |= {lit.text for lit, _ in options.literals}
        todo += [target for _, target in options.literals]
        if options.reader is not None:
            reader, target = options.reader
            if isinstance(reader, Value):
                found.add(reader.close)
            todo.append(target)
    return found


@pytest.mark.parametrize("family", sorted(_SPECIAL))
def test_a_family_names_its_single_token_markers_and_each_is_its_markup(family: str) -> None:
    assert set(_SPECIAL) == set(FORMATS)
    assert FORMATS[family].special == _SPECIAL[family]
    assert set(FORMATS[family].special) <= _markup(GRAPHS[family])


def test_on_first_use_reads_the_build_at_each_access() -> None:
    built = [{"a": 1}]
    view = OnFirstUse(lambda: built[-1])
    assert (view["a"], list(view), len(view)) == (1, ["a"], 1)
    built.append({"b": 2, "c": 3})
    assert (view["b"], list(view), len(view), "a" in view) == (2, ["b", "c"], 2, False)


def test_the_formats_and_graphs_are_built_once_and_again_after_a_clear() -> None:
    first = formats.formats()
    assert formats.formats() is first
    assert all(GRAPHS[name].format is fmt for name, fmt in first.items())
    formats.formats.cache_clear()
    formats.graphs.cache_clear()
    again = formats.formats()
    assert again is not first
    assert again == first
    assert FORMATS["hermes"] is again["hermes"]
    assert GRAPHS["hermes"] is formats.graphs()["hermes"]
    assert GRAPHS["hermes"].format is again["hermes"]


# -- the compiled graph ------------------------------------------------------


def _graph(body: Part, name: str = "toy") -> Graph:
    return Graph(ToolFormat(name=name, body=body))


def _texts(state: State) -> list[str]:
    return [lit.text for lit, _ in state.options.literals]


def _after(state: State, text: str) -> State:
    (target,) = [target for lit, target in state.options.literals if lit.text == text]
    return target


def test_a_graph_offers_at_each_place_what_may_come_next() -> None:
    """Opt, Choice and Repeat are empty edges, followed when a place's
    options are read: the parser sees literals, one reader and the end."""
    graph = _graph(
        seq(
            Lit("<a>"),
            Opt(Lit("!")),
            Name(),
            Repeat(seq(Lit(","), Index())),
            choice(Lit("</a>"), Lit("</b>")),
        )
    )
    start = graph.start
    assert (_texts(start), start.options.reader, start.options.end) == (["<a>"], None, False)
    opened = _after(start, "<a>")
    assert _texts(opened) == ["!"]
    assert opened.options.reader is not None
    assert isinstance(opened.options.reader[0], Name)
    assert not opened.options.end
    # After the optional literal the same reader comes, at the same place.
    assert _after(opened, "!").options.reader == opened.options.reader
    named = opened.options.reader[1]
    assert sorted(_texts(named)) == [",", "</a>", "</b>"]
    assert named.options.reader is None
    looped = _after(named, ",").options.reader
    assert looped is not None
    assert isinstance(looped[0], Index)
    # The loop comes back to where it started: the same state, compiled once.
    assert looped[1] is named
    assert graph.state(named.node) is named
    for closing in ("</a>", "</b>"):
        ended = _after(named, closing)
        assert ended.options.end_only
        assert (ended.options.literals, ended.options.reader) == ((), None)
    assert [lit.text for lit, _ in graph.entry] == ["<a>"]


def test_an_optional_tail_may_end_the_markup_or_go_on() -> None:
    graph = _graph(seq(Lit("["), Name(), Lit("]"), Opt(Lit("<end>"))))
    named = _after(graph.start, "[").options.reader
    assert named is not None
    after = _after(named[1], "]")
    assert (_texts(after), after.options.end, after.options.end_only) == (["<end>"], True, False)
    assert _after(after, "<end>").options.end_only


def test_two_readers_at_one_place_are_refused() -> None:
    with pytest.raises(ValueError, match=r"^twice: two readers at one place$"):
        _graph(seq(Lit("<a>"), choice(Name(), Index())), name="twice")


@pytest.mark.parametrize(
    "body",
    [seq(Name(), Lit(">")), seq(Opt(Lit("<a>")), Name()), seq(Opt(Lit("<a>")))],
)
def test_the_markup_must_open_with_a_literal(body: Part) -> None:
    with pytest.raises(ValueError, match=r"^opening: the markup must open with a literal$"):
        _ = _graph(body, name="opening").entry


@pytest.mark.parametrize(
    "body",
    [
        choice(Lit("<a"), Lit("<ab")),
        seq(Lit("<x>"), Name(), choice(Lit("</ab"), Lit("</a"))),
        seq(Lit("<x>"), Repeat(seq(Lit(";"), Name())), Lit(";;")),
        seq(Lit("<x>"), Name(), Lit(">"), Index(), Opt(Lit("</a")), Lit("</ab")),
        # Checked past a place already seen (the loop back to "b")...
        seq(Lit("<x>"), Repeat(Lit("b")), Lit("c"), choice(Lit("d"), Lit("dd"))),
        # ...and in a branch left waiting while another one is walked.
        seq(
            Lit("<x>"),
            choice(seq(Lit("b"), Lit("e")), seq(Lit("a"), choice(Lit("d"), Lit("dd")))),
        ),
    ],
)
def test_a_literal_that_starts_a_sibling_is_refused_wherever_it_is(body: Part) -> None:
    with pytest.raises(ValueError, match=r"^prefixed: '[^']+' is a prefix of a sibling$"):
        _graph(body, name="prefixed")


def test_siblings_that_share_a_start_but_are_not_prefixes_compile() -> None:
    graph = _graph(seq(Lit("<x>"), Name(), choice(Lit("</a>"), Lit("</b>"), Lit("</a>"))))
    named = _after(graph.start, "<x>").options.reader
    assert named is not None
    assert sorted(_texts(named[1])) == ["</a>", "</a>", "</b>"]


def test_a_loop_of_empty_edges_is_closed_over_once() -> None:
    """A repeated optional part loops back through empty edges alone."""
    graph = _graph(seq(Lit("<x>"), Repeat(Opt(Lit("a"))), Lit("</x>")))
    looped = _after(graph.start, "<x>")
    assert sorted(_texts(looped)) == ["</x>", "a"]
    assert _after(looped, "a") is looped
    assert _after(looped, "</x>").options.end_only
