"""The Hermes tool-call parser against the reference, under any tokenization."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from sluiceway.parsers.events import PROMPT_OWNER, Channel, Span, ToolCallOpened, content, dropped
from sluiceway.parsers.formats import FormatParser, parser
from sluiceway.parsers.formats.arguments import JsonExtent
from sluiceway.parsers.formats.families import HERMES
from sluiceway.parsers.formats.render import forced_prefix as render_prefix
from sluiceway.parsers.stages import PrimeError

from .harness import (
    CODE,
    MULTIBYTE,
    PLAIN,
    TOOL_NEAR_MISSES,
    Tokenized,
    UnsupportedDocument,
    assert_accounts_for,
    assert_held_from,
    examples,
    hermes_call,
    ref_hermes,
    regroup,
    route,
    run_chain,
    run_whole,
    text_atoms,
    token_spans,
    tokenizations,
    tokenize,
)


def hermes(*, parallel_tool_calls: bool = True) -> FormatParser:
    return parser("hermes", parallel_tool_calls=parallel_tool_calls)


def forced_prefix(name: str | None) -> str:
    return render_prefix(HERMES, name)


ATOMS = text_atoms(PLAIN, MULTIBYTE, CODE, TOOL_NEAR_MISSES)


@st.composite
def documents(draw: st.DrawFn) -> tuple[str, list[tuple[str, str]]]:
    """Content with near misses and well-formed calls; the calls as generated."""
    parts: list[str] = []
    calls: list[tuple[str, str]] = []
    for _ in range(draw(st.integers(0, 8))):
        if draw(st.integers(0, 3)) == 0:
            text, name, arguments = draw(hermes_call())
            parts.append(text)
            calls.append((name, arguments))
        else:
            parts.append(draw(ATOMS))
    return "".join(parts), calls


Case = tuple[str, list[tuple[str, str]], bool, Tokenized, set[int]]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    text, calls = draw(documents())
    tokenized = draw(tokenizations(text, eos=False))
    groups = draw(st.sets(st.integers(1, max(1, len(tokenized.ids) - 1)), max_size=5))
    return text, calls, draw(st.booleans()), tokenized, groups


def _check_against_reference(case: Case) -> None:
    text, calls, parallel, tokenized, groups = case
    try:
        expected_content, expected_calls = ref_hermes(text, parallel=parallel)
    except UnsupportedDocument:
        assume(False)
        return
    steps = token_spans(tokenized)
    run = run_chain([hermes(parallel_tool_calls=parallel)], regroup(steps, groups))
    routed = route(run.events)
    assert routed.content == expected_content
    assert routed.call_list == expected_calls
    if len(expected_calls) == len(calls) or not parallel:
        generated = calls if parallel else calls[:1]
        assert [name for name, _ in routed.call_list] == [name for name, _ in generated]
        for (_, got), (_, wanted) in zip(routed.call_list, generated, strict=True):
            assert json.loads(got) == json.loads(wanted)
    assert_accounts_for(steps, run)
    assert all(
        e.markup is Channel.TOOL_CALL
        for e in run.events
        if isinstance(e, Span) and e.channel is Channel.DROPPED
    )
    whole = route(run_whole([hermes(parallel_tool_calls=parallel)], text).events)
    assert (whole.content, whole.call_list) == (expected_content, expected_calls)


@settings(max_examples=examples(300), deadline=None)
@given(case=cases())
@example(
    case=(
        '<tool_call>{"name": "f", "arguments": {"a": "}"}}</tool_call>',
        [("f", '{"a": "}"}')],
        True,
        tokenize(b'<tool_call>{"name": "f", "arguments": {"a": "}"}}</tool_call>', range(1, 60)),
        set(),
    )
)
@example(
    case=(
        '<tool_call>{"name": "a b<tool_call>{"name": "g", "arguments": {}}</tool_call>',
        [("g", "{}")],
        True,
        tokenize(
            b'<tool_call>{"name": "a b<tool_call>{"name": "g", "arguments": {}}</tool_call>', [3]
        ),
        set(),
    )
)
def test_matches_reference_under_any_tokenization(case: Case) -> None:
    _check_against_reference(case)


@settings(max_examples=examples(200), deadline=None)
@given(case=cases(), data=st.data())
def test_truncated_replies_lose_nothing(case: Case, data: st.DataObject) -> None:
    """Any prefix (a reply cut by max_tokens, or garbage): streaming equals
    non-streaming, every character comes out once with its owner."""
    text, _, parallel, _, _ = case
    end = data.draw(st.integers(0, len(text)))
    prefix = text[:end]
    tokenized = data.draw(tokenizations(prefix, eos=False))
    steps = token_spans(tokenized)
    run = run_chain([hermes(parallel_tool_calls=parallel)], steps)
    assert_accounts_for(steps, run)
    assert_held_from(steps, run)
    whole = route(run_whole([hermes(parallel_tool_calls=parallel)], prefix).events)
    streamed = route(run.events)
    assert (streamed.content, streamed.call_list) == (whole.content, whole.call_list)


def test_arguments_stream_as_they_are_generated() -> None:
    parser = hermes()
    out = parser.feed([content(0, 'Hi <tool_call>\n{"name": "get_')])
    assert route(out).content == "Hi "
    assert parser.held_from == 0  # the envelope, until the name is complete
    out = parser.feed([content(1, 'weather", "arguments": {"ci')])
    opened = [e for e in out if isinstance(e, ToolCallOpened)]
    assert [(e.tool_index, e.name) for e in opened] == [(0, "get_weather")]
    assert [s.token for s in opened[0].name_spans] == [0, 1]
    assert route(out).calls[0][1] == '{"ci'
    assert parser.held_from is None
    assert parser.open_channel(Channel.CONTENT) is Channel.TOOL_CALL
    out = parser.feed([content(2, 'ty": "Paris"}}\n</tool_call>\n')])
    assert [e.text for e in out if isinstance(e, Span) and e.channel is Channel.TOOL_CALL] == [
        'ty": "Paris"}'
    ]
    assert parser.open_channel(Channel.CONTENT) is Channel.CONTENT


def test_broken_envelope_is_content_with_its_owners() -> None:
    parser = hermes()
    out = parser.feed([content(0, "<tool_call>")]) + parser.feed([content(1, '{"name": "a b')])
    out += parser.finish()
    assert route(out).content == '<tool_call>{"name": "a b'
    assert [(s.token, s.text) for s in out if isinstance(s, Span)][:2] == [
        (0, "<"),
        (0, "tool_call>"),
    ]


def test_reply_ending_before_the_name_is_complete_is_content() -> None:
    parser = hermes()
    out = parser.feed([content(0, '<tool_call>\n{"name": "get_wea')]) + parser.finish()
    assert route(out).content == '<tool_call>\n{"name": "get_wea'
    assert route(out).calls == {}


def test_parallel_tool_calls_false_reports_only_the_first() -> None:
    call = '<tool_call>{"name": "%s", "arguments": {}}</tool_call>'
    routed = route(
        run_whole([hermes(parallel_tool_calls=False)], (call % "f") + (call % "g")).events
    )
    assert routed.call_list == [("f", "{}")]
    assert routed.content == ""
    assert routed.dropped.endswith(call % "g")


def test_prime_named_call() -> None:
    parser = hermes()
    parser.prime(forced_prefix("get_weather"))
    out = parser.feed([content(0, ' {"city": "Paris"}')])
    assert isinstance(out[0], ToolCallOpened)
    assert out[0].name_spans == (
        Span(PROMPT_OWNER, "get_weather", Channel.TOOL_CALL, tool_index=0),
    )
    assert out[1] == dropped(0, " ", Channel.TOOL_CALL)
    out += parser.feed([content(1, "}\n</tool_call>")]) + parser.finish()
    assert route(out).call_list == [("get_weather", '{"city": "Paris"}')]


def test_prime_required_call_lets_the_model_name_it() -> None:
    parser = hermes()
    parser.prime(forced_prefix(None))
    assert parser.held_from is None  # prompt text is not a token's
    out = parser.feed([content(0, 'f", "arguments": {}}')])
    assert route(out).call_list == [("f", "{}")]


def test_prime_required_call_broken_by_the_model_drops_the_prompt_part() -> None:
    parser = hermes()
    parser.prime(forced_prefix(None))
    out = parser.feed([content(0, "oops no")]) + parser.finish()
    assert route(out).content == "oops no"


def test_prime_rejects_text_that_is_not_a_call() -> None:
    with pytest.raises(PrimeError):
        hermes().prime("hello")
    parser = hermes()
    parser.feed([])
    with pytest.raises(PrimeError):
        parser.prime(forced_prefix(None))


def test_reasoning_passes_through() -> None:
    parser = hermes()
    inside = Span(0, '<tool_call>{"name": "f", "arguments": {}}</tool_call>', Channel.REASONING)
    assert parser.feed([inside]) == [inside]


@pytest.mark.parametrize(
    ("value", "end"),
    [
        ('{"a": "}\\"]"} tail', len('{"a": "}\\"]"}')),
        ("[1, [2], {}] x", len("[1, [2], {}]")),
        ('"a\\"b" x', len('"a\\"b"')),
        ("123}", 3),
        ("null ", 4),
    ],
)
def test_json_extent(value: str, end: int) -> None:
    for split in range(1, len(value)):
        extent = JsonExtent()
        reached, done = extent.advance(value[:split], 0)
        if done:
            assert reached == end
            continue
        assert reached == split
        rest, done = extent.advance(value[split:], 0)
        assert done
        assert split + rest == end


def test_is_a_tool_call_parser_class() -> None:
    assert isinstance(hermes(), FormatParser)


@settings(max_examples=examples(60), deadline=None)
@given(
    cuts=st.sets(st.integers(1, 60), max_size=20), groups=st.sets(st.integers(1, 30), max_size=5)
)
def test_a_call_without_arguments_gets_an_empty_object(cuts: set[int], groups: set[int]) -> None:
    """Clients json-parse ``arguments``: a call that names no arguments has ``{}``,
    owned by the brace that closed the call, whatever the tokenization."""
    text = 'a<tool_call>\n{"name": "f"}\n</tool_call>'
    tokenized = tokenize(text.encode(), cuts)
    steps = token_spans(tokenized)
    run = run_chain([hermes(parallel_tool_calls=True)], regroup(steps, groups))
    routed = route(run.events)
    assert (routed.content, routed.call_list) == ("a", [("f", "{}")])
    closing = text.index("}")
    owner = next(
        i for i, end in enumerate(itertools.accumulate(map(len, tokenized.pieces))) if end > closing
    )
    synthetic = [
        e
        for e in run.events
        if isinstance(e, Span) and e.channel is Channel.TOOL_CALL and e.text == "{}"
    ]
    assert [e.token for e in synthetic] == [owner]
