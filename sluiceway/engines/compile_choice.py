"""``--compile auto``: the compiled decode step only where it measures faster.

Theory of operation. The compiled step (:mod:`~sluiceway.engines.torch_compiled`)
removes Python dispatch from a decode step. Where dispatch is most of a step
(the tiny default model: about 1.5x at batch 1) that is a large gain; where the
matrix products are (the 42M-parameter benchmark model on this repository's
2-core host) it measured no gain at all, and each batch bucket still costs a
compile (23-81 s cold, 1-7 s from Inductor's cache). So ``auto`` decides by
timing, once per model and machine:

1. At start-up, before the engine reports ready, each batch bucket in turn
   (1, 2, 4, ...) fills its rows with scratch prompts and decodes them
   eagerly and through the compiled graph, in alternating rounds.
2. A bucket is kept when its compiled median step is at least
   :data:`MIN_SPEEDUP` times faster. The timing stops at the first bucket
   that is not (the gain shrinks as the batch, and so the matrix products,
   grow), so a model the compiled step does not suit costs one compile.
   Batches larger than the last kept bucket decode eagerly; the kept buckets
   are compiled before the first request.
3. The verdicts are stored under the cache directory, keyed by the model's
   files, the dtype, the thread count, the buckets, torch's version and the
   CPU, so that later starts skip the timing (and the compile of buckets
   that lost). Delete ``$XDG_CACHE_HOME/sluiceway/compile/`` to measure again.

Why at start-up rather than in the background while eager steps serve: a
compile on another thread of the engine's process is not safe. Tracing
patches ``torch.nn.Module.__call__`` for the whole process, and an eager step
running meanwhile failed inside that patch ("module is not installed as a
submodule"); the `kernels` package's compile-aware context variable is process
global, so guards saw the other thread's values; and the trace held the GIL
for 1.3-2.4 s at a time, stalling the eager steps (measured with torch 2.13).
Inductor's own asynchronous mode (``TORCHINDUCTOR_FX_COMPILE_MODE=async+subprocess``)
cannot pickle this model's graph and compiles in process instead.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

#: The compiled step must beat the eager one by this factor to be kept: below
#: it, a host's noise could flip the verdict, and the compile is not worth it.
MIN_SPEEDUP = 1.1
#: Rounds, and timed steps of each kind per round (taken in turns: an eager
#: step, a compiled one, and so on).
ROUNDS = 3
STEPS_PER_ROUND = 12
#: Steps of each kind run before each round's timing (the first compiled one
#: compiles).
UNTIMED_STEPS = 2
#: The scratch rows' prompt length.
SCRATCH_PROMPT = 16


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of timing one bucket's eager against its compiled decode step."""

    #: The batch bucket (rows) timed.
    bucket: int
    #: Median eager step time ÷ median compiled step time.
    speedup: float
    #: Whether the compiled step is used for this bucket.
    keep: bool


def decide(
    bucket: int,
    eager: Sequence[float],
    compiled: Sequence[float],
    *,
    threshold: float = MIN_SPEEDUP,
) -> Verdict:
    """The verdict of one bucket's step times (seconds) of each kind."""
    if not eager or not compiled:
        raise ValueError("both kinds of step need at least one timing")
    fastest = statistics.median(compiled)
    speedup = statistics.median(eager) / fastest if fastest > 0 else float("inf")
    return Verdict(bucket=bucket, speedup=round(speedup, 3), keep=speedup >= threshold)


def kept_buckets(verdicts: Sequence[Verdict]) -> tuple[int, ...]:
    """The buckets the compiled step keeps: those before the first loss."""
    kept: list[int] = []
    for verdict in verdicts:
        if not verdict.keep:
            break
        kept.append(verdict.bucket)
    return tuple(kept)


#: OpenMP's settings of how idle threads wait, read by the verdict key.
_WAITING = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def verdict_key(
    model_dir: Path,
    *,
    dtype: str,
    threads: int,
    torch_version: str,
    buckets: Sequence[int],
    prepacked: bool = False,
    frozen: bool = False,
) -> str:
    """A digest of what the verdicts depend on: the model's files (name, size,
    modification time), the dtype, the thread count, the buckets, torch, the
    CPU, whether the weights are prepacked or frozen (both steps' speed moves), and
    OpenMP's wait policy (sleeping threads slow the compiled step most)."""
    files = sorted(
        (path.name, stat.st_size, stat.st_mtime_ns)
        for path in model_dir.iterdir()
        if path.is_file()
        for stat in [path.stat()]
    )
    described = [str(model_dir.resolve()), files, dtype, threads, list(buckets), torch_version]
    described.append({name: os.environ.get(name) for name in _WAITING})
    if prepacked:  # a key of weights as loaded stays what it was before prepacking
        described.append("prepacked")
    if frozen:  # the compiled step's products are Inductor's own
        described.append("frozen")
    digest = hashlib.sha256(json.dumps([*described, _cpu()]).encode())
    return digest.hexdigest()[:32]


def _cpu() -> str:
    """The CPU's model name and flags (what Inductor's code depends on)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(lines))


class VerdictStore:
    """Each key's verdicts, one small JSON file; an unreadable one is absent."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def load(self, key: str) -> list[Verdict] | None:
        try:
            raw = json.loads((self.directory / f"{key}.json").read_text())
            verdicts = [
                Verdict(bucket=int(v["bucket"]), speedup=float(v["speedup"]), keep=bool(v["keep"]))
                for v in raw
            ]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return verdicts or None

    def save(self, key: str, verdicts: Sequence[Verdict]) -> None:
        """Write ``verdicts``; a directory that cannot be written only costs
        a measurement at the next start."""
        target = self.directory / f"{key}.json"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            partial = target.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(json.dumps([asdict(verdict) for verdict in verdicts]))
            partial.replace(target)
        except OSError as error:
            logger.warning("--compile auto: could not store the verdict in %s: %s", target, error)


def time_rounds(
    eager: Callable[[], None],
    compiled: Callable[[], None],
    clock: Callable[[], float],
    *,
    rounds: int = ROUNDS,
    steps: int = STEPS_PER_ROUND,
) -> tuple[list[float], list[float]]:
    """Each kind's step times, the two kinds taken in turns, one step each,
    so that a change in the host's load falls on both. (Rounds of 12 steps
    of one kind, then 12 of the other, let a burst of another tenant's work
    fall on one kind: on a shared host a bucket then read 1.09x and, in one
    step at a time, 1.23x.)"""
    times: tuple[list[float], list[float]] = ([], [])
    kinds = ((eager, times[0]), (compiled, times[1]))
    for _ in range(rounds):
        for step, _ in kinds:
            for _ in range(UNTIMED_STEPS):
                step()
        for _ in range(steps):
            for step, into in kinds:
                started = clock()
                step()
                into.append(clock() - started)
    return times


def scratch_prompts(rows: int, vocab: int, *, length: int = SCRATCH_PROMPT) -> Iterable[list[int]]:
    """Distinct, deterministic prompts of ``length`` tokens for ``rows`` scratch rows."""
    for row in range(rows):
        yield [(row * 7919 + position * 104729) % vocab for position in range(length)]
