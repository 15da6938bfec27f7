"""The filters a sampled row's weights go through (``top_k``, ``min_p``,
``top_p``), held to their definitions in exact arithmetic."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sluiceway.actors.cdf import CDF_BLOCK
from sluiceway.actors.filters import weights
from sluiceway.protocol.messages import SamplingParams

_VOCABS = st.sampled_from([1, 2, 7, CDF_BLOCK, CDF_BLOCK + 1, 3 * CDF_BLOCK + 7])


def _logits(rows: int, vocab: int, seed: int, tied: bool) -> np.ndarray:
    noise = np.random.default_rng(seed)
    logits = (noise.standard_normal((rows, vocab)) * 3).astype(np.float32)
    return np.round(logits) if tied else logits


@settings(max_examples=150, deadline=None)
@given(
    vocab=_VOCABS,
    top_ps=st.lists(
        st.sampled_from([0.0, 0.5, 0.9, 1 - 2**-20]) | st.floats(0, 1, exclude_max=True),
        min_size=1,
        max_size=5,
    ),
    tied=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_the_nucleus_is_the_smallest_heaviest_first_set_reaching_top_p(
    vocab: int, top_ps: list[float], tied: bool, seed: int
) -> None:
    """Each row keeps a prefix of its ids ordered heaviest first, ties by
    the lower id; the prefix's mass reaches ``top_p`` of the row's, and
    without its last id it does not, in exact sums to within float64
    rounding. Kept weights are untouched, the others zero."""
    x = _logits(len(top_ps), vocab, seed, tied)
    shaped, peaks = weights(x.copy(), [SamplingParams(top_p=p) for p in top_ps])
    full = np.exp(x - peaks[:, None])
    for row, top_p in enumerate(top_ps):
        order = np.argsort(-full[row], kind="stable").tolist()
        kept = np.flatnonzero(shaped[row] > 0).tolist()
        assert sorted(order[: len(kept)]) == kept
        assert np.array_equal(shaped[row, kept], full[row, kept])
        mass = [Fraction(float(full[row, i])) for i in order[: len(kept)]]
        total = sum((Fraction(float(w)) for w in full[row]), Fraction(0))
        target = Fraction(top_p) * total
        slack = total * Fraction(1, 10**12)
        assert sum(mass, Fraction(0)) >= target - slack
        assert sum(mass[:-1], Fraction(0)) < target + slack


@settings(max_examples=100, deadline=None)
@given(
    vocab=_VOCABS,
    ks=st.lists(st.integers(0, 3 * CDF_BLOCK + 8), min_size=1, max_size=5),
    min_p=st.sampled_from([0.0, 0.01, 0.3, 1.0]),
    tied=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_top_k_keeps_the_k_largest_and_their_ties_and_min_p_cuts_relative_to_the_peak(
    vocab: int, ks: list[int], min_p: float, tied: bool, seed: int
) -> None:
    """Rows with different ``k`` side by side: a row keeps every id whose
    logit is at least its k-th largest (all when k is 0 or at least the
    vocabulary), and of those every id whose weight relative to the peak is
    at least ``min_p``."""
    x = _logits(len(ks), vocab, seed, tied)
    shaped, _ = weights(x.copy(), [SamplingParams(top_k=k, min_p=min_p) for k in ks])
    for row, k in enumerate(ks):
        logits = x[row]
        kth = np.sort(logits)[::-1][k - 1] if 0 < k < vocab else -np.inf
        relative = np.exp(logits - logits.max())
        expected = (logits >= kth) & (relative >= np.float32(min_p))
        assert np.array_equal(shaped[row] > 0, expected)
        assert expected[logits.argmax()]  # the peak always stays


def test_a_nucleus_that_reaches_top_p_exactly_stops_there() -> None:
    """Four equal weights: half of the mass is reached by the first two ids,
    and the lower ids are the ones kept."""
    for top_p, kept in [(0.0, [0]), (0.25, [0]), (0.5, [0, 1]), (0.5000001, [0, 1, 2])]:
        shaped, _ = weights(np.zeros((1, 4), dtype=np.float32), [SamplingParams(top_p=top_p)])
        assert np.flatnonzero(shaped[0]).tolist() == kept
