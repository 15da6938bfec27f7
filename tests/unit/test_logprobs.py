"""The logprob reducer against a plain log-softmax."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from sluiceway.actors import logprobs
from sluiceway.actors.logprobs import (
    LOGPROB_FLOOR,
    reduce_prompt,
    reduce_rows,
    top_k,
    top_k_rows,
)
from sluiceway.protocol.messages import LogprobParams


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


finite_rows = arrays(
    np.float32,
    st.tuples(st.integers(1, 4), st.integers(2, 40)),
    elements=st.floats(-30, 30, width=32),
)


@settings(max_examples=60, deadline=None)
@given(logits=finite_rows, k=st.integers(0, 20), data=st.data())
def test_matches_log_softmax(logits: np.ndarray, k: int, data: st.DataObject) -> None:
    rows, vocab = logits.shape
    chosen = [data.draw(st.integers(0, vocab - 1)) for _ in range(rows)]
    asked = [data.draw(st.booleans()) for _ in range(rows)]
    requested = tuple(data.draw(st.lists(st.integers(0, vocab - 1), max_size=3)))
    params = [LogprobParams(top=k, token_ids=requested) if a else LogprobParams() for a in asked]
    result = reduce_rows(logits, chosen, params)
    reference = log_softmax(logits)
    for i in range(rows):
        entry = result[i]
        if not asked[i]:
            assert entry is None
            continue
        assert entry is not None
        assert abs(entry.logprob - reference[i, chosen[i]]) < 1e-4
        assert len(entry.top) == min(k, vocab)
        values = [v for _, v in entry.top]
        assert values == sorted(values, reverse=True)
        for token, value in entry.top:
            assert abs(value - reference[i, token]) < 1e-4
        if entry.top:
            assert abs(entry.top[0][1] - reference[i].max()) < 1e-4
        assert [t for t, _ in entry.requested] == list(requested)


def test_minus_infinity_is_clamped() -> None:
    logits = np.array([[0.0, -np.inf, 1.0]], dtype=np.float32)
    (entry,) = reduce_rows(logits, [1], [LogprobParams(top=3)])
    assert entry is not None
    assert entry.logprob == LOGPROB_FLOOR
    assert entry.top[-1] == (1, LOGPROB_FLOOR)


@settings(max_examples=60, deadline=None)
@given(
    rows=finite_rows,
    nan_share=st.sampled_from([0.05, 0.5, 1.0]),
    sick=st.integers(0, 3),
    k=st.integers(1, 6),
    seed=st.integers(0, 1000),
)
def test_a_nan_logit_floors_and_ranks_last_without_breaking_the_step(
    rows: np.ndarray, nan_share: float, sick: int, k: int, seed: int
) -> None:
    """A model's overflow can put NaN in a row's logits. The step's other
    rows keep exactly their entries, and the sick row still gets ``k``
    alternatives: its NaN ids as -inf (floored, ranked after every number),
    its other ids as if the NaNs were -inf."""
    sick %= rows.shape[0]
    noise = np.random.default_rng(seed)
    sick_row = rows[sick].copy()
    sick_row[noise.random(sick_row.shape) < nan_share] = np.nan
    step = rows.copy()
    step[sick] = sick_row
    ids = [int(i) for i in noise.integers(0, rows.shape[1], rows.shape[0])]
    params = [LogprobParams(top=k)] * rows.shape[0]
    as_minus_inf = np.where(np.isnan(sick_row), -np.inf, sick_row)[None]
    with np.errstate(invalid="ignore", divide="ignore"):  # a row all NaN: all -inf
        got = reduce_rows(step, ids, params)
        (sick_alone,) = reduce_rows(as_minus_inf, ids[sick : sick + 1], params[:1])
    clean = reduce_rows(rows, ids, params)
    for index, entry in enumerate(got):
        assert entry == (sick_alone if index == sick else clean[index])
        assert entry is not None
        assert len(entry.top) == min(k, rows.shape[1])


def test_ties_break_by_lower_id() -> None:
    assert top_k(np.array([1.0, 2.0, 2.0, 0.0], dtype=np.float32), 3).tolist() == [1, 2, 0]


@pytest.mark.parametrize("whole_row", [True, False])
@settings(max_examples=100, deadline=None)
@given(
    row=arrays(
        np.float32,
        st.integers(1, 700),
        # A narrow value range forces many ties, which either path must keep.
        elements=st.one_of(
            st.integers(-3, 3).map(float), st.floats(-30, 30, width=32), st.just(-np.inf)
        ),
    ),
    k=st.integers(1, 25),
)
def test_top_k_equals_a_full_sort(whole_row: bool, row: np.ndarray, k: int) -> None:
    """Rows up to ``_WHOLE_ROW`` ids (a small model's vocabulary) take one
    selection over the whole row; longer ones the block-maximum path (the
    bound and the block are shrunk here so that short, quick rows reach
    it). Both keep the ties and the order of a full sort."""
    reference = np.lexsort((np.arange(row.shape[0]), -row))[:k]
    if whole_row:
        assert top_k(row, k).tolist() == reference.tolist()
        return
    with mock.patch.object(logprobs, "_WHOLE_ROW", 0), mock.patch.object(logprobs, "_BLOCK", 4):
        assert top_k(row, k).tolist() == reference.tolist()


@settings(max_examples=80, deadline=None)
@given(
    rows=arrays(
        np.float32,
        st.tuples(st.integers(1, 6), st.integers(1, 160)),
        elements=st.one_of(
            st.integers(-2, 2).map(float), st.floats(-30, 30, width=32), st.just(-np.inf)
        ),
    ),
    k=st.integers(1, 25),
)
def test_top_k_of_a_whole_step_equals_each_rows(rows: np.ndarray, k: int) -> None:
    """The batched selection keeps the per-row order, ties and -inf included,
    and any prefix of a row's list is that row's smaller top."""
    batched = top_k_rows(rows, k).tolist()
    assert batched == [top_k(row, k).tolist() for row in rows]
    shorter = min(k, 2)
    assert [ids[:shorter] for ids in batched] == [top_k(row, shorter).tolist() for row in rows]


def test_rows_asking_different_top_counts_share_one_step() -> None:
    logits = np.array([[0.0, 3.0, 1.0, 2.0], [4.0, 4.0, 0.0, 1.0]], dtype=np.float32)
    params = [LogprobParams(top=1), LogprobParams(top=3, token_ids=(2,))]
    first, second = reduce_rows(logits, [0, 3], params)
    assert first is not None
    assert second is not None
    assert [t for t, _ in first.top] == [1]
    assert [t for t, _ in second.top] == [0, 1, 3]
    assert [t for t, _ in second.requested] == [2]
    assert first.requested == ()


def test_prompt_logprobs_shift_by_one() -> None:
    logits = np.random.default_rng(0).normal(size=(4, 9)).astype(np.float32)
    prompt = [3, 1, 4, 1]
    entries = reduce_prompt(logits, prompt, top=2)
    assert entries[0] is None
    reference = log_softmax(logits)
    for position in range(1, 4):
        entry = entries[position]
        assert entry is not None
        assert abs(entry.logprob - reference[position - 1, prompt[position]]) < 1e-4
        assert len(entry.top) == 2
