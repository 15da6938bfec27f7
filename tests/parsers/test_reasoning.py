"""The reasoning parsers (qwen3, deepseek_r1) against the reference, under any tokenization."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sluiceway.parsers.events import Channel, content, dropped
from sluiceway.parsers.reasoning import (
    DEEPSEEK_R1,
    MISTRAL,
    QWEN3,
    ReasoningDialect,
    ReasoningParser,
    ReasoningState,
    UnsupportedGateError,
    deepseek_r1,
    parser_of,
    primed_state,
    qwen3,
    reasoning_gate,
)
from sluiceway.parsers.stages import PrimeError, StageFinishedError
from sluiceway.protocol.constraints import ReasoningGate

from .harness import (
    CODE,
    MULTIBYTE,
    PLAIN,
    REASONING_NEAR_MISSES,
    Tokenized,
    assert_accounts_for,
    assert_held_from,
    examples,
    joined,
    ref_reasoning,
    regroup,
    route,
    run_chain,
    run_whole,
    text_atoms,
    token_spans,
    tokenizations,
    tokenize,
)

# (dialect, assistant prefix, the state the reference starts in)
PRIMINGS = [
    ("qwen3", "", "start"),
    ("qwen3", "<|im_start|>assistant\n", "start"),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "reasoning"),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "closed"),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\nSure", "content"),
    ("deepseek_r1", "", "start"),
    ("deepseek_r1", "<\uff5cAssistant\uff5c><think>\n", "reasoning"),
    ("deepseek_r1", "<\uff5cAssistant\uff5c><think>\n</think>", "closed"),
]


def make(dialect: str, prefix: str) -> ReasoningParser:
    parser = qwen3() if dialect == "qwen3" else deepseek_r1()
    parser.prime(prefix)
    return parser


@st.composite
def documents(draw: st.DrawFn) -> str:
    atoms = text_atoms(PLAIN, MULTIBYTE, REASONING_NEAR_MISSES, CODE)
    lead = draw(st.sampled_from(["", "\n", "  ", "\n\n", "x"]))
    opened = "<think>" if draw(st.booleans()) else ""
    reasoning = draw(joined(atoms))
    closed = draw(st.sampled_from(["", "</think>", "</think>\n\n", "</think> \n\t"]))
    answer = draw(joined(atoms))
    return lead + opened + reasoning + closed + answer


@st.composite
def cases(draw: st.DrawFn) -> tuple[int, str, Tokenized, set[int]]:
    priming = draw(st.integers(0, len(PRIMINGS) - 1))
    text = draw(documents())
    tokenized = draw(tokenizations(text, eos=False))
    groups = draw(st.sets(st.integers(1, max(1, len(tokenized.ids) - 1)), max_size=6))
    return priming, text, tokenized, groups


@settings(max_examples=examples(300), deadline=None)
@given(case=cases())
@example(case=(0, "<think>a</think>b", tokenize(b"<think>a</think>b", range(1, 17)), set()))
@example(case=(5, "</think>b", tokenize(b"</think>b", [1]), set()))
@example(case=(0, "\n<thi", tokenize(b"\n<thi", [1, 3]), set()))
@example(case=(2, "a</thi", tokenize(b"a</thi", []), set()))
def test_matches_reference_under_any_tokenization(
    case: tuple[int, str, Tokenized, set[int]],
) -> None:
    priming, text, tokenized, groups = case
    dialect, prefix, state = PRIMINGS[priming]
    steps = token_spans(tokenized)
    parser = make(dialect, prefix)
    run = run_chain([parser], regroup(steps, groups))
    routed = route(run.events)
    expected = ref_reasoning(text, starts_in_reasoning=dialect == "deepseek_r1", primed=state)
    assert (routed.reasoning, routed.content) == expected
    assert_accounts_for(steps, run)
    assert all(e.markup is Channel.REASONING for e in run.events if e.channel is Channel.DROPPED)
    # Streaming equals non-streaming (feed everything, then finish).
    whole = route(run_whole([make(dialect, prefix)], text).events)
    assert (whole.reasoning, whole.content) == expected


@settings(max_examples=examples(200), deadline=None)
@given(case=cases())
def test_held_from_names_the_first_held_character(
    case: tuple[int, str, Tokenized, set[int]],
) -> None:
    priming, _, tokenized, _ = case
    dialect, prefix, _ = PRIMINGS[priming]
    steps = token_spans(tokenized)
    assert_held_from(steps, run_chain([make(dialect, prefix)], steps))


@settings(max_examples=examples(200), deadline=None)
@given(text=st.text(alphabet="</think>ab é", max_size=40), cuts=st.sets(st.integers(1, 40)))
def test_inside_reasoning_only_a_possible_close_tag_is_held(text: str, cuts: set[int]) -> None:
    steps = token_spans(tokenize(text.encode(), cuts))
    parser = make("qwen3", "<think>\n")
    fed = ""
    emitted = 0
    for step in steps:
        out = parser.feed(step)
        fed += "".join(e.text for e in step)
        emitted += sum(len(e.text) for e in out)
        if parser.state is not ReasoningState.REASONING:
            break
        held = max(
            k for k in range(min(len(fed), 7) + 1) if "</think>".startswith(fed[len(fed) - k :])
        )
        assert emitted == len(fed) - held


def test_a_less_than_followed_by_other_text_is_released_at_once() -> None:
    parser = make("qwen3", "<think>\n")
    out = parser.feed([content(0, "a<")])
    assert [(e.text, e.channel) for e in out] == [("a", Channel.REASONING)]
    assert parser.held_from == 0
    out = parser.feed([content(1, "b")])
    assert [(e.token, e.text, e.channel) for e in out] == [
        (0, "<", Channel.REASONING),
        (1, "b", Channel.REASONING),
    ]
    assert parser.held_from is None


def test_every_split_of_every_tag() -> None:
    text = "\n<think>é</think>\n\nok"
    data = text.encode()
    for dialect in ("qwen3", "deepseek_r1"):
        expected = ref_reasoning(text, starts_in_reasoning=dialect == "deepseek_r1")
        for first in range(1, len(data)):
            for second in range(first, len(data)):
                steps = token_spans(tokenize(data, {first, second}))
                routed = route(run_chain([make(dialect, "")], steps).events)
                assert (routed.reasoning, routed.content) == expected, (first, second)


def test_truncated_reasoning_stays_reasoning_and_partial_tag_is_released() -> None:
    parser = make("qwen3", "<think>\n")
    out = parser.feed([content(0, "hmm </thi")])
    assert parser.held_from == 0
    out += parser.finish()
    assert route(out).reasoning == "hmm </thi"
    assert route(out).content == ""


def test_think_later_in_content_is_ordinary_text() -> None:
    routed = route(run_whole([make("qwen3", "")], "Sure. <think>x</think>").events)
    assert routed.content == "Sure. <think>x</think>"
    assert routed.reasoning == ""


def test_whitespace_after_close_is_reasoning_markup() -> None:
    parser = make("qwen3", "")
    out = parser.feed([content(0, "<think>r</think>")])
    out += parser.feed([content(1, "\n\n")])
    assert out[-1] == dropped(1, "\n\n", Channel.REASONING)
    assert parser.open_channel(Channel.CONTENT) is Channel.CONTENT


@pytest.mark.parametrize(("dialect", "prefix", "state"), PRIMINGS)
def test_priming_changes_state_only(dialect: str, prefix: str, state: str) -> None:
    parser = make(dialect, prefix)
    assert parser.state.value == state
    assert parser.finish() == []


def test_open_channel() -> None:
    assert make("qwen3", "").open_channel(Channel.CONTENT) is Channel.CONTENT
    assert make("deepseek_r1", "").open_channel(Channel.CONTENT) is Channel.REASONING
    assert make("qwen3", "<think>\n").open_channel(Channel.CONTENT) is Channel.REASONING
    assert make("deepseek_r1", "<think></think>").open_channel(Channel.CONTENT) is Channel.CONTENT


def test_illegal_use_raises_typed_errors() -> None:
    parser = make("qwen3", "")
    parser.feed([content(0, "x")])
    with pytest.raises(
        PrimeError, match=r"^a reasoning parser can only be primed before it is fed$"
    ):
        parser.prime("<think>")
    parser.finish()
    with pytest.raises(StageFinishedError):
        parser.feed([content(1, "y")])
    with pytest.raises(StageFinishedError):
        parser.finish()


def test_other_channels_pass_through_in_order() -> None:
    parser = make("qwen3", "<think>\n")
    out = parser.feed([content(0, "a</th"), dropped(1, "X", None)])
    assert [(e.token, e.text, e.channel) for e in out] == [
        (0, "a", Channel.REASONING),
        (0, "</th", Channel.REASONING),
        (1, "X", Channel.DROPPED),
    ]


@pytest.mark.parametrize(
    ("prefix", "state"),
    [
        ("<think>a</think>b<think>\n", ReasoningState.REASONING),  # the last block is open
        ("<think></think>\n<think>x</think>\n", ReasoningState.CLOSED),
        ("<think>a</think><think>b</think>c", ReasoningState.CONTENT),
    ],
)
def test_the_last_think_block_of_a_prompt_decides(prefix: str, state: ReasoningState) -> None:
    """Earlier turns' blocks in the prompt do not count."""
    assert primed_state(prefix) is state


def test_priming_in_pieces_reads_the_whole_prefix() -> None:
    parser = qwen3()
    parser.prime("<|im_start|>assistant\n<th")
    parser.prime("ink>\n")
    assert parser.state is ReasoningState.REASONING


def test_a_dialect_is_primed_with_its_own_tags() -> None:
    parser = parser_of(MISTRAL)()
    assert (type(parser), parser.dialect) == (ReasoningParser, MISTRAL)
    parser.prime("[THINK]")
    assert parser.state is ReasoningState.REASONING
    assert primed_state("[THINK]x[/THINK]\n", MISTRAL) is ReasoningState.CLOSED


def _ids(*single: str) -> dict[str, int]:
    """A vocabulary in which exactly the texts ``single`` are one token."""
    return {text: 10 + index for index, text in enumerate(single)}


@pytest.mark.parametrize(
    ("dialect", "prefix", "gate"),
    [
        # The prompt closed reasoning (or the answer began): nothing to wait out.
        (QWEN3, "<think>\n\n</think>\n\n", None),
        (QWEN3, "<think>\n\n</think>\n\nSure", None),
        # The prompt left the output inside reasoning.
        (QWEN3, "<think>\n", ReasoningGate(end_id=11, inside=True)),
        (DEEPSEEK_R1, "", ReasoningGate(end_id=11, inside=True)),
        (MISTRAL, "[THINK]", ReasoningGate(end_id=13, inside=True)),
        # The output may open reasoning with its first token.
        (QWEN3, "", ReasoningGate(end_id=11, start_id=10)),
        (MISTRAL, "", ReasoningGate(end_id=13, start_id=12)),
    ],
)
def test_reasoning_gate(dialect: ReasoningDialect, prefix: str, gate: ReasoningGate | None) -> None:
    ids = _ids("<think>", "</think>", "[THINK]", "[/THINK]")
    assert reasoning_gate(dialect, prefix, ids.get) == gate


def test_no_gate_where_the_opening_tag_is_not_one_token() -> None:
    assert reasoning_gate(QWEN3, "", _ids("</think>").get) is None


def test_a_closing_tag_of_several_tokens_cannot_gate() -> None:
    message = r"^</think> is not one token of this model, so a constraint cannot start after it$"
    with pytest.raises(UnsupportedGateError, match=message):
        reasoning_gate(QWEN3, "<think>\n", _ids("<think>").get)
    # Unless the prompt closed reasoning: then nothing waits for the tag.
    assert reasoning_gate(QWEN3, "<think></think>", _ids().get) is None
