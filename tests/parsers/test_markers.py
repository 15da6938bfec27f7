"""MarkerSet / MarkerScanner / HeldText: the Aho-Corasick core every stage reuses."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sluiceway.parsers.markers import (
    INITIAL_STATE,
    HeldText,
    MarkerFound,
    MarkerScanner,
    MarkerSet,
    OwnedText,
    ScanEvent,
)

from .harness import examples

MARKERS = st.lists(st.text(alphabet="ab<>/", min_size=1, max_size=5), min_size=1, max_size=4)
TEXTS = st.text(alphabet="ab<>/c", max_size=40)


def _longest_marker_prefix_suffix(text: str, markers: list[str]) -> int:
    return max(
        (
            k
            for k in range(len(text) + 1)
            if any(m.startswith(text[len(text) - k :]) for m in markers)
        ),
        default=0,
    )


def test_rejects_empty_markers() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        MarkerSet([])
    with pytest.raises(ValueError, match="non-empty"):
        MarkerSet(["a", ""])


def test_matched_is_the_longest_marker_suffix() -> None:
    markers = MarkerSet(["abcd", "bc", "c"])
    state = INITIAL_STATE
    for char in "abc":
        state = markers.step(state, char)
    assert markers.matched(state) == "bc"
    assert markers.depth(state) == 3
    assert markers.live_depth(state) == 3  # "abc" can still become "abcd"
    state = markers.step(state, "d")
    assert markers.matched(state) == "abcd"
    assert markers.live_depth(state) == 0  # nothing extends "abcd"


@settings(max_examples=examples(100), deadline=None)
@given(markers=MARKERS, text=TEXTS)
def test_automaton_depth_is_longest_suffix_that_is_a_marker_prefix(
    markers: list[str], text: str
) -> None:
    automaton = MarkerSet(markers)
    state = INITIAL_STATE
    for end in range(1, len(text) + 1):
        state = automaton.step(state, text[end - 1])
        assert automaton.depth(state) == _longest_marker_prefix_suffix(text[:end], markers)
        found = automaton.matched(state)
        suffixes = [m for m in markers if text[:end].endswith(m)]
        assert found == (max(suffixes, key=len) if suffixes else None)
        live = max(
            (
                k
                for k in range(end + 1)
                if any(m.startswith(text[end - k : end]) and len(m) > k for m in markers)
            ),
            default=0,
        )
        assert automaton.live_depth(state) == live


def _scan_all(markers: list[str], pieces: list[str]) -> list[ScanEvent]:
    scanner = MarkerScanner(MarkerSet(markers))
    events: list[ScanEvent] = []
    for token, piece in enumerate(pieces):
        events += scanner.feed(token, piece)
    return events + list(scanner.finish())


def _reference_split(markers: list[str], text: str) -> list[str | tuple[str]]:
    """Left to right, the first marker to complete (the longest such) is taken whole."""
    out: list[str | tuple[str]] = []
    plain = ""
    position = 0
    while position < len(text):
        ends = [
            (start + len(m), -len(m), m)
            for m in markers
            for start in [text.find(m, position)]
            if start >= 0
        ]
        if not ends:
            break
        end, _, marker = min(ends)
        plain += text[position : end - len(marker)]
        out.extend([plain, (marker,)] if plain else [(marker,)])
        plain = ""
        position = end
    plain += text[position:]
    if plain:
        out.append(plain)
    return out


def _merge(events: list[ScanEvent]) -> list[str | tuple[str]]:
    out: list[str | tuple[str]] = []
    for event in events:
        if isinstance(event, MarkerFound):
            assert "".join(p.text for p in event.pieces) == event.marker
            out.append((event.marker,))
        elif out and isinstance(out[-1], str):
            out[-1] += event.text
        else:
            out.append(event.text)
    return out


@settings(max_examples=examples(200), deadline=None)
@given(markers=MARKERS, text=TEXTS, cuts=st.sets(st.integers(1, 39)))
@example(markers=["<think>"], text="a<b<think>c", cuts={2})
@example(markers=["ab", "b"], text="ab", cuts=set())
def test_scanner_splits_like_the_reference_under_any_split(
    markers: list[str], text: str, cuts: set[int]
) -> None:
    bounds = [0, *sorted(c for c in cuts if c < len(text)), len(text)]
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    events = _scan_all(markers, pieces)
    assert _merge(events) == _reference_split(markers, text)
    # Owners: every character keeps the token of the piece it came in.
    owners = [token for token, piece in enumerate(pieces) for _ in piece]
    out_owners: list[int] = []
    for event in events:
        for piece in event.pieces if isinstance(event, MarkerFound) else (event,):
            out_owners.extend([piece.token] * len(piece.text))
    assert out_owners == owners


def test_scanner_holds_only_a_possible_marker_start() -> None:
    scanner = MarkerScanner(MarkerSet(["<think>"]))
    assert scanner.feed(0, "a<") == [OwnedText(0, "a")]
    assert scanner.held_from == 0
    assert scanner.holding  # one character held is holding
    assert scanner.feed(1, "b") == [OwnedText(0, "<"), OwnedText(1, "b")]
    assert scanner.held_from is None
    assert not scanner.holding


def test_scan_stops_after_the_first_marker() -> None:
    scanner = MarkerScanner(MarkerSet(["</think>"]))
    events, position = scanner.scan(3, "ab</think></think>x")
    assert position == len("ab</think>")
    assert events == [OwnedText(3, "ab"), MarkerFound("</think>", (OwnedText(3, "</think>"),))]


def test_held_text_take_merges_per_owner_and_is_linear() -> None:
    held = HeldText()
    for char in "abc":
        held.append(1, char)
    held.append(2, "de")
    held.append(2, "")
    assert held.length == 5
    assert held.first_owner == 1
    assert held.take(4) == [OwnedText(1, "abc"), OwnedText(2, "d")]
    assert held.take_all() == [OwnedText(2, "e")]
    assert not held
    held.append(-1, "x")
    held.append(4, "y")
    assert held.first_owner_at_least(0) == 4


def test_a_marker_set_needs_non_empty_markers() -> None:
    for markers in ([], [""], ["<a>", ""]):
        with pytest.raises(
            ValueError, match=r"^markers must be a non-empty collection of non-empty strings$"
        ):
            MarkerSet(markers)


def test_skip_to_candidate_stops_only_where_a_marker_can_begin() -> None:
    markers = MarkerSet(["<a>", "[b]"])
    assert markers.skip_to_candidate("xyXz<", 0) == 4
    assert markers.skip_to_candidate("x[y", 0) == 1
    assert markers.skip_to_candidate("x[y", 2) == 3
    assert markers.skip_to_candidate("plain, X-rated", 0) == 14
