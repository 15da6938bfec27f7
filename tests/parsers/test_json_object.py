"""The object guard: whatever the text and however it is split, what goes out
is one JSON object; a well-formed object goes out unchanged."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from sluiceway.parsers.json_object import ObjectGuard

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=12,
)
OBJECTS = st.dictionaries(st.text(max_size=5), JSON_VALUES, max_size=5)


def guarded(pieces: list[str]) -> str:
    guard = ObjectGuard()
    return "".join(guard.feed(piece) for piece in pieces) + guard.finish()


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(cut, len(text)) for cut in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


@given(OBJECTS, st.sampled_from([None, 0, 2]), st.lists(st.integers(0, 400), max_size=8))
def test_an_object_passes_through_unchanged(
    value: dict[str, Any], indent: int | None, cuts: list[int]
) -> None:
    text = json.dumps(value, indent=indent, ensure_ascii=bool(cuts and cuts[0] % 2))
    assert guarded(split(text, cuts)) == text


@given(st.text(alphabet=st.sampled_from('{}[]",:\\ \n\tutrenfal0-1.eE+xyzT'), max_size=40))
@example('{"a": [1, {"b": "c\\')
@example('{"a": 1,  ')
@example('{"k"')
@example("[1, 2]")
@example('{"a": tru')
@example('{"a": -')
def test_anything_becomes_one_object_whatever_the_split(text: str) -> None:
    whole = guarded([text])
    assert isinstance(json.loads(whole), dict)
    assert guarded(list(text)) == whole  # one character at a time


@given(OBJECTS, st.integers(0, 400))
def test_a_cut_off_object_is_closed_around_its_prefix(value: dict[str, Any], cut: int) -> None:
    text = json.dumps(value)
    guard = ObjectGuard()
    let_out = guard.feed(text[:cut])
    assert text.startswith(let_out)  # a valid prefix goes out as it is, held parts aside
    assert isinstance(json.loads(let_out + guard.finish()), dict)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"code": "a\nb"}', {"code": "a\nb"}),  # a raw newline, escaped on the way
        ('{"path": "C:\\dir"}', {"path": "C:\\dir"}),  # not an escape: a backslash
        ('{"u": "\\u00e9\\u12g"}', {"u": "é\\u12g"}),
        ('{"city": "Par', {"city": "Par"}),  # cut off by max_tokens
        ('{"a": [1, 2.', {"a": [1, 2.0]}),
        ('{"a": 1, "b', {"a": 1, "b": None}),
        ('{"a": 1, ', {"a": 1}),  # a dangling comma is dropped
        ('{"a": tr', {"a": True}),
        ('{"a": True}', {"a": None}),  # Python's spelling: cut where it stops being JSON
        ("{'a': 1}", {}),
        ('{"a": 1} and more', {"a": 1}),
        ('["not", "an object"]', {}),
        ("", {}),
    ],
)
def test_repairs(text: str, expected: dict[str, Any]) -> None:
    assert json.loads(guarded([text])) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # Numbers: JSON's grammar, cut where it stops, completed where it cannot end.
        ('{"a": 01}', '{"a": 0}'),  # no leading zero: the "1" is trailing text
        ('{"a": -01}', '{"a": -0}'),
        ('{"a": -x}', '{"a": -0}'),  # a sign needs a digit
        ('{"a": 1.x}', '{"a": 1.0}'),  # a point needs a digit
        ('{"a": 1E5}', '{"a": 1E5}'),
        ('{"a": 1e+5}', '{"a": 1e+5}'),
        ('{"a": 1X}', '{"a": 1}'),
        ('{"a": 1eX}', '{"a": 1e0}'),  # an exponent needs a digit
        ('{"a": 1e5-}', '{"a": 1e5}'),  # a sign only right after the "e"
        # A literal cut by a character it does not have is completed; what
        # follows is read on.
        ('{"a": tru, "b": 1}', '{"a": true, "b": 1}'),
        ('{"a": [nul]}', '{"a": [null]}'),
        # Where a colon, a comma or a close must come and does not (the
        # whitespace before went out already).
        ('{"a" 1}', '{"a" : null}'),
        ('{"a": 1 2}', '{"a": 1 }'),
        ('{"a": [1 x]}', '{"a": [1 ]}'),
        # Control characters: the short escapes where JSON has one, else \u.
        ('{"c": "a\nb\tc"}', '{"c": "a\\nb\\tc"}'),
        ('{"c": "\x01\x1f"}', '{"c": "\\u0001\\u001f"}'),
        # A \u escape takes exactly four hex digits.
        ('{"u": "\\u12u1"}', '{"u": "\\\\u12u1"}'),
        ('{"u": "\\u00e9x"}', '{"u": "\\u00e9x"}'),
    ],
)
def test_repairs_to_the_letter(text: str, expected: str) -> None:
    assert guarded([text]) == expected
    assert guarded(list(text)) == expected
    json.loads(expected)


def test_a_finished_guard_closes_once() -> None:
    guard = ObjectGuard()
    assert guard.feed('{"a": [1') == '{"a": [1'
    assert guard.finish() == "]}"
    assert guard.finish() == ""
