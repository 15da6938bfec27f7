"""The scheduler actor: the shell around :mod:`sluiceway.actors.scheduler_core`.

Theory of operation. The core holds the rules (admission, chunked prefill,
batched decode, pausing a slow reader and restoring it, the prefix cache,
engine loss, drain); this module does what they cannot: it takes commands
from the inbox, runs each planned step in one engine call
(``engine_work.execute``, through ``run_ahead.SteppingThread``, which decodes
greedy steps ahead of the plan; or over the pipe of an engine in a child
process), asks the sampler's actor for tokens, carries the core's messages to
each request's output, reads the clock, and restarts a lost engine. Engine
state is only touched from that worker thread, one call at a time.

Most steps never need the sampler's actor: when every decoded row is a
plain argmax, under a mask the plan carries, or unadjusted (``Row.unadjusted``:
sampled, or with logprobs, but with no grammar, bias, penalty or suppressed
id) and every starting prompt takes its argmax, the engine thread picks the
tokens itself, the drawn rows by the random number the plan carries for each
(``StepPlan.draws``), and decodes the next step ahead of the plan. Otherwise
the logits of rows whose prompt just completed and of the decoded rows go to
the sampler as one step; the sampled ids come back (through the logprob
reducer when it is wired) and are fanned out to each request's output
channel. A small step (``sampler.INLINE_LOGITS``) is sampled and reduced
right here instead, through the sampler's core: the two actors' round trip
would cost more than the work.

Pacing. A paused request (its reader fell behind) comes back once its reader
has caught up: a ``Resume`` command wakes the scheduler, and the core plans
its restore.

Engine loss. An engine that can die and be restarted (``Restartable``: one
in a child process) is checked when a step fails, and while the scheduler
waits; once it is gone every request fails (``FailureCause.ENGINE``), new
submissions are refused (``ServiceUnavailable``) and the engine is restarted,
a bounded number of times.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Collection, Sequence
from typing import Protocol, runtime_checkable

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from sluiceway.actors.engine_work import (
    EngineThread,
    PendingStep,
    StepChannel,
    StepOutcome,
    StepPlan,
    release_memory,
)
from sluiceway.actors.run_ahead import SteppingThread
from sluiceway.actors.sampling import Draw
from sluiceway.actors.scheduler_core import Batch, CloseOutput, SchedulerCore, with_draws
from sluiceway.actors.scheduler_core import SchedulerConfig as SchedulerConfig
from sluiceway.actors.seam import EngineHandle
from sluiceway.engines.base import Engine
from sluiceway.engines.grammar import Bitmask
from sluiceway.protocol.messages import (
    Backlog,
    Cancel,
    ConstraintReport,
    FinishChoice,
    GenerationRequest,
    LogitsStep,
    Outbox,
    RequestOutput,
    Resume,
    Row,
    SampledStep,
    SchedulerCommand,
    Submit,
    TokenSample,
)

logger = logging.getLogger(__name__)


#: How often an idle scheduler checks that a restartable engine still lives.
LIVENESS_POLL_SECONDS = 1.0
#: Restarts of a lost engine before the scheduler gives up (and /health says so).
RESTART_ATTEMPTS = 3
RESTART_BACKOFF_SECONDS = 1.0


class Guides(Protocol):
    """The sampler's side of greedy steps with guided rows
    (``sluiceway.actors.sampler.StepSampler``)."""

    async def allowed(self, rows: Sequence[Row]) -> Sequence[Bitmask] | None:
        """Each row's mask for its next token (None: not every row has one)."""
        ...

    async def take(
        self,
        rows: Sequence[Row],
        token_ids: Sequence[int],
        live: Collection[tuple[str, int]] = (),
    ) -> ConstraintReport | None:
        """Advance the rows' grammars by the tokens the engine picked
        (``live``: the keys of every other running choice)."""
        ...

    async def draws(self, live: Collection[tuple[str, int]], drawn: Sequence[Row]) -> list[Draw]:
        """How the engine picks each of ``drawn`` this step (``live``: the
        keys of every row the step decodes); each sampled row takes its draw
        for the step."""
        ...


@runtime_checkable
class Restartable(Protocol):
    """An engine that can be lost and started again (one in a child process)."""

    @property
    def alive(self) -> bool: ...

    def restart(self) -> None:
        """Start a fresh engine (blocking: it loads the model); raises on failure."""
        ...


class SchedulerHandle(EngineHandle):
    """What the server holds: submit, cancel, and the scheduler's counters.
    ``queued`` counts the requests in the inbox or the queue, not yet admitted;
    ``cached_tokens`` the running rows' prompt and generated tokens."""

    def __init__(
        self, inbox: MemoryObjectSendStream[SchedulerCommand], config: SchedulerConfig
    ) -> None:
        super().__init__(config.max_queued_requests)
        self._inbox = inbox
        #: Rows not reserved by a running or prefilling request, as of the last step.
        self.free_rows = config.max_num_seqs

    def submit(
        self,
        request: GenerationRequest,
        output: Outbox[RequestOutput],
        *,
        backlog: Backlog | None = None,
    ) -> None:
        # Requests that free rows will take at once do not count as waiting.
        self.admit(self.queued - self.free_rows)
        self.queued += 1
        self._inbox.send_nowait(Submit(request=request, output=output, backlog=backlog))

    def cancel(self, request_id: str) -> None:
        self._send(Cancel(request_id=request_id))

    def resume(self, request_id: str) -> None:
        """The request's reader caught up: its rows may decode again."""
        self._send(Resume(request_id=request_id))

    def close(self) -> None:
        """No more submissions: the scheduler returns once its inbox is drained."""
        self._inbox.close()

    def finish_choice(self, request_id: str, choice: int) -> None:
        self._send(FinishChoice(request_id=request_id, choice=choice))

    def _send(self, command: SchedulerCommand) -> None:
        # While shutting down the inbox is gone, and there is nothing to cancel.
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._inbox.send_nowait(command)


def open_inbox(
    config: SchedulerConfig,
) -> tuple[SchedulerHandle, MemoryObjectReceiveStream[SchedulerCommand]]:
    # Unbounded: the bound on waiting requests is enforced by the handle, and
    # control messages (cancel, finish) must never block or be refused.
    send, receive = anyio.create_memory_object_stream[SchedulerCommand](math.inf)
    return SchedulerHandle(send, config), receive


class Scheduler:
    """The actor: feeds :class:`SchedulerCore` its events and carries out its plans."""

    def __init__(
        self,
        engine: Engine,
        thread: EngineThread,
        config: SchedulerConfig,
        handle: SchedulerHandle,
        sample_inline: Callable[[LogitsStep], SampledStep | None] | None = None,
        guides: Guides | None = None,
    ) -> None:
        # An engine in a child process takes steps over its pipe, from the
        # loop; an engine in this process, on its thread.
        self._start_step: Callable[[StepPlan], PendingStep] = (
            engine.start_step
            if isinstance(engine, StepChannel)
            else SteppingThread(engine, thread).start
        )
        self._restartable = engine if isinstance(engine, Restartable) else None
        self._engine = engine
        self._thread = thread
        self._handle = handle
        #: Samples a small step on this task (None: send it to the sampler).
        self._sample_inline = sample_inline
        #: The guided rows' masks, for greedy steps (None: no guided row takes one).
        self._guides = guides
        self._core = SchedulerCore(config, engine.info, guided=guides is not None)
        handle.prefix_cache = self._core.prefix_stats

    async def run(
        self,
        inbox: MemoryObjectReceiveStream[SchedulerCommand],
        to_sampler: ObjectSendStream[LogitsStep],
        from_sampler: ObjectReceiveStream[SampledStep],
    ) -> None:
        core = self._core
        async with inbox, to_sampler, from_sampler:
            try:
                step: tuple[StepPlan, PendingStep] | None = None
                while True:
                    if step is None:
                        self._drain(inbox)
                        step = self._start(await self._next_plan())
                        if step is None:
                            self._publish_counters()
                            if not await self._wait(inbox):
                                return
                            continue
                        if step[0].prefills:
                            # A request admitted now counts as running before
                            # its first step is back: a chat stream's first
                            # chunk (its role) goes out at once, and a /metrics
                            # read after it saw no request running while a slow
                            # first step (270 ms on a loaded host) was under way.
                            self._publish_counters()
                    plan, running = step
                    outcome = await running.result()
                    batch = core.absorb(plan, outcome)
                    self._flush()
                    step = None
                    if _failed(outcome) and self._engine_lost():
                        await self._recover()
                        continue
                    if batch.greedy is not None:
                        # The engine picked the tokens: start the next step
                        # before fanning this one out, so the engine never
                        # waits for the output work.
                        samples = await self._take_greedy(batch, batch.greedy)
                        self._drain(inbox)
                        step = self._start(await self._next_plan())
                        core.deliver_samples(samples)
                        self._flush()
                    elif batch.choices:
                        await self._sample(batch, to_sampler, from_sampler)
                    self._publish_counters()
            finally:
                with anyio.CancelScope(shield=True):
                    plan = core.shutdown()
                    self._flush()
                    await self._start_step(plan).result()

    async def _wait(self, inbox: MemoryObjectReceiveStream[SchedulerCommand]) -> bool:
        """Nothing to do: wait for a command (False once the inbox is closed),
        waking to end stalled requests, to check that the engine lives and
        to give memory back."""
        poll = LIVENESS_POLL_SECONDS if self._restartable is not None else None
        with anyio.move_on_after(self._core.wake_after(time.monotonic(), poll=poll)):
            try:
                self._command(await inbox.receive())
            except anyio.EndOfStream:
                self._core.drain()
                return False
        if self._engine_lost():
            await self._recover()
        elif self._core.release_due(time.monotonic()):
            await self._release_memory()
        return True

    def _command(self, command: SchedulerCommand) -> None:
        self._core.command(command, time.monotonic())
        self._flush()

    def _drain(self, inbox: MemoryObjectReceiveStream[SchedulerCommand]) -> None:
        while True:
            try:
                self._command(inbox.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream):
                return

    def _flush(self) -> None:
        """Carry the core's messages to the requests' outputs; a request whose
        output cannot take one ends."""
        core = self._core
        while messages := core.take_messages():
            for message in messages:
                if isinstance(message, CloseOutput):
                    message.output.close()
                    continue
                try:
                    message.output.send_nowait(message.message)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    core.client_gone(message.request_id)  # the client went away
                except anyio.WouldBlock:
                    # An output is unbounded or sized for every step a request
                    # can produce, so this is a bug in whoever sized it; that
                    # request ends, not the server.
                    logger.error("output channel of %s is full; dropping it", message.request_id)
                    core.client_gone(message.request_id)
        self._handle.queued -= core.take_dequeued()

    async def _release_memory(self) -> None:
        started = time.monotonic()
        try:
            await self._thread.run(release_memory, self._engine)
        except Exception:  # tried again after more work; serving goes on
            logger.exception("giving memory back failed")
            return
        logger.info("idle: memory given back in %.3f s", time.monotonic() - started)

    # --- engine loss --------------------------------------------------------

    def _engine_lost(self) -> bool:
        return self._restartable is not None and not self._restartable.alive

    async def _recover(self) -> None:
        """Fail every request, then restart the engine (a few times at most)."""
        engine = self._restartable
        assert engine is not None
        self._handle.engine_available = False
        self._core.engine_lost()
        self._flush()
        self._handle.prefix_cache = self._core.prefix_stats
        self._publish_counters()
        for attempt in range(1, RESTART_ATTEMPTS + 1):
            logger.error(
                "the engine process is gone; restarting it (attempt %d of %d)",
                attempt,
                RESTART_ATTEMPTS,
            )
            try:
                await anyio.to_thread.run_sync(engine.restart)
            except Exception:
                logger.exception("the engine process did not restart")
                await anyio.sleep(RESTART_BACKOFF_SECONDS * attempt)
                continue
            logger.info("the engine process is back")
            self._handle.engine_available = True
            return
        logger.critical("the engine process could not be restarted; not serving")
        # Stays unavailable: /health answers 503 so that a supervisor restarts us.
        self._restartable = None

    # --- planning -----------------------------------------------------------

    def _start(self, plan: StepPlan | None) -> tuple[StepPlan, PendingStep] | None:
        if plan is None:
            return None
        self._core.started()
        return plan, self._start_step(plan)

    async def _next_plan(self) -> StepPlan | None:
        core = self._core
        masks = await self._greedy_masks()
        planned = core.plan(masks, time.monotonic())
        self._flush()
        if planned is None:
            return None
        if not (planned.drawn or planned.starting) or self._guides is None:
            return planned.plan
        # Only now, for a step the engine picks the tokens of: a row takes
        # one draw per step, and a sampled step draws in the sampler.
        rows = [row for _, row in planned.drawn]
        rows += [row for first in planned.starting.values() for row in first]
        draws = await self._guides.draws(core.running_keys(), rows)
        return with_draws(planned, draws)

    async def _greedy_masks(self) -> dict[int, Bitmask]:
        """The masks that let the next step be greedy with masked rows in it
        (by slot): the core's, and guided rows' from the sampler."""
        needs = self._core.mask_needs()
        if needs is None:
            return {}
        masks, guided, slots = needs
        if guided and self._guides is not None:
            allowed = await self._guides.allowed(guided)
            if allowed is None:
                return {}
            masks.update(zip(slots, allowed, strict=True))
        return masks

    # --- sampling -----------------------------------------------------------

    async def _sample(
        self,
        batch: Batch,
        to_sampler: ObjectSendStream[LogitsStep],
        from_sampler: ObjectReceiveStream[SampledStep],
    ) -> None:
        core = self._core
        step = core.sample_step(batch)
        sampled = self._sample_inline(step) if self._sample_inline is not None else None
        if sampled is None:
            await to_sampler.send(step)
            sampled = await from_sampler.receive()
        if sampled.constraints is not None:
            core.fail_constrained(batch.choices, sampled.constraints)
        core.deliver_samples(
            core.decide(batch.choices, sampled.token_ids, sampled.logprobs, sampled.constraints)
        )
        self._flush()

    async def _take_greedy(self, batch: Batch, tokens: list[int]) -> dict[str, list[TokenSample]]:
        """Take in a step whose tokens the engine picked; guided rows in it
        advance their grammars by their tokens, as a sampled step's do."""
        core = self._core
        report: ConstraintReport | None = None
        if self._guides is not None and any(
            c.request.spec.constraint is not None for c in batch.choices
        ):
            report = await self._guides.take(core.rows(batch.choices), tokens, core.running_keys())
        if report is not None:
            core.fail_constrained(batch.choices, report)
        samples = core.decide(batch.choices, tokens, batch.scores, report)
        self._flush()
        return samples

    def _publish_counters(self) -> None:
        counters = self._core.counters()
        handle = self._handle
        handle.running_requests = counters.running_requests
        handle.running_rows = counters.running_rows
        handle.free_rows = counters.free_rows
        handle.paused_requests = counters.paused_requests
        handle.cached_tokens = counters.cached_tokens


def _failed(outcome: StepOutcome) -> bool:
    return outcome.decode_error is not None or any(p.error for p in outcome.prefills)
