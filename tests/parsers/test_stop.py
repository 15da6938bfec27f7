"""The stop matcher against the reference: cut at the first stop string to complete."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sluiceway.parsers.events import Channel, Span, content, dropped
from sluiceway.parsers.pipeline import ChoicePipeline
from sluiceway.parsers.reasoning import qwen3
from sluiceway.parsers.stop import InvalidStopError, StopMatcher
from sluiceway.protocol.tokens import TokenTable

from .harness import (
    Tokenized,
    assert_accounts_for,
    assert_held_from,
    examples,
    owners_of,
    ref_reasoning,
    ref_stop,
    regroup,
    route,
    run_chain,
    run_whole,
    token_spans,
    tokenizations,
    tokenize,
)

ALPHABET = "abc</> é漢"


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, list[str], bool, int, Tokenized, set[int]]:
    text = draw(st.text(alphabet=ALPHABET, max_size=60))
    substrings = st.builds(
        lambda a, n: text[a : a + n], st.integers(0, max(0, len(text) - 1)), st.integers(1, 6)
    ).filter(bool)
    stop = draw(
        st.lists(
            st.one_of(substrings, st.text(alphabet=ALPHABET, min_size=1, max_size=5))
            if text
            else st.text(alphabet=ALPHABET, min_size=1, max_size=5),
            min_size=1,
            max_size=5,
        )
    )
    tokenized = draw(tokenizations(text, eos=False))
    min_tokens = draw(st.sampled_from([0, 0, 1, 3, 10]))
    groups = draw(st.sets(st.integers(1, max(1, len(tokenized.ids) - 1)), max_size=5))
    return text, stop, draw(st.booleans()), min_tokens, tokenized, groups


Case = tuple[str, list[str], bool, int, Tokenized, set[int]]


@settings(max_examples=examples(400), deadline=None)
@given(case=cases())
@example(case=("xxabcx", ["abcd", "bc"], False, 0, tokenize(b"xxabcx", range(1, 6)), set()))
@example(case=("abcd", ["abcd", "bc"], True, 0, tokenize(b"abcd", [2]), set()))
@example(case=("aab", ["ab", "aab"], False, 0, tokenize(b"aab", [1, 2]), set()))
@example(case=("abab", ["ab"], False, 2, tokenize(b"abab", [1, 2, 3]), set()))
def test_output_is_text_cut_at_the_first_completed_match(case: Case) -> None:
    text, stop, include, min_tokens, tokenized, groups = case
    steps = token_spans(tokenized)
    owners = owners_of(steps)
    expected = ref_stop(text, owners, stop, min_tokens)
    matcher = StopMatcher(stop, include_stop_str_in_output=include, min_tokens=min_tokens)
    cut = len(text) if expected is None else expected[0] + (len(expected[1]) if include else 0)
    released = ""
    run = run_chain([], [])
    for group in regroup(steps, groups):
        out = matcher.feed(group)
        released += route(out).content
        # Nothing past the cut is ever released, not even for a moment.
        assert text[:cut].startswith(released)
        run.steps.append(out)
    run.steps.append(matcher.finish())
    routed = route(run.events)
    assert routed.content == text[:cut]
    assert matcher.matched == (None if expected is None else expected[1])
    assert_accounts_for(steps, run)
    # Non-streaming gives the same cut when ownership does not matter.
    if min_tokens == 0:
        whole = run_whole([StopMatcher(stop, include_stop_str_in_output=include)], text)
        assert route(whole.events).content == text[:cut]


@settings(max_examples=examples(200), deadline=None)
@given(case=cases())
def test_held_from_and_minimal_holding(case: Case) -> None:
    _, stop, _, min_tokens, tokenized, _ = case
    steps = token_spans(tokenized)
    matcher = StopMatcher(stop, min_tokens=min_tokens)
    run = run_chain([matcher], steps)
    assert_held_from(steps, run)
    # Until a match is found, exactly the suffix that could still begin a
    # stop string is held.
    fed = ""
    emitted = 0
    for step, out in zip(steps, run.steps, strict=False):
        fed += "".join(e.text for e in step if isinstance(e, Span))
        emitted += sum(len(e.text) for e in out if isinstance(e, Span))
        if ref_stop(fed, owners_of(steps), stop, min_tokens) is not None:
            break
        live = max(
            k
            for k in range(len(fed) + 1)
            if any(s.startswith(fed[len(fed) - k :]) and len(s) > k for s in stop)
        )
        assert emitted == len(fed) - live


def test_a_partial_stop_is_released_when_it_breaks() -> None:
    matcher = StopMatcher(["<b>"])
    assert matcher.feed([content(0, "a<")]) == [content(0, "a")]
    assert matcher.held_from == 0
    assert matcher.feed([content(1, "c")]) == [content(0, "<"), content(1, "c")]
    assert matcher.held_from is None


def test_a_completed_match_does_not_wait_for_an_earlier_longer_candidate() -> None:
    """ "bc" completes first; "abcd", which started earlier, might still
    complete, but the output ends on the token that completed "bc", as
    OpenAI's API and vLLM end it."""
    matcher = StopMatcher(["abcd", "bc"])
    out = matcher.feed([content(0, "xab"), content(1, "cd")])
    assert route(out).content == "xa"
    assert out[-1] == dropped(1, "d", None)
    assert matcher.matched == "bc"


def test_matches_completing_together_cut_at_the_longest() -> None:
    matcher = StopMatcher(["b", "ab"])
    assert route(matcher.feed([content(0, "xa"), content(1, "b")])).content == "x"
    assert matcher.matched == "ab"


def test_everything_after_the_match_is_dropped() -> None:
    matcher = StopMatcher(["STOP"], include_stop_str_in_output=True)
    out = matcher.feed([content(0, "aSTOPb")])
    assert out == [content(0, "a"), content(0, "STOP"), dropped(0, "b", None)]
    assert matcher.feed([content(1, "more")]) == [dropped(1, "more", None)]
    assert matcher.finish() == []


def test_min_tokens_ignores_matches_completing_early() -> None:
    matcher = StopMatcher(["ab"], min_tokens=2)
    out = matcher.feed([content(0, "ab")]) + matcher.feed([content(1, "a")])
    out += matcher.feed([content(2, "b")])
    assert route(out).content == "ab"
    assert matcher.matched == "ab"


def test_reasoning_passes_untouched_unless_asked() -> None:
    text = "<think>no STOP here</think>answer STOP tail"
    reasoning = route(run_whole([qwen3(), StopMatcher(["STOP"])], text).events)
    assert (reasoning.reasoning, reasoning.content) == ("no STOP here", "answer ")
    inside = route(
        run_whole([qwen3(), StopMatcher(["STOP"], match_in_reasoning=True)], text).events
    )
    assert (inside.reasoning, inside.content) == ("no ", "")


@settings(max_examples=examples(150), deadline=None)
@given(
    reasoning=st.text(alphabet="abST<>/", max_size=20),
    answer=st.text(alphabet="abST<>/", max_size=20),
    stop=st.lists(st.sampled_from(["ST", "S", "aT", "b/", "T>a"]), min_size=1, max_size=3),
    in_reasoning=st.booleans(),
    cuts=st.sets(st.integers(1, 60)),
)
def test_stop_in_reasoning_matches_each_channel_separately(
    reasoning: str, answer: str, stop: list[str], in_reasoning: bool, cuts: set[int]
) -> None:
    text = f"<think>{reasoning}</think>{answer}"
    steps = token_spans(tokenize(text.encode(), cuts))
    stages = [qwen3(), StopMatcher(stop, match_in_reasoning=in_reasoning)]
    routed = route(run_chain(stages, steps).events)
    ref_r, ref_c = ref_reasoning(text, starts_in_reasoning=False)
    hit = ref_stop(ref_r, [0] * len(ref_r), stop) if in_reasoning else None
    if hit is not None:
        assert (routed.reasoning, routed.content) == (ref_r[: hit[0]], "")
        return
    cut = ref_stop(ref_c, [0] * len(ref_c), stop)
    assert routed.reasoning == ref_r
    assert routed.content == (ref_c if cut is None else ref_c[: cut[0]])


@pytest.mark.parametrize(
    ("stop", "options", "message"),
    [
        ([], {}, "between 1 and 16 stop strings are allowed"),
        ([""], {}, "stop strings must be non-empty strings"),
        (["x"] * 17, {}, "between 1 and 16 stop strings are allowed"),
        ("abc", {}, "stop must be a sequence of strings, not one string"),
        (["x"], {"min_tokens": -1}, "min_tokens must not be negative"),
    ],
)
def test_invalid_options_raise(stop: list[str], options: dict[str, int], message: str) -> None:
    # The message is the client's 400 (the surfaces pass it on).
    with pytest.raises(InvalidStopError, match=f"^{message}$"):
        StopMatcher(stop, **options)


def test_sixteen_stop_strings_are_allowed() -> None:
    assert StopMatcher([f"s{i}" for i in range(16)]).matched is None


def test_a_match_concludes_at_once_when_no_candidate_starts_before_it() -> None:
    """ "ab" is complete; "abc" starts where it does, so it cannot end the
    output earlier: "ab" ends it now, nothing held, no empty span after it."""
    matcher = StopMatcher(["ab", "abc"])
    assert matcher.feed([content(0, "xab")]) == [content(0, "x"), dropped(0, "ab", None)]
    assert matcher.matched == "ab"
    assert matcher.held_from is None


def test_passing_event_ends_a_candidate() -> None:
    matcher = StopMatcher(["ab"])
    out = matcher.feed([content(0, "a"), dropped(1, "<x>", Channel.REASONING), content(2, "b")])
    assert route(out).content == "ab"
    assert matcher.matched is None


def test_after_the_match_upstream_markup_keeps_its_label() -> None:
    matcher = StopMatcher(["x"], match_in_reasoning=True)
    out = matcher.feed(
        [Span(0, "ax", Channel.REASONING), dropped(1, "</think>", Channel.REASONING)]
    )
    assert out[-1] == dropped(1, "</think>", Channel.REASONING)
    assert matcher.feed([content(2, "b")]) == [dropped(2, "b", None)]


def test_a_pipeline_a_stop_string_ended_refuses_more_tokens() -> None:
    table = TokenTable((b"a", b"STOP", b"b"), frozenset())
    matcher = StopMatcher(["STOP"])
    pipeline = ChoicePipeline(table, [matcher], stop=matcher)
    pipeline.feed(0)
    pipeline.feed(1)
    assert pipeline.stopped_by == "STOP"
    with pytest.raises(RuntimeError, match=r"^the pipeline was fed after a stop string ended it$"):
        pipeline.feed(2)


def test_after_the_match_passed_through_text_is_dropped_too() -> None:
    """A channel the matcher does not handle (reasoning, here) is removed
    after the stop string as well, as its own token's dropped text."""
    matcher = StopMatcher(["STOP"])
    matcher.feed([content(0, "aSTOP")])
    thought = Span(1, "r", Channel.REASONING)
    marked = dropped(2, "</think>", Channel.REASONING)
    assert matcher.feed([thought, marked, content(3, "")]) == [dropped(1, "r", None), marked]


def test_a_channel_change_releases_what_was_held_in_the_old_one() -> None:
    matcher = StopMatcher(["STOP"], match_in_reasoning=True)
    assert matcher.feed([Span(0, "aST", Channel.REASONING)]) == [Span(0, "a", Channel.REASONING)]
    assert matcher.feed([content(1, "OPx")]) == [
        Span(0, "ST", Channel.REASONING),
        content(1, "OPx"),
    ]
    assert matcher.matched is None


def test_a_match_in_the_reasoning_drops_the_content_after_it() -> None:
    """ "bc" ends the output inside the reasoning; the reasoning's markup
    keeps its label and the content after it is dropped."""
    matcher = StopMatcher(["abcd", "bc"], match_in_reasoning=True)
    out = matcher.feed([Span(0, "xabc", Channel.REASONING)])
    assert route(out).reasoning == "xa"
    assert out[-1] == dropped(0, "bc", None)
    assert matcher.feed([content(1, "d!")]) == [dropped(1, "d!", None)]
    assert matcher.matched == "bc"
