"""The engine in a child process of its own (``--engine-process``).

In one process the engine's Python glue and the event loop's per-token work
share one GIL. A transformers forward pass makes hundreds of Python-level
calls per step, and every torch kernel releases the GIL: the event loop takes
it, and the engine then waits up to a switch interval to get it back, once per
kernel. The engine ends up paying for the serving work twice, in CPU and in
GIL waits. In a child process the engine has an interpreter to itself; one
scheduler step costs one round trip over a pipe (the plan out, the outcome
back), and in a greedy step only the chosen token ids come back, not the
logits. In greedy steps the child does not even wait for that round trip: it
decodes the next step ahead (:mod:`sluiceway.actors.run_ahead`).

Steps are sent and their replies read on the event loop; the other calls
(loading, closing, and the single-call methods of the engine interface that
tests use) run on the engine thread. The scheduler never has a step in flight
while one of those runs, so messages never interleave on the pipe.

A child that dies (killed, out of memory) fails the steps under way; the
scheduler sees it gone (``alive``) and calls :meth:`ProcessEngine.restart`,
which starts a fresh child from the same spec.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from typing import Any

import anyio

from sluiceway.actors.engine_pipe import (
    GreedyDecode,
    dump_call,
    dump_reply,
    for_pipe,
    load_call,
    load_reply,
)
from sluiceway.actors.engine_work import (
    PendingStep,
    StepOutcome,
    StepPlan,
    failed_step,
    release_memory,
)
from sluiceway.actors.run_ahead import RunAhead
from sluiceway.actors.thread_tuner import ThreadedEngine, ThreadTuner
from sluiceway.engines.base import CacheOp, DecodeResult, Engine, EngineInfo, Logits
from sluiceway.engines.loader import ModelSource, freeze_heap

logger = logging.getLogger(__name__)

#: How long a closing child gets to release its engine before it is killed.
CLOSE_TIMEOUT_SECONDS = 10.0

_METHODS = frozenset(
    {
        "execute",
        "prefill",
        "fork",
        "decode",
        "free",
        "undo_decode",
        "restore",
        "cache_op",
        "release_memory",
    }
)


class EngineProcessError(RuntimeError):
    """The child failed a call, could not start, or is gone."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSpec:
    """What the child needs to build the engine (``--engine``, ``--device``, ``--dtype``)."""

    choice: str
    source: ModelSource
    device: str
    dtype: str
    #: ``--engine-threads`` (0: the engine's default).
    threads: int = 0
    #: ``--compile`` and ``--compile-max-batch`` (transformers).
    compile: str = "off"
    compile_max_batch: int = 32
    #: ``--prepack`` (transformers).
    prepack: bool = True
    #: ``--frozen-weights`` (transformers).
    frozen_weights: str = "auto"
    log_level: str = "info"
    log_format: str = logging.BASIC_FORMAT
    #: Set in the child's environment where the parent's does not set them.
    environment: Mapping[str, str] = field(default_factory=dict)


class ProcessEngine:
    """An :class:`~sluiceway.engines.base.Engine` whose calls run in a child process."""

    def __init__(self, spec: EngineSpec) -> None:
        self._spec = spec
        self._info: EngineInfo = self._spawn()

    def _spawn(self) -> EngineInfo:
        #: The pipe broke: the child is gone, even before it can be reaped.
        self._broken = False
        # spawn, not fork: the parent may already hold threads and a torch
        # or mlx runtime, which do not survive a fork.
        context = multiprocessing.get_context("spawn")
        self._conn, child_end = context.Pipe(duplex=True)
        self._process = context.Process(
            target=_child_main, args=(child_end, self._spec), name="sluiceway-engine", daemon=True
        )
        with _environment_added(self._spec.environment):
            self._process.start()
        child_end.close()
        try:
            info: EngineInfo = self._receive()
        except BaseException:
            self._stop()
            raise
        return info

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def alive(self) -> bool:
        return not self._broken and self._process.is_alive()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def restart(self) -> None:
        """Start a fresh child (the old one is gone, or is killed first)."""
        self._stop()
        self._info = self._spawn()

    def start_step(self, plan: StepPlan) -> PendingStep:
        """Send ``plan`` from the event loop; the reply is awaited there too.

        The loop watches the pipe itself, so a step costs no thread hop: the
        child's reply wakes the loop directly.
        """
        try:
            self._send("execute", plan)
        except EngineProcessError as error:
            return _Failed(failed_step(plan, f"engine failed: {error}"))
        return _Reply(self, plan)

    def prefill(self, slot: int, token_ids: Sequence[int], *, all_logits: bool = False) -> Logits:
        logits: Logits = self._call("prefill", slot, tuple(token_ids), all_logits=all_logits)
        return logits

    def fork(self, source: int, target: int) -> None:
        self._call("fork", source, target)

    def decode(self, tokens: Mapping[int, int]) -> DecodeResult:
        result: DecodeResult = self._call("decode", dict(tokens))
        return result

    def start_decode(self, tokens: Mapping[int, int]) -> Callable[[], DecodeResult]:
        return functools.partial(self.decode, dict(tokens))

    def free(self, slot: int) -> None:
        self._call("free", slot)

    def undo_decode(self) -> None:
        self._call("undo_decode")

    def restore(self, slot: int, entries: Sequence[int], length: int) -> None:
        self._call("restore", slot, tuple(entries), length)

    def cache_op(self, op: CacheOp) -> None:
        self._call("cache_op", op)

    def release_memory(self) -> None:
        """The child's engine gives back what it keeps, and the child's heap too."""
        self._call("release_memory")

    def close(self) -> None:
        if self._process.is_alive():
            with contextlib.suppress(EngineProcessError):
                self._call("close")
        self._stop()

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self._send(method, *args, **kwargs)
        return self._receive()

    def _send(self, method: str, *args: Any, **kwargs: Any) -> None:
        try:
            self._conn.send_bytes(dump_call(method, args, kwargs))
        except OSError as error:
            self._broken = True
            raise EngineProcessError(f"the engine process is gone ({error})") from error

    def _receive(self) -> Any:
        try:
            status, value = load_reply(self._conn.recv_bytes())
        except (EOFError, OSError) as error:
            self._broken = True
            code = self._process.exitcode
            raise EngineProcessError(f"the engine process is gone (exit code {code})") from error
        if status == "error":
            raise EngineProcessError(value)
        return value

    def _stop(self) -> None:
        self._process.join(CLOSE_TIMEOUT_SECONDS)
        if self._process.is_alive():
            logger.warning("the engine process did not exit; killing it")
            self._process.kill()
            self._process.join()
        self._conn.close()


@dataclass(frozen=True, slots=True)
class _Reply:
    engine: ProcessEngine
    plan: StepPlan

    async def result(self) -> StepOutcome:
        # Shielded: the reply must be read even by a cancelled caller, or the
        # next reader would take it for its own.
        with anyio.CancelScope(shield=True):
            await anyio.wait_readable(self.engine._conn.fileno())
        try:
            outcome: StepOutcome | GreedyDecode = self.engine._receive()
        except EngineProcessError as error:
            logger.error("engine step failed: %s", error)
            return failed_step(self.plan, f"engine failed: {error}")
        return outcome.outcome() if isinstance(outcome, GreedyDecode) else outcome


@dataclass(frozen=True, slots=True)
class _Failed:
    outcome: StepOutcome

    async def result(self) -> StepOutcome:
        return self.outcome


@contextlib.contextmanager
def _environment_added(variables: Mapping[str, str]) -> Iterator[None]:
    """``variables`` that are not set yet, in ``os.environ`` while a child is
    spawned (it inherits the environment when it starts: some libraries read
    their settings only as they load)."""
    added = [name for name in variables if name not in os.environ]
    for name in added:
        os.environ[name] = variables[name]
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def _child_main(conn: Connection, spec: EngineSpec) -> None:
    # Ctrl-C reaches the whole process group; the parent shuts down and then
    # closes the engine, which must outlive the requests still finishing.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level.upper(), format=spec.log_format)
    from sluiceway.engines.select import make_engine

    try:
        engine = make_engine(
            spec.choice,
            spec.source,
            device=spec.device,
            dtype=spec.dtype,
            threads=spec.threads,
            compile=spec.compile,
            compile_max_batch=spec.compile_max_batch,
            prepack=spec.prepack,
            frozen_weights=spec.frozen_weights,
        )
    except Exception as error:
        logger.exception("the engine could not start")
        conn.send_bytes(dump_reply("error", f"{type(error).__name__}: {error}"))
        return
    tuning = _tuning(engine)
    info = engine.info if tuning is None else replace(engine.info, threads_tuned=True)
    conn.send_bytes(dump_reply("ok", info))
    freeze_heap()
    _serve(conn, engine, tuning)


def _tuning(engine: Engine) -> _Tuning | None:
    """Thread tuning, where the count is the engine's to choose (not given
    by ``--engine-threads`` or ``OMP_NUM_THREADS``, 2 threads or more)."""
    if not isinstance(engine, ThreadedEngine) or not engine.tunable:
        return None
    most = engine.info.threads
    logger.info("engine threads: %d or %d per batch size, chosen by timing steps", most - 1, most)
    return _Tuning(engine, ThreadTuner(most), most)


@dataclass(slots=True)
class _Tuning:
    """Times each round from one plan's arrival to the next and applies the
    tuner's count before each step. The tuner times decode steps only; a
    step that prefills runs on the count chosen for the batch it decodes
    (one row's when it decodes none).

    Prompt tokens are compute-bound (the 42M model's eager prefill of 16,
    64, 256 and 512 tokens took 1.37, 1.09, 1.23 and 1.24x as long on one
    thread of two), so from 28 Nov to 7 Dec a prefill ran on every thread
    whatever the tuner chose. Since the engine's OpenMP threads spin while
    idle, that is ruinous where another process holds a core: beside one,
    prefills on every thread gave a TTFT p50 of 566 ms at 16 streams
    against 164-189 ms on the tuner's count (42M model, 2 cores). On a
    quiet host the tuner keeps every thread for a compiled batch (its
    graph runs on every thread only), so the prefills that pay are those
    of an eager batch whose steps are faster on fewer threads.
    """

    engine: ThreadedEngine
    tuner: ThreadTuner
    threads: int
    rows: int = 0
    steady: bool = False
    since: float | None = None
    clock: Callable[[], float] = time.perf_counter

    def before(self, plan: StepPlan) -> None:
        now = self.clock()
        if self.since is not None:
            self.tuner.observe(self.rows, now - self.since, steady=self.steady)
        self.since = now
        self.rows = len(plan.decode)
        self.steady = not plan.prefills and not plan.cache_ops
        wanted = self.tuner.threads_for(max(self.rows, 1))
        if wanted and wanted != self.threads:
            self.engine.set_threads(wanted)
            self.threads = wanted

    def pause(self) -> None:
        """A call other than a step: the round in progress is not timed."""
        self.since = None


def _serve(conn: Connection, engine: Engine, tuning: _Tuning | None = None) -> None:
    runner = RunAhead(engine)
    while True:
        try:
            method, args, kwargs = load_call(conn.recv_bytes())
        except (EOFError, OSError):
            engine.close()  # the parent is gone
            return
        if method != "execute":
            runner.settle()
            if tuning is not None:
                tuning.pause()
        if method == "close":
            logger.info(
                "steps decoded ahead: %d served, %d taken back; prompts packed into them: %d",
                runner.served,
                runner.taken_back,
                runner.packed,
            )
            engine.close()
            conn.send_bytes(dump_reply("ok", None))
            return
        if method not in _METHODS:
            conn.send_bytes(dump_reply("error", f"unknown engine call {method!r}"))
            continue
        try:
            if method == "execute":
                (plan,) = args
                if tuning is not None:
                    tuning.before(plan)
                outcome = runner.execute(plan)
                result: Any = for_pipe(plan, outcome)
            elif method == "release_memory":
                release_memory(engine)
                result = None
            else:
                result = getattr(engine, method)(*args, **kwargs)
        except Exception as error:
            logger.exception("engine call %s failed", method)
            conn.send_bytes(dump_reply("error", f"{method} failed: {error}"))
            continue
        conn.send_bytes(dump_reply("ok", result))
        if method == "execute":
            runner.run_ahead(plan, outcome)
