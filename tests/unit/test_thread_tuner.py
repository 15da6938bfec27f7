"""The engine's thread count, chosen by timing steps (``ThreadTuner``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluiceway.actors import thread_tuner
from sluiceway.actors.thread_tuner import ThreadTuner

#: Seconds per row of a step, by (rows, threads).
Cost = Callable[[int, int], float]


def run(tuner: ThreadTuner, batches: Sequence[int], cost: Cost) -> list[int]:
    """Steady decode steps of ``batches`` rows; the thread count each ran on."""
    used: list[int] = []
    threads = 0
    for rows in batches:
        threads = tuner.threads_for(rows) or threads
        used.append(threads)
        tuner.observe(rows, cost(rows, threads) * rows, steady=True)
    return used


def faster_on(best: int, share: float = 0.2) -> Cost:
    return lambda rows, threads: 1e-3 * (1 if threads == best else 1 + share)


#: Steps one check takes: blocks on each count, a settling step before
#: every block but the first.
CHECK = 2 * thread_tuner.PAIRS * (thread_tuner.BLOCK + thread_tuner.SETTLE) - thread_tuner.SETTLE


def test_a_faster_count_replaces_all_cores_after_one_check() -> None:
    tuner = ThreadTuner(2)
    used = run(tuner, [16] * 400, faster_on(1))
    # The first step has no step before it to compare rows with, the second
    # ends the (empty) hold; then the check's blocks take turns.
    first = 2 + thread_tuner.BLOCK
    assert used[:first] == [2] * first
    assert used[first : first + thread_tuner.SETTLE + thread_tuner.BLOCK] == [1] * (
        thread_tuner.SETTLE + thread_tuner.BLOCK
    )
    assert used[2 + CHECK :][:50] == [1] * 50
    assert tuner.choices == {16: 1}
    # Later checks time all cores again, and keep the one thread.
    assert 2 in used[2 + CHECK :]
    assert used[-1] == 1


def test_all_cores_stay_when_they_are_faster_and_checks_grow_rare() -> None:
    tuner = ThreadTuner(4)
    used = run(tuner, [8] * 20_000, faster_on(4))
    assert tuner.choices == {8: 4}
    assert set(used) == {3, 4}
    # Holds double from FIRST_HOLD up to LONGEST_HOLD: the slower count runs
    # a window per check, a small share of the steps.
    assert used.count(3) / len(used) < 0.03
    assert used[-2000:].count(3) <= CHECK // 2 + 1


def test_a_difference_inside_the_margin_keeps_the_choice() -> None:
    tuner = ThreadTuner(2)
    run(tuner, [4] * 2000, faster_on(1, share=thread_tuner.MARGIN / 3))
    assert tuner.choices == {4: 2}


def test_a_count_that_wins_only_some_pairs_is_not_taken() -> None:
    """A host that slows down for a while makes one count look faster in
    the blocks it happened to run in; the choice needs the pairs to agree,
    not only their median."""
    tuner = ThreadTuner(2)
    blocks = [0]  # blocks run on one thread so far
    last = [2]

    def cost(_rows: int, threads: int) -> float:
        if threads == 1 and last[0] == 2:
            blocks[0] += 1
        last[0] = threads
        if threads == 2:
            return 1e-3
        # Half the pairs: one thread twice as fast; the others: 20% slower.
        return 0.5e-3 if blocks[0] % 2 == 1 else 1.2e-3

    run(tuner, [4] * 2000, cost)
    assert tuner.choices == {4: 2}


def test_each_batch_size_bucket_chooses_for_itself() -> None:
    def cost(rows: int, threads: int) -> float:
        best = 1 if rows < 8 else 2
        return 1e-3 * (1 if threads == best else 1.5)

    tuner = ThreadTuner(2)
    run(tuner, [1] * 300 + [16] * 300 + [3] * 300, cost)
    assert tuner.choices == {1: 1, 2: 1, 16: 2}
    assert tuner.threads_for(1) == 1
    assert tuner.threads_for(31) == 2


def test_steps_that_are_not_steady_are_not_timed() -> None:
    """A prefill, a cache edit or a batch that just changed size says
    nothing about the decode rate: even absurd times there move nothing."""
    tuner = ThreadTuner(2)
    for index in range(2000):
        rows = 6 + index % 2  # one bucket, a new size every step
        threads = tuner.threads_for(rows)
        tuner.observe(rows, 100.0 if threads == 2 else 1e-3, steady=True)
        tuner.observe(6, 100.0, steady=False)
        tuner.observe(6, 100.0, steady=False)
    assert tuner.choices == {4: 2}
    assert tuner.threads_for(0) == 0


def test_one_thread_leaves_nothing_to_choose() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        ThreadTuner(1)


@settings(max_examples=60, deadline=None)
@given(
    most=st.integers(2, 16),
    best_fewer=st.booleans(),
    share=st.floats(0.05, 2.0),
    noise=st.lists(st.floats(0.0, 0.02), min_size=1, max_size=7),
    rows=st.integers(1, 200),
)
def test_the_faster_count_wins_whatever_the_noise(
    most: int, best_fewer: bool, share: float, noise: list[float], rows: int
) -> None:
    """With a difference beyond the margin and noise under it, the faster
    count is chosen and, after the first checks, runs nearly every step."""
    best = most - 1 if best_fewer else most
    step = iter(range(10**9))

    def cost(_rows: int, threads: int) -> float:
        jitter = 1 + noise[next(step) % len(noise)]
        return 1e-3 * (1 if threads == best else 1 + share) * jitter

    tuner = ThreadTuner(most)
    used = run(tuner, [rows] * 3000, cost)
    assert tuner.choices == {1 << (rows.bit_length() - 1): best}
    assert used[-1000:].count(best) >= 1000 - 2 * CHECK
