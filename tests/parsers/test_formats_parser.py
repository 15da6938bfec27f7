"""FormatParser's paths that reading well-formed calls back does not reach:
markup that breaks before or after a call commits, a reply cut inside a
reader or a literal, prompt text from ``prime``, leading whitespace of the
formats that only open a reply, values typed by the tool's schema, and who
owns each built or dropped character.

Each document is fed a character a token, whole, and in random splits (and
through the pipeline, with the alignment contract checked); the merged
result must not depend on the split."""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass

import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from sluiceway.parsers.events import PROMPT_OWNER, Channel, Event, Span, ToolCallOpened, content
from sluiceway.parsers.formats import FORMATS, GRAPHS, FormatParser, parser
from sluiceway.parsers.formats.render import Call, render
from sluiceway.parsers.registry import ToolSchema
from sluiceway.parsers.stages import PrimeError

from .family_calls import SCHEMAS
from .harness import Routed, assert_contract, examples, route, run_pipeline, tokenizations

TOOLS = tuple(ToolSchema(name=name, parameters=schema) for name, schema in SCHEMAS.items())
HERMES_CALL = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n'
KIMI_OPEN = "<|tool_calls_section_begin|><|tool_call_begin|>functions."
KIMI_CLOSE = "<|tool_call_end|><|tool_calls_section_end|>"


def feed(family: str, pieces: list[str], *, prime: str | None = None) -> list[Event]:
    """Token ``i`` writes ``pieces[i]``; then the reply ends."""
    stage = parser(family, tools=TOOLS)
    if prime is not None:
        stage.prime(prime)
    out: list[Event] = []
    for token, piece in enumerate(pieces):
        out += stage.feed([content(token, piece)])
    return out + stage.finish()


def spans(events: list[Event]) -> list[Span]:
    """Every span, a call's name spans where its ToolCallOpened is."""
    found: list[Span] = []
    for event in events:
        found.extend(event.name_spans if isinstance(event, ToolCallOpened) else (event,))
    return found


def owned(events: list[Event]) -> list[tuple[int, str, str]]:
    """(owner, where, text) of every span: content, dropped, or call N."""
    where = {Channel.CONTENT: "content", Channel.DROPPED: "dropped"}
    return [
        (span.token, where.get(span.channel, f"call {span.tool_index}"), span.text)
        for span in spans(events)
    ]


@dataclass(frozen=True)
class Case:
    name: str
    family: str
    text: str
    content: str
    calls: tuple[tuple[str, str], ...] = ()


CASES = [
    # A committed call broken inside a literal: built arguments close ("{}",
    # owned by the breaking token) and the literal in progress is content.
    Case(
        "broken-in-literal",
        "hermes",
        '<tool_call>\n{"name": "f", "argumXY',
        '"argumXY',
        (("f", "{}"),),
    ),
    # Broken after its arguments closed: nothing more is built.
    Case(
        "broken-after-arguments",
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}X',
        "X",
        (("f", '{"a": 1}'),),
    ),
    # Broken between parameters: the built object closes.
    Case(
        "broken-between-parameters",
        "qwen3_coder",
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\nZ",
        "Z",
        (("f", '{"a": "1"}'),),
    ),
    # JSON arguments that are a scalar end at the literal after them.
    Case(
        "scalar-arguments",
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": 5}\n</tool_call>',
        "",
        (("f", "5"),),
    ),
    # A tight literal after whitespace breaks the markup before the call commits.
    Case(
        "tight-after-space",
        "hermes",
        '<tool_call>\n{"name": "f "}\n</tool_call>',
        '<tool_call>\n{"name": "f "}\n</tool_call>',
    ),
    # Cut inside the closing literal of a committed call: it is markup.
    Case(
        "cut-in-closing-literal",
        "hermes",
        '<tool_call>\n{"name": "f"}\n</tool_',
        "",
        (("f", "{}"),),
    ),
    # Cut inside a key: the key is markup, nothing is built for it.
    Case("cut-in-key", "qwen3_coder", "<tool_call>\n<function=f>\n<parameter=ci", "", (("f", ""),)),
    # Cut inside a Python value: what it holds goes out as written.
    Case("cut-in-python-value", "pythonic", "[f(a=12", "", (("f", '{"a": 12'),)),
    # Values typed by the tool's schema (days is an integer).
    Case(
        "typed-tagged-value",
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n140.0\n</parameter>\n"
        "</function>\n</tool_call>",
        "",
        (("get_weather", '{"days": 140}'),),
    ),
    Case(
        "typed-python-value",
        "pythonic",
        "[get_weather(days=140.0)]",
        "",
        (("get_weather", '{"days": 140}'),),
    ),
    Case("empty-python-value", "pythonic", "[f(a=)]", "", (("f", '{"a": ""}'),)),
    # Key characters: a Python keyword takes "_", a tagged key takes "X".
    Case("python-key-underscore", "pythonic", "[f(my_key=1)]", "", (("f", '{"my_key": 1}'),)),
    Case(
        "tagged-key-x",
        "qwen3_coder",
        "<tool_call>\n<function=f>\n<parameter=maxX>\nv\n</parameter>\n</function>\n</tool_call>",
        "",
        (("f", '{"maxX": "v"}'),),
    ),
    # Formats that only open a reply: leading whitespace is markup before a
    # call; after broken markup or an ended call, nothing opens again.
    Case("leading-whitespace", "pythonic", " \n[f(a=1)]", "", (("f", '{"a": 1}'),)),
    Case("nothing-opens-after-a-call", "pythonic", "[f()][g()]", "[g()]", (("f", "{}"),)),
    Case("nothing-opens-after-a-break", "pythonic", "[[f()]", "[[f()]"),
    # A reply that ends in what may still open markup (leading whitespace,
    # part of the first literal) is content.
    Case("only-whitespace", "pythonic", "  ", "  "),
    Case("part-of-a-literal", "pythonic", "<|pyth", "<|pyth"),
    Case("only-whitespace", "llama3_json", " \n", " \n"),
    # A reader that takes no whitespace before it does not start after some.
    Case("no-space-before-a-key", "pythonic", "[f( a=1)]", "a=1)]", (("f", "{}"),)),
    Case(
        "broken-json-start",
        "llama3_json",
        '{"na{"name": "f", "arguments": {}}',
        '{"na{"name": "f", "arguments": {}}',
    ),
    Case("text-first", "llama3_json", "Hi {", "Hi {"),
]
IDS = [f"{case.family}-{case.name}" for case in CASES]


def check(case: Case, events: list[Event], pieces: list[str]) -> None:
    routed = route(events)
    assert (routed.content, routed.call_list) == (case.content, list(case.calls))
    found = spans(events)
    assert all(span.text for span in found), "an empty span"
    # Every token owns some output, and nothing else does.
    assert {span.token for span in found} == {i for i, piece in enumerate(pieces) if piece}


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_document_reads_the_same_a_character_a_token_and_whole(case: Case) -> None:
    check(case, feed(case.family, list(case.text)), list(case.text))
    check(case, feed(case.family, [case.text]), [case.text])


@pytest.mark.parametrize("case", CASES, ids=IDS)
@settings(max_examples=examples(40), deadline=None)
@given(data=st.data())
def test_a_document_reads_the_same_in_any_split(case: Case, data: st.DataObject) -> None:
    cuts = data.draw(st.sets(st.integers(1, max(1, len(case.text) - 1))))
    bounds = [0, *sorted(cuts), len(case.text)]
    pieces = [case.text[a:b] for a, b in itertools.pairwise(bounds) if b > a]
    note(repr(pieces))
    check(case, feed(case.family, pieces), pieces)
    tokenized = data.draw(tokenizations(case.text, eos=False))
    run = run_pipeline(tokenized, [parser(case.family, tools=TOOLS)])
    expected = Routed(content=case.content, calls={i: list(c) for i, c in enumerate(case.calls)})
    assert_contract(run, expected)


def test_built_arguments_of_a_broken_call_are_owned_by_the_breaking_token() -> None:
    text = '<tool_call>\n{"name": "f", "argumXY'
    events = feed("hermes", list(text))
    broke = text.index("X")
    assert (broke, "call 0", "{}") in owned(events)
    quote = text.index('"argum')
    assert [o for o in owned(events) if o[1] == "content"] == [
        (quote + i, "content", char) for i, char in enumerate('"argumXY')
    ]


def test_a_python_value_is_owned_by_its_first_token_and_the_rest_is_markup() -> None:
    text = "[f(a=123)]"
    value = text.index("1")
    assert owned(feed("pythonic", list(text)))[3:] == [
        # The key waits for its value, so it goes out after the "=".
        (value - 1, "dropped", "="),
        (value - 2, "call 0", '{"'),
        (value - 2, "call 0", "a"),
        (value - 1, "call 0", '": '),
        (value, "call 0", "123"),
        (value + 1, "dropped", "2"),
        (value + 2, "dropped", "3"),
        (value + 3, "dropped", ")"),
        (value + 3, "call 0", "}"),
        (value + 4, "dropped", "]"),
    ]


def test_an_empty_python_value_is_owned_by_the_token_that_ends_it() -> None:
    text = "[f(a=)]"
    end = text.index(")")
    assert (end, "call 0", '""') in owned(feed("pythonic", list(text)))


def test_a_quoted_value_that_is_not_json_is_owned_by_its_first_token() -> None:
    """A non-string parameter written ``"ab``: one JSON string, as the first
    token's text (a literal spelled otherwise), the rest dropped."""
    text = '<tool_call>\n<function=get_weather>\n<parameter=days>\n"ab\n</parameter>\n</function>'
    events = feed("qwen3_coder", list(text))
    first = text.index('"ab')
    assert json.loads(route(events).call_list[0][1]) == {"days": '"ab'}
    assert (first, "call 0", json.dumps('"ab')) in owned(events)
    assert (first + 1, "dropped", "a") in owned(events)
    assert (first + 2, "dropped", "b") in owned(events)


def test_a_python_keyword_is_letters_digits_and_underscores() -> None:
    """``a.b=`` is no keyword: the call breaks after ``a``, the rest is
    content, and the key that never got a value is dropped, not left open."""
    routed = route(feed("pythonic", list("[f(a.b=1)]")))
    assert routed.content == ".b=1)]"
    assert routed.call_list == [("f", "{}")]
    assert routed.dropped == "[(a"


def test_a_call_index_written_in_pieces_is_whole_in_the_call_id() -> None:
    text = f"{KIMI_OPEN}f:12<|tool_call_argument_begin|>{{}}{KIMI_CLOSE}"
    opened = [e for e in feed("kimi_k2", list(text)) if isinstance(e, ToolCallOpened)]
    assert [e.call_id for e in opened] == ["functions.f:12"]


def test_a_parser_built_from_a_graph_reads_parallel_calls_by_default() -> None:
    stage = FormatParser(GRAPHS["hermes"])
    events = stage.feed([content(0, HERMES_CALL * 2)]) + stage.finish()
    assert [name for name, _ in route(events).call_list] == ["f", "f"]


def test_the_open_channel_is_the_tool_call_only_inside_a_committed_call() -> None:
    """A token that owns no text (an invisible one, a cut character) takes
    the open channel: uncommitted markup may still turn out to be content."""
    stage = parser("hermes")
    seen = []
    for piece in ["<tool_call>", '\n{"name": "f', '"', ", ", "}\n</tool_call>"]:
        stage.feed([content(0, piece)])
        seen.append(stage.open_channel(Channel.CONTENT))
    assert seen[:2] == [Channel.CONTENT, Channel.CONTENT]
    assert seen[2:4] == [Channel.TOOL_CALL, Channel.TOOL_CALL]
    # Where the markup may only end, the channel is upstream's.
    assert stage.open_channel(Channel.REASONING) is Channel.REASONING


def test_prime_says_why_it_refuses() -> None:
    fed = parser("hermes")
    fed.feed([content(0, "hi")])
    with pytest.raises(
        PrimeError, match=r"^a tool-call parser can only be primed before it is fed$"
    ):
        fed.prime("<tool_call>")
    # Text before markup in a prefix is prompt text (dropped); arguments are not.
    written = '<tool_call>\n{"name": "f", "arguments": {"a"'
    with pytest.raises(
        PrimeError, match=f"^{re.escape(repr(written))} does not start a tool call$"
    ):
        parser("hermes").prime(written)
    with pytest.raises(PrimeError, match=r"^' ' does not leave a tool call open$"):
        parser("pythonic").prime(" ")


@pytest.mark.parametrize(
    ("family", "prefix"), [("hermes", "<tool_call>"), ("llama3_json", "<|python_tag|>")]
)
def test_a_primed_prefix_that_breaks_is_dropped_prompt_text(family: str, prefix: str) -> None:
    """The model's text after a forced prefix that it did not go on with is
    content; the prefix was never output, so it stays dropped."""
    events = feed(family, list("hello"), prime=prefix)
    assert owned(events) == [
        (PROMPT_OWNER, "dropped", prefix),
        *((i, "content", char) for i, char in enumerate("hello")),
    ]
    assert next(span.markup for span in spans(events)) is Channel.TOOL_CALL


#: Text that no format's markup takes at any place outside a value.
BREAK = "\u00a7 tail"


@pytest.mark.parametrize("family", sorted(FORMATS))
def test_a_call_whose_markup_breaks_ends_with_whole_json_arguments(family: str) -> None:
    """A call's rendering cut at every place and followed by text that breaks
    its markup: where that text comes out as content (the call ended, it was
    not read into a value), every call's arguments are whole JSON, built
    from what was complete (a key whose value had not started is left out)."""
    text = render(FORMATS[family], [Call("get_weather", {"city": "Oslo", "days": 3})])
    broke = []
    for cut in range(1, len(text)):
        routed = route(feed(family, list(text[:cut] + BREAK)))
        if not routed.content.endswith(BREAK):
            continue  # read into a value (or JSON arguments) that the reply then cut
        broke.append(cut)
        for name, arguments in routed.calls.values():
            assert isinstance(json.loads(arguments), dict), (text[:cut], name, arguments)
    assert broke, "no place broke the markup"
