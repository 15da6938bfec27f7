"""The engine's thread count, chosen by timing steps (``ThreadTuner``)."""

from __future__ import annotations

import itertools
import math
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


def block_steps(step_seconds: float) -> int:
    """Steps in a timed block, when each takes ``step_seconds``."""
    least = math.ceil(thread_tuner.BLOCK_SECONDS / step_seconds - 1e-9)
    return max(thread_tuner.BLOCK_STEPS, least)


def other_steps(step_seconds: float) -> int:
    """Steps a trial runs on the other count: a settling step, then its block."""
    return SETTLE + block_steps(step_seconds)


def tuner_of(most: int) -> ThreadTuner:
    return ThreadTuner(most, settle_seconds=ONE_STEP)


def test_a_faster_count_replaces_all_cores_after_one_check() -> None:
    tuner = tuner_of(2)
    used = run(tuner, [16] * 400, faster_on(1))
    # The first step has no step before it to compare rows with; the next
    # block of steps is the first trial's first reading, then the other
    # count's block and the choice's again; a second trial, of three blocks
    # of its own, confirms the win.
    block = block_steps(16e-3)  # 4 steps of 16 ms and of 19.2
    first = 1 + block
    assert used[:first] == [2] * first
    trial = [1] * (SETTLE + block) + [2] * (SETTLE + block)
    after = first + 2 * len(trial) + block
    assert used[first:after] == trial + [2] * block + trial
    assert used[after:][:50] == [1] * 50
    assert tuner.choices == {16: 1}
    # Later checks time all cores again, and keep the one thread.
    assert 2 in used[after + 50 :]
    assert used[-1] == 1


def test_all_cores_stay_when_they_are_faster_and_checks_grow_rare() -> None:
    tuner = tuner_of(4)
    used = run(tuner, [8] * 20_000, faster_on(4))
    assert tuner.choices == {8: 4}
    assert set(used) == {3, 4}
    # Holds grow from FIRST_HOLD_SECONDS up to LONGEST_HOLD_SECONDS: the
    # slower count runs one block per check, a small share of the steps.
    assert used.count(3) / len(used) < 0.01
    assert used[-2000:].count(3) <= other_steps(8 * 1.2e-3)


@pytest.mark.parametrize(("rows", "block"), [(1, 50), (4, 13), (64, 4)])
def test_a_block_covers_its_seconds_in_the_fewest_steps(rows: int, block: int) -> None:
    """50 ms of steps, and at least four: 50 steps of 1 ms, 13 of 4 ms, 4 of 64 ms."""
    tuner = tuner_of(2)
    used = run(tuner, [rows] * (4 * block + 10), faster_on(2, share=0.0))
    assert block_steps(rows * 1e-3) == block
    assert used[: 1 + block] == [2] * (1 + block)
    assert used[1 + block : 1 + block + SETTLE + block] == [1] * (SETTLE + block)
    assert used[1 + block + SETTLE + block] == 2


def test_a_difference_inside_the_margin_keeps_the_choice() -> None:
    tuner = tuner_of(2)
    run(tuner, [4] * 2000, faster_on(1, share=thread_tuner.MARGIN / 3))
    assert tuner.choices == {4: 2}


def blocks_on_one_thread(readings: Sequence[float]) -> Cost:
    """Two threads take 1 ms per row; one thread's n-th block (a run of
    steps on it) takes ``readings[n]`` (the last one from then on)."""
    blocks = [0]
    last = [2]

    def cost(_rows: int, threads: int) -> float:
        if threads == 1 and last[0] == 2:
            blocks[0] += 1
        last[0] = threads
        if threads == 2:
            return 1e-3
        return readings[min(blocks[0], len(readings)) - 1]

    return cost


def test_a_narrow_win_must_hold_in_a_second_trial() -> None:
    """A win is timed again, and the mean of both trials decides."""
    tuner = tuner_of(2)
    used = run(tuner, [4] * 2000, blocks_on_one_thread([0.95e-3, 1.2e-3]))
    assert tuner.choices == {4: 2}
    runs = [count for count, _ in itertools.groupby(used)]
    assert runs[:5] == [2, 1, 2, 1, 2]  # two trials in the first check


def test_a_burst_in_one_trial_does_not_switch() -> None:
    """However clear the first trial's win, a second one must not lose: a
    burst of load on the host during the count in use's blocks reads as a
    win for the other."""
    tuner = tuner_of(2)
    used = run(tuner, [4] * 6000, blocks_on_one_thread([0.5e-3, 1.2e-3]))
    assert tuner.choices == {4: 2}
    ones = [len(list(group)) for count, group in itertools.groupby(used) if count == 1]
    # The first block on one thread ran at 2 ms a step, the rest at 4.8.
    assert ones == [other_steps(2e-3)] + [other_steps(4.8e-3)] * (len(ones) - 1)


def test_the_second_trial_times_blocks_of_its_own() -> None:
    """A burst during the block that closes the first trial reads as a
    win for the other count; a second trial that opened with that block
    would read it again."""
    runs = [0]
    steps = [0]
    last = [2]
    burst = SETTLE + block_steps(4 * 2e-3)  # the closing block, steps of 8 ms

    def cost(_rows: int, threads: int) -> float:
        if threads != last[0]:
            runs[0] += 1
            steps[0] = 0
        last[0] = threads
        steps[0] += 1
        if threads == 1:
            return 1.1e-3
        return 2e-3 if runs[0] == 2 and steps[0] <= burst else 1e-3

    tuner = tuner_of(2)
    used = run(tuner, [4] * 2000, cost)
    assert tuner.choices == {4: 2}
    # One thread ran only the checks' blocks: it was never chosen.
    ones = [len(list(group)) for count, group in itertools.groupby(used) if count == 1]
    assert max(ones) == other_steps(4 * 1.1e-3)


def test_each_batch_size_bucket_chooses_for_itself() -> None:
    def cost(rows: int, threads: int) -> float:
        best = 1 if rows < 8 else 2
        return 1e-3 * (1 if threads == best else 1.5)

    tuner = tuner_of(2)
    run(tuner, [1] * 300 + [16] * 300 + [3] * 300, cost)
    assert tuner.choices == {1: 1, 2: 1, 16: 2}
    assert tuner.threads_for(1) == 1
    assert tuner.threads_for(31) == 2


def test_a_check_left_for_other_steps_starts_again() -> None:
    """A check whose bucket gave way to another's steps for longer than
    STALE_SECONDS does not compare blocks from before with blocks after:
    it starts again from a settling and a new block on its choice."""
    tuner = tuner_of(2)
    block = block_steps(4 * 1.2e-3)  # batches of 4 on two threads, the slower
    used = run(tuner, [4] * (1 + block + SETTLE + 2), faster_on(1))
    assert used[-3:] == [1, 1, 1]  # the check's block on one thread, under way
    gap = round(2 * thread_tuner.STALE_SECONDS / 1e-3)
    run(tuner, [1] * gap, faster_on(1))  # 1 ms steps of another bucket
    again = run(tuner, [4] * 40, faster_on(1))
    assert again[: 1 + SETTLE + block] == [2] * (1 + SETTLE + block)
    assert again[1 + SETTLE + block] == 1


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
    assert used[-1000:].count(best) >= 1000 - 4 * other_steps(rows * 1e-3)


def lingering_switch() -> Cost:
    """Steps whose time after a switch lags the count: one thread is the
    faster in steady steps (2.9 ms against 3.4), but after two threads ran
    it pays 6 ms a step for its first 20 ms and 4 ms until 60 ms. (Measured
    on the tiny model at concurrency 1, 2 cores, 28 Nov: 3.6, 3.45 and 3.0
    ms over the first 10, 20 and 50 ms, 2.9 from then on; the model
    stretches that lag until a block timed from the first step after the
    switch reads one thread as the slower.)"""
    last = [0]
    since = [0.0]

    def cost(_rows: int, threads: int) -> float:
        if threads != last[0]:
            since[0] = 0.0
        last[0] = threads
        if threads == 2:
            seconds = 3.4e-3
        elif since[0] < 0.02:
            seconds = 6e-3
        else:
            seconds = 4e-3 if since[0] < 0.06 else 2.9e-3
        since[0] += seconds
        return seconds

    return cost


def test_a_switch_settles_before_its_steps_are_timed() -> None:
    tuner = ThreadTuner(2)
    used = run(tuner, [1] * 3000, lingering_switch())
    assert tuner.choices == {1: 1}
    # Two threads run only in checks: a block after 0.1 s (~30 steps) of
    # settling.
    assert used[-1000:].count(2) <= 30 + block_steps(3.4e-3)
    # Timed from the step after the switch, the same steps read two threads
    # as the faster: the choice the tuner made before it settled by time.
    hasty = tuner_of(2)
    run(hasty, [1] * 3000, lingering_switch())
    assert hasty.choices == {1: 2}


def switched_back_reads_fast() -> Cost:
    """Two threads that have run for a while take 3.1 ms a step, but for
    0.4 s after one thread ran they take 2.55; one thread takes 2.5 (tiny
    model, concurrency 1, 2 cores, earlier on 28 Nov). A check of alternating blocks,
    each after a switch, read the counts as level and kept two threads."""
    last = [2]
    since = [1.0]

    def cost(_rows: int, threads: int) -> float:
        if threads != last[0]:
            since[0] = 0.0
        last[0] = threads
        seconds = 2.5e-3 if threads == 1 else (2.55e-3 if since[0] < 0.4 else 3.1e-3)
        since[0] += seconds
        return seconds

    return cost


def test_the_count_in_use_is_first_timed_at_the_end_of_its_hold() -> None:
    tuner = ThreadTuner(2)
    used = run(tuner, [1] * 8000, switched_back_reads_fast())
    assert tuner.choices == {1: 1}
    assert used[-4000:].count(2) <= 2 * (40 + block_steps(2.55e-3))


def test_the_settling_is_measured_in_seconds_of_steps() -> None:
    tuner = ThreadTuner(2, settle_seconds=0.1)
    used = run(tuner, [16] * 200, faster_on(1, share=0.0))  # 16 ms a step
    block = block_steps(16e-3)
    first = 1 + block
    # Seven steps (112 ms) on the new count go untimed, then its block.
    assert used[first : first + 7 + block] == [1] * (7 + block)
    assert used[first + 7 + block] == 2


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


@pytest.mark.parametrize(("share", "checks"), [(0.05, 4), (0.5, 2)])
def test_a_clear_check_waits_longer(share: float, checks: int) -> None:
    """A check that keeps its choice ends after one trial; a clear one
    grows the hold fourfold, not twofold: fewer checks, each of which runs a
    block on the slower count."""
    tuner = tuner_of(2)
    used = run(tuner, [4] * 15_000, faster_on(1, share=share))  # 4 ms a step: 60 s
    assert tuner.choices == {4: 1}
    # After the change, checks at 2, 6, 14 and 30 s (doubling holds) or, if
    # clear, at 4 and 20 s (a clear change holds 4 s, then fourfold).
    assert checks_after_the_first(used, 1) == (checks, checks)


@pytest.mark.parametrize("share", [0.05, 0.5])
def test_a_change_takes_two_trials(share: float) -> None:
    tuner = tuner_of(2)
    used = run(tuner, [4] * 400, faster_on(1, share=share))  # the first hold is longer
    assert tuner.choices == {4: 1}
    # It starts on two threads; each trial runs a block on one thread and
    # comes back to two, then the change.
    assert [count for count, _ in itertools.groupby(used)] == [2, 1] * 3
