"""The engine's thread count, chosen by timing steps (``ThreadTuner``)."""

from __future__ import annotations

import itertools
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


#: Tuners made by ``tuner_of`` settle for one step after a switch: any step
#: outlasts this. (The tests of the settling itself use the default.)
ONE_STEP = 1e-9
SETTLE = 1
#: Steps a full check takes (a clear one ends sooner): blocks on each
#: count, a settling step before every block but the first.
CHECK = 2 * thread_tuner.PAIRS * (thread_tuner.BLOCK + SETTLE) - SETTLE


def tuner_of(most: int) -> ThreadTuner:
    return ThreadTuner(most, settle_seconds=ONE_STEP)


def test_a_faster_count_replaces_all_cores_after_one_check() -> None:
    tuner = tuner_of(2)
    used = run(tuner, [16] * 400, faster_on(1))
    # The first step has no step before it to compare rows with, the second
    # ends the (empty) hold; then the check's blocks take turns.
    first = 2 + thread_tuner.BLOCK
    assert used[:first] == [2] * first
    assert used[first : first + SETTLE + thread_tuner.BLOCK] == [1] * (SETTLE + thread_tuner.BLOCK)
    assert used[2 + CHECK :][:50] == [1] * 50
    assert tuner.choices == {16: 1}
    # Later checks time all cores again, and keep the one thread.
    assert 2 in used[2 + CHECK :]
    assert used[-1] == 1


def test_all_cores_stay_when_they_are_faster_and_checks_grow_rare() -> None:
    tuner = tuner_of(4)
    used = run(tuner, [8] * 20_000, faster_on(4))
    assert tuner.choices == {8: 4}
    assert set(used) == {3, 4}
    # Holds double from FIRST_HOLD_SECONDS up to LONGEST_HOLD_SECONDS: the
    # slower count runs a window per check, a small share of the steps.
    assert used.count(3) / len(used) < 0.03
    assert used[-2000:].count(3) <= CHECK // 2 + 1


def decided_on_all_cores() -> ThreadTuner:
    """A tuner whose first check (batches of 4) chose both threads."""
    tuner = tuner_of(2)
    run(tuner, [4] * 300, faster_on(2))
    assert tuner.choices == {4: 2}
    return tuner


def test_a_difference_inside_the_margin_keeps_a_checked_choice() -> None:
    tuner = decided_on_all_cores()
    # 4 ms a step: 40 s, checks at 8 s and 24 s after the first.
    used = run(tuner, [4] * 10_000, faster_on(1, share=thread_tuner.MARGIN / 3))
    assert 1 in used
    assert tuner.choices == {4: 2}


def test_the_first_check_takes_the_faster_median_however_small_the_lead() -> None:
    """The count a bucket starts on is a default, not a finding: its first
    check does not ask the other count for a margin."""
    tuner = tuner_of(2)
    used = run(tuner, [4] * 300, faster_on(1, share=thread_tuner.MARGIN / 3))
    assert tuner.choices == {4: 1}
    assert used[2 + CHECK :][:50] == [1] * 50


def test_a_count_that_wins_only_some_pairs_is_not_taken() -> None:
    """A host that slows down for a while makes one count look faster in
    the blocks it happened to run in; replacing a checked choice needs the
    pairs to agree, not only their median."""
    tuner = decided_on_all_cores()
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

    used = run(tuner, [4] * 10_000, cost)
    assert used.count(1) >= 2 * thread_tuner.PAIRS * thread_tuner.BLOCK  # two checks
    assert tuner.choices == {4: 2}


def test_each_batch_size_bucket_chooses_for_itself() -> None:
    def cost(rows: int, threads: int) -> float:
        best = 1 if rows < 8 else 2
        return 1e-3 * (1 if threads == best else 1.5)

    tuner = tuner_of(2)
    run(tuner, [1] * 300 + [16] * 300 + [3] * 300, cost)
    assert tuner.choices == {1: 1, 2: 1, 16: 2}
    assert tuner.threads_for(1) == 1
    assert tuner.threads_for(31) == 2


def test_steps_that_are_not_steady_are_not_timed() -> None:
    """A prefill, a cache edit or a batch that just changed size says
    nothing about the decode rate: even absurd times there move nothing."""
    tuner = tuner_of(2)
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

    tuner = tuner_of(most)
    used = run(tuner, [rows] * 3000, cost)
    assert tuner.choices == {1 << (rows.bit_length() - 1): best}
    assert used[-1000:].count(best) >= 1000 - 2 * CHECK


def lingering_switch() -> Cost:
    """Steps whose time after a switch lags the count, as measured on the
    tiny model at concurrency 1 (2 cores, ms): one thread is the faster in
    steady steps (3.15 against 3.95), but it pays 4.0 ms for its first 10
    steps after two threads ran, while two threads run their first 2 steps
    at 3.4 on the core one thread left quiet."""
    last = [0]
    since = [0]

    def cost(_rows: int, threads: int) -> float:
        since[0] = since[0] + 1 if threads == last[0] else 0
        last[0] = threads
        if threads == 1:
            return 4.0e-3 if since[0] < 10 else 3.15e-3
        return 3.4e-3 if since[0] < 2 else 3.95e-3

    return cost


def test_a_switch_settles_before_its_steps_are_timed() -> None:
    tuner = ThreadTuner(2)
    used = run(tuner, [1] * 3000, lingering_switch())
    assert tuner.choices == {1: 1}
    # Two threads run only in checks: four blocks, each after ~26 steps
    # (0.1 s) of settling.
    assert used[-1000:].count(2) <= thread_tuner.PAIRS * (27 + thread_tuner.BLOCK)
    # Timed from the step after the switch, the same steps read two threads
    # as the faster: the choice the tuner made before it settled by time.
    hasty = tuner_of(2)
    run(hasty, [1] * 3000, lingering_switch())
    assert hasty.choices == {1: 2}


def test_the_settling_is_measured_in_seconds_of_steps() -> None:
    tuner = ThreadTuner(2, settle_seconds=0.1)
    used = run(tuner, [16] * 200, faster_on(1, share=0.0))  # 16 ms a step
    first = 2 + thread_tuner.BLOCK
    # Seven steps (112 ms) on the new count go untimed, then its block.
    assert used[first : first + 7 + thread_tuner.BLOCK] == [1] * (7 + thread_tuner.BLOCK)
    assert used[first + 7 + thread_tuner.BLOCK] == 2


def test_a_new_bucket_starts_on_its_nearest_decided_neighbour_and_holds() -> None:
    """Once a check has ended, a new bucket is not checked at once: it
    starts on the nearest decided bucket's count and is checked after a
    first hold, so a load whose batch moves between buckets does not pay a
    check per bucket."""
    tuner = tuner_of(2)
    run(tuner, [1] * 300, faster_on(1))
    assert tuner.choices == {1: 1}
    per_step = 5 * 1e-3  # five rows, one thread
    held = round(thread_tuner.FIRST_HOLD_SECONDS / per_step)
    used = run(tuner, [5] * (held + 200), faster_on(1))
    assert used[: held + 1] == [1] * (held + 1)
    assert 2 in used[held + 1 :]  # then checked all the same
    assert tuner.choices == {1: 1, 4: 1}
    # The nearest decided bucket: batches of 20 follow those of 40, not 1.
    tuner2 = tuner_of(2)
    run(tuner2, [1] * 300, faster_on(1))
    run(tuner2, [40] * 300, faster_on(2))
    assert tuner2.choices == {1: 1, 32: 2}
    assert run(tuner2, [20] * 5, faster_on(2)) == [2] * 5


def checks_after_the_first(used: list[int], kept: int) -> tuple[int, int]:
    """Checks that moved off ``kept`` after a hold (a long run on it), and
    the blocks they ran on the other count."""
    runs = [(count, len(list(group))) for count, group in itertools.groupby(used)]
    starts = [i for i in range(1, len(runs)) if runs[i - 1][0] == kept and runs[i - 1][1] > 100]
    first = starts[0] if starts else len(runs)
    blocks = sum(1 for count, _ in runs[first:] if count != kept)
    return len(starts), blocks


@pytest.mark.parametrize(("share", "checks", "pairs"), [(0.05, 4, 4), (0.5, 2, 2)])
def test_a_clear_check_ends_early_and_waits_longer(share: float, checks: int, pairs: int) -> None:
    """Every pair beyond several margins, on the same side, ends a check
    after two pairs and grows the hold fourfold, not twofold: fewer and
    shorter checks, each of which runs half its blocks on the slower count."""
    tuner = tuner_of(2)
    used = run(tuner, [4] * 15_000, faster_on(1, share=share))  # 4 ms a step: 60 s
    assert tuner.choices == {4: 1}
    # After the change, checks at 2, 6, 14 and 30 s (doubling holds) or, if
    # clear, at 4 and 20 s (a change holds 4 s, then fourfold).
    assert checks_after_the_first(used, 1) == (checks, checks * pairs)


@pytest.mark.parametrize(("share", "pairs"), [(0.05, 4), (0.5, 2)])
def test_the_first_check_ends_after_two_pairs_when_clear(share: float, pairs: int) -> None:
    tuner = tuner_of(2)
    used = run(tuner, [4] * 400, faster_on(1, share=share))  # the first hold is longer
    assert tuner.choices == {4: 1}
    # It starts on two threads: one block there per pair.
    assert [count for count, _ in itertools.groupby(used)].count(2) == pairs
