"""Choosing the engine's CPU thread count by timing its steps.

On a CPU host the engine's threads and the server's own per-token work
(scheduling, detokenizing, encoding, writing) share the cores. Whether the
engine should compute on every core or leave one to the server depends on
the model and the batch: for a model whose step is cheap, the server's work
per step is a large share of it, and an engine thread that must wait for a
core makes every parallel region wait for it; for a model whose step is
compute-bound, the last core is worth more than that contention costs
(docs/architecture.md, "Engine threads"). Neither a rule by model size nor
a fixed count holds across hosts, so the engine in its child process
measures instead: :class:`ThreadTuner` times the steady decode steps of each
batch size bucket on both counts, in short blocks that take turns so the
load on the host is alike for both, and keeps the faster. A choice that holds is
checked again less and less often; one that loses is replaced and checked
soon.

The time of a step is the time from one plan's arrival to the next one's:
it includes the server's part of the round, which is what the count is
chosen for. This module is a pure core: the child process feeds it times and
applies the counts it returns.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

logger = logging.getLogger(__name__)

#: A check times this many pairs of blocks: one on the count in use, then
#: one on the other. Alternating short blocks keeps a host whose speed drifts
#: over seconds from deciding for either count.
PAIRS = 4
#: Steady steps timed per block.
BLOCK = 4
#: Seconds of steady steps left untimed after the count changes (at least
#: one step). A switch takes tens of milliseconds to show its full effect,
#: and not only in the thread pool's wake-up: after two threads ran, an
#: OpenMP worker still spins on the core that the event loop wakes on, and
#: the kernel's load averages (which place that wake-up) decay over tens of
#: milliseconds. Tiny model, concurrency 1, 2 cores, switching every 150
#: steps: one-thread steps took 4.0, 3.8 and 3.45 ms over their first 10
#: steps and 3.15 from the 20th on; two-thread steps took 3.4 ms for the first
#: 2 steps (on the quiet core one thread left) and 3.95 from the 10th on.
#: Blocks of 4 steps after one untimed step read the slower count as the
#: faster, and the tuner kept two threads, 15% slower than one.
SETTLE_SECONDS = 0.1
#: The other count must be faster by this share, over the median pair and in
#: all pairs but one, to replace a choice that a check made (a bucket's first
#: check only compares the medians: see ``_replaces``).
MARGIN = 0.03
#: Seconds of steady steps between checks after a change; doubled each time
#: a choice holds. In seconds, like the settling: a check on the tiny model
#: at concurrency 1 takes ~0.9 s, half of it on the other count, and holds
#: of 96 steps (~0.3 s there) had it run on the slower count a tenth of the
#: time.
FIRST_HOLD_SECONDS = 2.0
LONGEST_HOLD_SECONDS = 64.0
#: A check whose pairs are all beyond this many margins, on the same side,
#: is clear: it ends after EARLY_PAIRS pairs, and its hold grows fourfold
#: instead of twofold (a change holds twice the first hold). Checks cost:
#: on the tiny model at concurrency 16 (2 cores, short benchmark levels)
#: one thread fixed read 0.79-0.84 of the bare loop, and the tuner that
#: settled on it 0.73-0.76 with holds doubling from 2 s and every new
#: bucket checked at once (see ``_new_bucket``).
CLEAR = 3
#: Pairs after which a clear check ends (half of its cost: the blocks on
#: the slower count).
EARLY_PAIRS = 2


@runtime_checkable
class ThreadedEngine(Protocol):
    """An engine whose CPU thread count can change between steps."""

    @property
    def tunable(self) -> bool:
        """No count was asked for, and there are 2 threads or more to choose from."""
        ...

    def set_threads(self, count: int) -> None: ...


@dataclass(slots=True)
class _Bucket:
    """One batch-size bucket's choice and the check under way."""

    choice: int
    #: Seconds of steady steps to run on ``choice`` before the next check.
    hold: float = 0.0
    #: How long the next hold lasts.
    next_hold: float = FIRST_HOLD_SECONDS
    #: The count of the block being timed, or None while holding.
    timing: int | None = None
    #: Seconds of steps still to leave untimed after a switch.
    settle: float = 0.0
    block: list[float] = field(default_factory=list)
    #: Each timed block's mean seconds per row: choice, other, choice, ...
    means: list[float] = field(default_factory=list)
    #: A check has ended in this bucket.
    decided: bool = False


class ThreadTuner:
    """Picks between ``most`` CPU threads and one fewer, per batch-size
    bucket (1, 2-3, 4-7, ...), by the measured time per row of steady
    decode steps.

    Call :meth:`threads_for` before each step and :meth:`observe` after
    the round it started; only steps whose rows match the step before them
    are timed, so a prefill or a request joining does not count. After
    each switch, steps are left untimed until they add up to
    ``settle_seconds`` (at least one step).
    """

    def __init__(self, most: int, *, settle_seconds: float = SETTLE_SECONDS) -> None:
        if most < 2:
            raise ValueError("a thread count to choose needs at least 2 threads")
        self._most = most
        self._settle_seconds = settle_seconds
        self._buckets: dict[int, _Bucket] = {}
        self._last_rows = 0

    @property
    def most(self) -> int:
        """The larger of the two counts: every thread the engine has."""
        return self._most

    @property
    def choices(self) -> dict[int, int]:
        """Each bucket's chosen count, by its smallest batch size."""
        return {1 << (key - 1): bucket.choice for key, bucket in sorted(self._buckets.items())}

    def threads_for(self, rows: int) -> int:
        """The count to run a step of ``rows`` decode rows on (0 rows: a
        step without a decode keeps the count in use)."""
        if rows <= 0:
            return 0
        bucket = self._bucket(rows)
        return bucket.timing if bucket.timing is not None else bucket.choice

    def observe(self, rows: int, seconds: float, *, steady: bool) -> None:
        """A step of ``rows`` decode rows took ``seconds``; ``steady``: it
        decoded only (no prefill, no cache work)."""
        same = steady and rows > 0 and rows == self._last_rows
        self._last_rows = rows if steady else 0
        if not same:
            return
        bucket = self._bucket(rows)
        if bucket.timing is None:
            bucket.hold -= seconds
            if bucket.hold <= 0:
                bucket.timing, bucket.settle = bucket.choice, 0.0
                bucket.means = []
            return
        if bucket.settle > 0:
            bucket.settle -= seconds
            return
        bucket.block.append(seconds / rows)
        if len(bucket.block) < BLOCK:
            return
        bucket.means.append(statistics.fmean(bucket.block))
        bucket.block = []
        timed = len(bucket.means)
        early = timed == 2 * EARLY_PAIRS and _clear(_ratios(bucket.means))
        if timed < 2 * PAIRS and not early:
            bucket.timing, bucket.settle = self._other(bucket.timing), self._settle_seconds
        else:
            self._decide(rows, bucket)

    def _bucket(self, rows: int) -> _Bucket:
        key = rows.bit_length()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._new_bucket(key)
            self._buckets[key] = bucket
        return bucket

    def _new_bucket(self, key: int) -> _Bucket:
        """A bucket met before any check has ended is checked at its first
        steady steps. Later ones start on the choice of the nearest bucket a
        check has decided, and are checked after a first hold: a check costs
        half its time on the other count, and a load whose batch moves
        between neighbouring buckets would pay it for each."""
        decided = [(abs(other - key), other) for other, b in self._buckets.items() if b.decided]
        if not decided:
            return _Bucket(choice=self._most)
        nearest = self._buckets[min(decided)[1]]
        return _Bucket(choice=nearest.choice, hold=FIRST_HOLD_SECONDS)

    def _other(self, count: int) -> int:
        return self._most - 1 if count == self._most else self._most

    def _decide(self, rows: int, bucket: _Bucket) -> None:
        ratios = _ratios(bucket.means)
        ratio = statistics.median(ratios)
        wins = sum(r < 1 for r in ratios)
        # A clear check is unlikely to be the host's noise: the next one
        # can wait longer.
        clear = _clear(ratios)
        if _replaces(ratio, wins, len(ratios), first=not bucket.decided):
            other = self._other(bucket.choice)
            logger.info(
                "engine threads for batches of %d: %d, not %d (%.0f%% of the time per row)",
                rows,
                other,
                bucket.choice,
                ratio * 100,
            )
            bucket.choice = other
            bucket.next_hold = FIRST_HOLD_SECONDS * (2 if clear else 1)
        else:
            growth = 4 if clear else 2
            bucket.next_hold = min(bucket.next_hold * growth, LONGEST_HOLD_SECONDS)
        bucket.hold = bucket.next_hold
        bucket.timing = None
        bucket.decided = True


def _replaces(ratio: float, wins: int, pairs: int, *, first: bool) -> bool:
    """The other count replaces the choice. A bucket's first check has no
    incumbent: its starting count is the default or a neighbouring bucket's
    choice, not a finding for its batches, so the faster median wins. With
    the margin there too, the tiny model at concurrency 1 kept two threads
    through its first check in some starts (808 of its first 1,000 steps
    in one instrumented run; one server switched only after 34 s), because
    one noisy pair of four blocks the switch. Later checks keep the margin:
    a choice a check made is replaced only when the other count is clearly
    faster."""
    if first:
        return ratio < 1
    return ratio < 1 - MARGIN and wins >= pairs - 1


def _ratios(means: list[float]) -> list[float]:
    """Each pair's time per row on the other count over the count in use."""
    return [other / kept for kept, other in zip(means[::2], means[1::2], strict=True)]


def _clear(ratios: list[float]) -> bool:
    """Every pair is beyond :data:`CLEAR` margins, on the same side."""
    bound = CLEAR * MARGIN
    return all(r < 1 - bound for r in ratios) or all(r > 1 + bound for r in ratios)
