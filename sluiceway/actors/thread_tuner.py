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
batch size bucket and, now and then, a block of them on the other count,
framed by the count in use before and after it, and keeps the faster. A
choice that holds is checked again less and less often; one that loses is
replaced and checked soon.

The time of a step is the time from one plan's arrival to the next one's:
it includes the server's part of the round, which is what the count is
chosen for. This module is a pure core: the child process feeds it times and
applies the counts it returns.
"""

from __future__ import annotations

import enum
import logging
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

logger = logging.getLogger(__name__)

#: A timed block is the fewest steady steps that add up to this many
#: seconds, and at least :data:`BLOCK_STEPS`: its mean's noise depends on
#: the time it covers more than on its steps, and a block on the slower
#: count costs its time (16 steps of the tiny model at concurrency 1, 4 of
#: a compute-bound model at concurrency 16). A check is a trial of three
#: blocks: the count in use (its last steps before the check), the other
#: count, and the count in use again; the other is compared with the mean
#: of the blocks around it, which cancels a host whose speed drifts
#: steadily over the trial. The first block is the end of the hold, already
#: steady: a count timed just after switching back can read faster than it
#: runs for long. Earlier on 28 Nov, two threads that had run for seconds
#: took 3.02-3.14 ms a step on the tiny model at concurrency 1, and
#: 2.51-2.59 in the blocks of a check that had just switched back to them,
#: level with one thread; the tuner of alternating 4-step blocks, each
#: timed after a switch, kept two.
BLOCK_SECONDS = 0.05
BLOCK_STEPS = 4
#: Seconds of steady steps left untimed after the count changes (at least
#: one step). A switch takes tens of milliseconds to show its full effect,
#: and not only in the thread pool's wake-up: after two threads ran, an
#: OpenMP worker still spins on the core that the event loop wakes on, and
#: the kernel's load averages (which place that wake-up) decay over tens of
#: milliseconds. Tiny model, concurrency 1, 2 cores: one thread's steps
#: took 3.6, 3.45 and 3.0 ms over the first 10, 20 and 50 ms after two
#: threads ran, and 2.86-2.97 from then on.
SETTLE_SECONDS = 0.1
#: The other count must be faster than the count in use by this share, per
#: row, to replace it. A win is timed by a second trial of three new blocks:
#: the mean of both must win, and neither may lose (a burst of load on the
#: host during one trial's blocks on the count in use reads as a win for
#: the other).
MARGIN = 0.03
#: A check whose trials are all beyond this many margins, on the same side,
#: is clear: the next one waits longer (fourfold instead of twofold; a
#: change holds twice the first hold).
CLEAR = 3
#: Seconds of other steps (another bucket's, or prefills) after which a
#: bucket's timed steps are too old to compare with new ones: its check
#: starts again, from a settling. The benchmark's warm-up wave at
#: concurrency 16 timed that bucket's first block, and its check went on
#: half a minute later, after the levels at concurrency 1.
STALE_SECONDS = 0.5
#: Seconds of steady steps between checks after a change; doubled each time
#: a choice holds. In seconds, like the settling: holds of 96 steps (~0.3 s
#: on the tiny model at concurrency 1) had the tuner of 4-pair checks run on
#: the slower count a tenth of the time.
FIRST_HOLD_SECONDS = 2.0
LONGEST_HOLD_SECONDS = 64.0


@runtime_checkable
class ThreadedEngine(Protocol):
    """An engine whose CPU thread count can change between steps."""

    @property
    def tunable(self) -> bool:
        """No count was asked for, and there are 2 threads or more to choose from."""
        ...

    def set_threads(self, count: int) -> None: ...


@dataclass(slots=True)
class _Block:
    """Timed steps: each one's seconds and seconds per row."""

    steps: deque[tuple[float, float]] = field(default_factory=deque)
    seconds: float = 0.0

    def add(self, seconds: float, rows: int) -> None:
        self.steps.append((seconds, seconds / rows))
        self.seconds += seconds

    @property
    def full(self) -> bool:
        return len(self.steps) >= BLOCK_STEPS and self.seconds >= BLOCK_SECONDS

    def keep_last(self) -> None:
        """Drop the oldest steps the block can do without."""
        while len(self.steps) > BLOCK_STEPS and self.seconds - self.steps[0][0] >= BLOCK_SECONDS:
            self.seconds -= self.steps.popleft()[0]

    def take_mean(self) -> float:
        """Seconds per row over the block's steps; the block starts again empty."""
        mean = statistics.fmean(per_row for _, per_row in self.steps)
        self.clear()
        return mean

    def clear(self) -> None:
        self.steps.clear()
        self.seconds = 0.0


class _Phase(enum.Enum):
    #: Running on the choice; its latest steady steps are kept.
    HOLD = enum.auto()
    #: Timing a block on the choice to open a second trial.
    BEFORE = enum.auto()
    #: Timing a block on the other count.
    OTHER = enum.auto()
    #: Timing a block on the choice again, to close the trial.
    BACK = enum.auto()


@dataclass(slots=True)
class _Bucket:
    """One batch-size bucket's choice and the check under way."""

    choice: int
    #: Seconds of steady steps to run on ``choice`` before the next check.
    hold: float = 0.0
    #: How long the next hold lasts.
    next_hold: float = FIRST_HOLD_SECONDS
    phase: _Phase = _Phase.HOLD
    #: Seconds of steps still to leave untimed after a switch.
    settle: float = 0.0
    #: The choice's latest steady steps (the first block of a trial).
    recent: _Block = field(default_factory=_Block)
    block: _Block = field(default_factory=_Block)
    #: The check's block means, seconds per row: choice, other, choice for
    #: each trial.
    means: list[float] = field(default_factory=list)
    #: A check has ended in this bucket.
    decided: bool = False
    #: The tuner's clock at the end of this bucket's last step.
    seen: float = 0.0


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
        #: Seconds of every step observed so far (a clock that idle time does not move).
        self._clock = 0.0

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
        if self._clock - bucket.seen > STALE_SECONDS:
            self._restart(bucket)
        return self._other(bucket.choice) if bucket.phase is _Phase.OTHER else bucket.choice

    def observe(self, rows: int, seconds: float, *, steady: bool) -> None:
        """A step of ``rows`` decode rows took ``seconds``; ``steady``: it
        decoded only (no prefill, no cache work)."""
        same = steady and rows > 0 and rows == self._last_rows
        self._last_rows = rows if steady else 0
        self._clock += seconds
        if rows <= 0:
            return
        bucket = self._bucket(rows)
        bucket.seen = self._clock
        if not same:
            return
        if bucket.settle > 0:
            bucket.settle -= seconds
            return
        if bucket.phase is _Phase.HOLD:
            bucket.recent.add(seconds, rows)
            bucket.recent.keep_last()
            bucket.hold -= seconds
            if bucket.hold <= 0 and bucket.recent.full:
                bucket.means = [bucket.recent.take_mean()]
                self._switch(bucket, _Phase.OTHER)
            return
        bucket.block.add(seconds, rows)
        if not bucket.block.full:
            return
        bucket.means.append(bucket.block.take_mean())
        if bucket.phase is not _Phase.BACK:
            self._switch(bucket, _Phase.BACK if bucket.phase is _Phase.OTHER else _Phase.OTHER)
            return
        ratios = _ratios(bucket.means)
        if len(ratios) == 1 and ratios[0] < 1 - MARGIN:
            # A win: a second trial, of blocks of its own (one shared with
            # the first would carry a burst on the host into both).
            bucket.phase = _Phase.BEFORE
        else:
            self._decide(rows, bucket, ratios)

    def _restart(self, bucket: _Bucket) -> None:
        """Other steps ran between this bucket's: its timed steps are from
        another stretch of load, and its count may have changed with theirs.
        A check under way starts again; the hold's last steps are dropped."""
        if bucket.phase is not _Phase.HOLD:
            bucket.phase, bucket.hold, bucket.means = _Phase.HOLD, 0.0, []
            bucket.block.clear()
        bucket.recent.clear()
        bucket.settle = self._settle_seconds

    def _switch(self, bucket: _Bucket, phase: _Phase) -> None:
        bucket.phase, bucket.settle = phase, self._settle_seconds

    def _bucket(self, rows: int) -> _Bucket:
        key = rows.bit_length()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._new_bucket(key)
            self._buckets[key] = bucket
        return bucket

    def _new_bucket(self, key: int) -> _Bucket:
        """A bucket met before any check has ended is checked once it has a
        block of steady steps. Later ones start on the choice of the nearest
        bucket a check has decided, and are checked after a first hold: a
        check runs a block on the other count, and a load whose batch moves
        between neighbouring buckets would pay it for each."""
        decided = [(abs(other - key), other) for other, b in self._buckets.items() if b.decided]
        if not decided:
            return _Bucket(choice=self._most)
        nearest = self._buckets[min(decided)[1]]
        return _Bucket(choice=nearest.choice, hold=FIRST_HOLD_SECONDS)

    def _other(self, count: int) -> int:
        return self._most - 1 if count == self._most else self._most

    def _decide(self, rows: int, bucket: _Bucket, ratios: list[float]) -> None:
        ratio = statistics.fmean(ratios)
        # A clear check is unlikely to be the host's noise: the next one
        # can wait longer.
        clear = all(abs(r - 1) > CLEAR * MARGIN for r in ratios)
        bucket.phase, bucket.means, bucket.decided = _Phase.HOLD, [], True
        if ratio < 1 - MARGIN and all(r < 1 for r in ratios):
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
            # The block just timed ran on the old choice: the new one settles.
            bucket.settle = self._settle_seconds
        else:
            logger.debug(
                "engine threads for batches of %d: %d kept (the other %.0f%% of the time per row)",
                rows,
                bucket.choice,
                ratio * 100,
            )
            growth = 4 if clear else 2
            bucket.next_hold = min(bucket.next_hold * growth, LONGEST_HOLD_SECONDS)
        bucket.hold = bucket.next_hold


def _ratios(means: list[float]) -> list[float]:
    """Each trial's time per row on the other count over the mean of the
    blocks on the count in use around it."""
    return [means[i + 1] / ((means[i] + means[i + 2]) / 2) for i in range(0, len(means) - 2, 3)]
