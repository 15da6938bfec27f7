"""The vLLM runner: an ``EngineHandle`` over vLLM's ``AsyncLLM``.

Theory of operation. vLLM schedules itself, so there is no scheduler,
sampler or reducer here: each submitted request becomes one task, and each
of its choices one vLLM request streamed with ``RequestOutputKind.DELTA``
(``engines.vllm_engine`` maps the request and the outputs). Every delta's
tokens go to the request's outbox as one :class:`StepOutput`, as the
scheduler's steps do, so the output actors (detokenizer, stop strings,
parsers, alignment) cannot tell the two apart.

- A stop string (``finish_choice``) or a cancel ends the choice's task; the
  vLLM request is then aborted in a shielded scope, so that vLLM frees its
  sequence even while the task is being cancelled.
- Pacing: a request whose reader falls behind (its backlog is ``full``)
  stops reading vLLM's stream until it catches up; vLLM merges the deltas
  meanwhile. Past ``stall_timeout`` it ends (``FailureCause.STALLED``).
- Bounded queue: a request is refused (``Overloaded``) when more than
  ``max_queued_requests`` requests beyond ``max_num_seqs`` are in flight.
- Engine loss: when vLLM's engine core dies (``EngineDeadError`` on a
  stream, or ``errored`` seen by the watcher), every request fails
  (``FailureCause.ENGINE``), new ones get 503 (``ServiceUnavailable``), and
  the engine is started again on a worker thread, a bounded number of times.
- Load figures come from vLLM's scheduler stats (running and waiting
  sequences, KV-cache use), and are zero when nothing is in flight (vLLM
  sends no stats once it is idle).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.abc import TaskGroup, TaskStatus

from sluiceway.actors.prefix_cache import PrefixCacheStats
from sluiceway.actors.scheduler import RESTART_ATTEMPTS, RESTART_BACKOFF_SECONDS, SchedulerConfig
from sluiceway.actors.seam import EngineHandle
from sluiceway.engines.vllm_engine import (
    VllmEngine,
    engine_prompt,
    lark_grammar,
    prompt_scores,
    sampling_fields,
    token_samples,
)
from sluiceway.protocol.errors import InvalidRequest
from sluiceway.protocol.messages import (
    Backlog,
    FailureCause,
    GenerationRequest,
    Outbox,
    PromptCached,
    RequestFailed,
    RequestOutput,
    StepOutput,
)

logger = logging.getLogger(__name__)

#: How often the watcher checks the engine core and refreshes the figures.
WATCH_SECONDS = 0.5


@dataclass(slots=True)
class _Flight:
    """One submitted request."""

    request: GenerationRequest
    output: Outbox[RequestOutput]
    backlog: Backlog | None
    params: list[Any]
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    choices: dict[int, anyio.CancelScope] = field(default_factory=dict)
    resumed: anyio.Event = field(default_factory=anyio.Event)
    started: bool = False
    #: The prompt's scores and cached-token count went out.
    reported: bool = False
    failed: bool = False
    submitted: float = field(default_factory=time.monotonic)


class VllmHandle(EngineHandle):
    """What the server holds when vLLM runs the engine. Its figures are
    vLLM's, refreshed by the watcher; vLLM keeps its own prefix cache, whose
    hits show as ``cached_tokens``; ``prefix_cache`` holds only the lookups
    and hits summed from vLLM's step figures (it counts no evictions)."""

    def __init__(
        self,
        engine: VllmEngine,
        config: SchedulerConfig,
        group: TaskGroup,
        *,
        logprobs_mode: str = "raw",
    ) -> None:
        super().__init__(config.max_queued_requests, kv_capacity_tokens=engine.kv_capacity_tokens)
        self._engine = engine
        self._config = config
        self._group = group
        self._logprobs_mode = logprobs_mode
        self._flights: dict[str, _Flight] = {}
        self._restarting = False
        #: vLLM's prefix-cache figures summed over its steps (and restarts):
        #: lookups and tokens; vLLM counts no per-request hits or evictions.
        self._prefix = self.prefix_cache = PrefixCacheStats()
        engine.on_stats = self._count

    # --- the seam -------------------------------------------------------------

    def submit(
        self,
        request: GenerationRequest,
        output: Outbox[RequestOutput],
        *,
        backlog: Backlog | None = None,
    ) -> None:
        self.admit(len(self._flights) - self._config.max_num_seqs)
        params = [self._params(request, choice) for choice in range(request.n)]
        flight = _Flight(request=request, output=output, backlog=backlog, params=params)
        self._flights[request.request_id] = flight
        self._publish()
        self._group.start_soon(self._run, flight)

    def cancel(self, request_id: str) -> None:
        flight = self._flights.get(request_id)
        if flight is not None:
            flight.scope.cancel()

    def resume(self, request_id: str) -> None:
        flight = self._flights.get(request_id)
        if flight is not None:
            flight.resumed.set()

    def finish_choice(self, request_id: str, choice: int) -> None:
        flight = self._flights.get(request_id)
        if flight is not None and choice in flight.choices:
            flight.choices[choice].cancel()

    def close(self) -> None:
        if self.refusal is None:
            self.refusal = "the server is shutting down"

    # --- requests -------------------------------------------------------------

    def _params(self, request: GenerationRequest, choice: int) -> Any:
        from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

        grammar = None if request.constraint is None else lark_grammar(request.constraint)
        fields = sampling_fields(
            request,
            choice,
            eos_ids=self._config.eos_ids,
            logprobs_mode=self._logprobs_mode,
            grammar=grammar,
        )
        structured = fields.pop("structured_outputs", None)
        try:
            return SamplingParams(
                **fields,
                structured_outputs=None
                if structured is None
                else StructuredOutputsParams(**structured),
                output_kind=RequestOutputKind.DELTA,
            )
        except ValueError as error:  # vLLM's validation (a VLLMValidationError)
            raise InvalidRequest(str(error), param=getattr(error, "parameter", None)) from error

    async def _run(self, flight: _Flight) -> None:
        try:
            with flight.scope:
                async with anyio.create_task_group() as group:
                    for choice in range(flight.request.n):
                        scope = flight.choices[choice] = anyio.CancelScope()
                        group.start_soon(self._run_choice, flight, choice, scope)
        finally:
            self._flights.pop(flight.request.request_id, None)
            flight.output.close()
            self._publish()

    async def _run_choice(self, flight: _Flight, choice: int, scope: anyio.CancelScope) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        llm = self._engine.llm
        request = flight.request
        vllm_id = f"{request.request_id}-{choice}"
        finished = False
        with scope:
            try:
                stream = llm.generate(
                    engine_prompt(request.prompt_ids), flight.params[choice], vllm_id
                )
                async for out in stream:
                    self._first(flight, choice, out)
                    samples = token_samples(
                        out.outputs[0], choice, request, eos_ids=self._config.eos_ids
                    )
                    if samples:
                        self._deliver(flight, StepOutput(samples=tuple(samples)))
                    finished = out.finished
                    if not finished:
                        await self._keep_pace(flight)
            except EngineDeadError:
                self._fail(flight, "the engine core died", FailureCause.ENGINE)
                self._lost()
            except Exception as error:  # a request vLLM refused or failed
                logger.exception("vLLM request %s failed", vllm_id)
                self._fail(flight, f"the engine failed: {error}", FailureCause.ENGINE)
            finally:
                if not finished and llm is not None and not llm.errored:
                    with anyio.CancelScope(shield=True):
                        await llm.abort(vllm_id)

    def _first(self, flight: _Flight, choice: int, out: Any) -> None:
        if not flight.started:
            flight.started = True
            self._publish()
        if choice != 0 or flight.reported:
            return
        flight.reported = True
        top = flight.request.logprobs.prompt_top
        # In DELTA mode vLLM sends every prompt logprob in the first output
        # (an empty list in the later ones).
        if out.prompt_logprobs and top is not None:
            self._deliver(
                flight, prompt_scores(out.prompt_logprobs, flight.request.prompt_ids, top)
            )
        if out.num_cached_tokens:
            self._deliver(flight, PromptCached(tokens=int(out.num_cached_tokens)))

    async def _keep_pace(self, flight: _Flight) -> None:
        if flight.backlog is None or not flight.backlog.full:
            return
        flight.resumed = anyio.Event()
        self.paused_requests += 1
        try:
            limit = self._config.stall_timeout
            with anyio.move_on_after(limit if limit is not None else float("inf")) as waited:
                while flight.backlog.full:
                    await flight.resumed.wait()
                    flight.resumed = anyio.Event()
            if waited.cancelled_caught:
                self._fail(flight, "the client stopped reading", FailureCause.STALLED)
        finally:
            self.paused_requests -= 1

    def _deliver(self, flight: _Flight, message: RequestOutput) -> None:
        try:
            flight.output.send_nowait(message)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.WouldBlock):
            flight.scope.cancel()  # the client went away

    def _fail(self, flight: _Flight, message: str, cause: FailureCause) -> None:
        if not flight.failed:
            flight.failed = True
            self._deliver(flight, RequestFailed(message=message, cause=cause))
        flight.scope.cancel()

    # --- the engine's life ------------------------------------------------------

    def _lost(self) -> None:
        if self._restarting:
            return
        self._restarting = True
        self.engine_available = False
        self._group.start_soon(self._restart)

    async def _restart(self) -> None:
        for flight in list(self._flights.values()):
            self._fail(flight, "the engine core died", FailureCause.ENGINE)
        for attempt in range(1, RESTART_ATTEMPTS + 1):
            logger.error("the vLLM engine core is gone; restarting it (attempt %d)", attempt)
            try:
                await anyio.to_thread.run_sync(self._engine.restart, abandon_on_cancel=True)
            except Exception:
                logger.exception("restarting the vLLM engine failed")
                await anyio.sleep(RESTART_BACKOFF_SECONDS * attempt)
                continue
            self.kv_capacity_tokens = self._engine.kv_capacity_tokens
            self.engine_available = True
            self._restarting = False
            logger.info("the vLLM engine is back")
            return
        logger.error("the vLLM engine could not be restarted; the server cannot serve")

    async def watch(self) -> None:
        """Refresh the figures, and notice an engine core that died while idle."""
        while True:
            await anyio.sleep(WATCH_SECONDS)
            self._publish()
            if not self._restarting and not self._engine.alive:
                self._lost()

    def _count(self, scheduler: Any, iteration: Any) -> None:
        """Add one record of vLLM's figures: its prefix-cache lookups (a
        preempted request's lookup again is counted apart, and left out as
        vLLM's own counters leave it), and the time each finished request
        spent in vLLM's waiting queue (which our bounded queue feeds at once)."""
        step = None if scheduler is None else scheduler.prefix_cache_stats
        if step is not None:
            self._prefix.lookups += int(step.requests)
            self._prefix.looked_up_tokens += int(step.queries)
            self._prefix.hit_tokens += int(step.hits)
        if iteration is not None and self._config.on_admitted is not None:
            for finished in iteration.finished_requests:
                self._config.on_admitted(float(finished.queued_time))

    def _publish(self) -> None:
        flights = self._flights.values()
        started = sum(1 for f in flights if f.started)
        self.running_requests = started
        stats = self._engine.stats
        rows = sum(f.request.n for f in flights)
        if stats is None or not self._flights:
            self.running_rows = rows if started else 0
            self.queued = len(self._flights) - started
            self.cached_tokens = 0
            return
        self.running_rows = min(rows, int(stats.num_running_reqs))
        self.queued = min(len(self._flights) - started, int(stats.num_waiting_reqs))
        self.cached_tokens = round(float(stats.kv_cache_usage) * (self.kv_capacity_tokens or 0))


async def run(
    engine: VllmEngine,
    config: SchedulerConfig,
    *,
    logprobs_mode: str = "raw",
    task_status: TaskStatus[VllmHandle] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve requests on ``engine`` until cancelled."""
    async with anyio.create_task_group() as group:
        handle = VllmHandle(engine, config, group, logprobs_mode=logprobs_mode)
        group.start_soon(handle.watch)
        task_status.started(handle)
