"""The scheduler actor: owns the engine, admits requests, runs the batch.

Theory of operation. Requests wait in a queue; between decode steps the
scheduler admits as many as fit (``max_num_seqs`` rows), prefills each (a
request's ``n`` choices share one prefill and fork), and then decodes every
running row in one engine call. The logits of newly prefilled rows and of the
decoded rows go to the sampler as one step; the sampled ids come back (through
the logprob reducer when it is wired) and are fanned out to each request's
output channel. Rows that finish, and requests that are cancelled, leave
before the next step and their KV cache is freed.

Every engine call runs in a worker thread; engine state is only touched from
there, one call at a time.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

import anyio
import numpy as np
from anyio.abc import ObjectReceiveStream, ObjectSendStream
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from sluiceway.actors.logprobs import reduce_targets
from sluiceway.engines.base import DecodeResult, Engine
from sluiceway.protocol.errors import Overloaded
from sluiceway.protocol.messages import (
    Cancel,
    FinishCause,
    FinishChoice,
    GenerationRequest,
    LogitsStep,
    PromptScores,
    RequestFailed,
    RequestOutput,
    Row,
    SampledStep,
    SchedulerCommand,
    StepOutput,
    Submit,
    TokenLogprob,
    TokenSample,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Prompt positions whose full logits are held at once while scoring a prompt.
PROMPT_SCORING_CHUNK = 256


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    eos_ids: frozenset[int]
    max_num_seqs: int = 32
    max_queued_requests: int = 256


@dataclass(slots=True)
class _Choice:
    request: _Request
    index: int
    slot: int
    generated: int = 0
    last_token: int = -1
    row: Row | None = None


@dataclass(slots=True)
class _Request:
    submit: Submit
    choices: dict[int, _Choice] = field(default_factory=dict)

    @property
    def spec(self) -> GenerationRequest:
        return self.submit.request


class SchedulerHandle:
    """What the server holds: submit, cancel, and the scheduler's counters."""

    def __init__(
        self, inbox: MemoryObjectSendStream[SchedulerCommand], config: SchedulerConfig
    ) -> None:
        self._inbox = inbox
        self._config = config
        self.queued = 0
        self.running_requests = 0
        self.running_rows = 0

    def submit(
        self, request: GenerationRequest, output: MemoryObjectSendStream[RequestOutput]
    ) -> None:
        if self.queued >= self._config.max_queued_requests:
            raise Overloaded(
                f"the server has {self.queued} requests waiting, its limit; retry shortly"
            )
        self.queued += 1
        self._inbox.send_nowait(Submit(request=request, output=output))

    def cancel(self, request_id: str) -> None:
        self._send(Cancel(request_id=request_id))

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
    def __init__(self, engine: Engine, config: SchedulerConfig, handle: SchedulerHandle) -> None:
        self._engine = engine
        self._config = config
        self._handle = handle
        self._waiting: deque[_Request] = deque()
        self._requests: dict[str, _Request] = {}
        self._rows: dict[int, _Choice] = {}
        self._to_free: list[int] = []
        self._next_slot = 0
        self._step = 0

    async def run(
        self,
        inbox: MemoryObjectReceiveStream[SchedulerCommand],
        to_sampler: ObjectSendStream[LogitsStep],
        from_sampler: ObjectReceiveStream[SampledStep],
    ) -> None:
        async with inbox, to_sampler, from_sampler:
            try:
                while True:
                    if not self._busy():
                        try:
                            self._handle_command(await inbox.receive())
                        except anyio.EndOfStream:
                            return
                    self._drain(inbox)
                    if self._busy():
                        await self._run_step(to_sampler, from_sampler)
                    self._publish_counters()
            finally:
                with anyio.CancelScope(shield=True):
                    for request in list(self._requests.values()):
                        self._close(request)
                    await self._engine_call(self._flush_frees)

    # --- commands ---------------------------------------------------------

    def _drain(self, inbox: MemoryObjectReceiveStream[SchedulerCommand]) -> None:
        while True:
            try:
                self._handle_command(inbox.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream):
                return

    def _handle_command(self, command: SchedulerCommand) -> None:
        if isinstance(command, Submit):
            self._handle.queued -= 1
            admitted = _Request(command)
            self._requests[command.request.request_id] = admitted
            self._waiting.append(admitted)
            return
        request = self._requests.get(command.request_id)
        if request is None:
            return  # already finished
        if isinstance(command, Cancel):
            self._close(request)
        elif (choice := request.choices.get(command.choice)) is not None:
            self._drop_choice(request, choice)

    # --- one step ---------------------------------------------------------

    def _busy(self) -> bool:
        return bool(self._rows) or self._can_admit()

    def _can_admit(self) -> bool:
        if not self._waiting:
            return False
        return len(self._rows) + self._waiting[0].spec.n <= self._config.max_num_seqs or not (
            self._rows
        )

    async def _run_step(
        self,
        to_sampler: ObjectSendStream[LogitsStep],
        from_sampler: ObjectReceiveStream[SampledStep],
    ) -> None:
        running = [choice for choice in self._rows.values() if choice.generated > 0]
        admitted: list[tuple[_Choice, np.ndarray]] = []
        while self._can_admit():
            admitted.extend(await self._admit(self._waiting.popleft()))
        rows: list[_Choice] = [choice for choice, _ in admitted]
        blocks = [logits for _, logits in admitted]
        if running:
            tokens = {choice.slot: choice.last_token for choice in running}
            try:
                result = await self._engine_call(self._decode, tokens)
            except Exception as error:  # an engine failure ends the batch, not the server
                logger.exception("decode failed")
                for choice in running:
                    self._fail(choice.request, f"decode failed: {error}")
                running = []
            else:
                rows.extend(self._rows[slot] for slot in result.slots)
                blocks.append(result.logits)
        if not rows:
            return
        logits = blocks[0] if len(blocks) == 1 else np.concatenate(blocks)
        self._step += 1
        await to_sampler.send(
            LogitsStep(step=self._step, rows=tuple(self._row(c) for c in rows), logits=logits)
        )
        sampled = await from_sampler.receive()
        self._apply(rows, sampled)

    async def _admit(self, request: _Request) -> list[tuple[_Choice, np.ndarray]]:
        spec = request.spec
        slots = [self._new_slot() for _ in range(spec.n)]
        try:
            logits, scores = await self._engine_call(
                self._prefill, slots, spec.prompt_ids, spec.logprobs.prompt_top
            )
        except Exception as error:
            logger.exception("prefill failed")
            self._fail(request, f"prefill failed: {error}")
            return []
        if scores is not None:
            self._deliver(request, PromptScores(entries=scores))
        admitted = []
        for index, slot in enumerate(slots):
            choice = _Choice(request=request, index=index, slot=slot)
            request.choices[index] = choice
            self._rows[slot] = choice
            admitted.append((choice, logits))
        return admitted

    def _row(self, choice: _Choice) -> Row:
        spec = choice.request.spec
        limits = spec.limits
        suppress: tuple[int, ...] = ()
        if choice.generated < limits.min_tokens:
            eos = () if limits.ignore_eos else tuple(self._config.eos_ids)
            suppress = eos + tuple(limits.stop_token_ids)
        first = choice.generated == 0
        row = choice.row
        if row is None or row.first != first or row.suppress != suppress:
            row = choice.row = Row(
                request_id=spec.request_id,
                choice=choice.index,
                sampling=spec.sampling,
                logprobs=spec.logprobs,
                prompt_ids=spec.prompt_ids,
                first=first,
                suppress=suppress,
            )
        return row

    def _apply(self, rows: list[_Choice], sampled: SampledStep) -> None:
        per_request: dict[str, list[TokenSample]] = {}
        logprobs = sampled.logprobs or (None,) * len(rows)
        for choice, token, logprob in zip(rows, sampled.token_ids, logprobs, strict=True):
            choice.generated += 1
            choice.last_token = token
            finish = self._finish_cause(choice, token)
            sample = TokenSample(
                choice=choice.index, token_id=token, logprob=logprob, finish=finish
            )
            per_request.setdefault(choice.request.spec.request_id, []).append(sample)
            if finish is not None:
                self._drop_choice(choice.request, choice, close=False)
        for request_id, samples in per_request.items():
            request = self._requests[request_id]
            self._deliver(request, StepOutput(samples=tuple(samples)))
            if not request.choices:
                self._close(request)

    def _finish_cause(self, choice: _Choice, token: int) -> FinishCause | None:
        # Before min_tokens the sampler cannot pick EOS or a stop token (they
        # are suppressed in its row), so these checks need no min_tokens test.
        limits = choice.request.spec.limits
        if token in self._config.eos_ids and not limits.ignore_eos:
            return FinishCause.EOS
        if token in limits.stop_token_ids:
            return FinishCause.STOP_TOKEN
        if choice.generated >= limits.max_tokens:
            return FinishCause.MAX_TOKENS
        return None

    # --- bookkeeping ------------------------------------------------------

    def _deliver(self, request: _Request, message: RequestOutput) -> None:
        try:
            request.submit.output.send_nowait(message)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            self._close(request)  # the client went away

    def _drop_choice(self, request: _Request, choice: _Choice, *, close: bool = True) -> None:
        request.choices.pop(choice.index, None)
        if self._rows.pop(choice.slot, None) is not None:
            self._to_free.append(choice.slot)
        if close and not request.choices:
            self._close(request)

    def _close(self, request: _Request) -> None:
        for choice in list(request.choices.values()):
            self._drop_choice(request, choice, close=False)
        if request in self._waiting:
            self._waiting.remove(request)
        self._requests.pop(request.spec.request_id, None)
        request.submit.output.close()

    def _fail(self, request: _Request, message: str) -> None:
        self._deliver(request, RequestFailed(message=message))
        self._close(request)

    def _publish_counters(self) -> None:
        self._handle.running_requests = len(self._requests) - len(self._waiting)
        self._handle.running_rows = len(self._rows)

    def _new_slot(self) -> int:
        self._next_slot += 1
        return self._next_slot

    # --- engine calls (worker thread) ---------------------------------------

    async def _engine_call(self, function: Callable[..., T], *args: object) -> T:
        return await anyio.to_thread.run_sync(function, *args)

    def _flush_frees(self) -> None:
        slots, self._to_free = self._to_free, []
        for slot in slots:
            self._engine.free(slot)

    def _decode(self, tokens: dict[int, int]) -> DecodeResult:
        self._flush_frees()
        return self._engine.decode(tokens)

    def _prefill(
        self, slots: Iterable[int], prompt_ids: tuple[int, ...], prompt_top: int | None
    ) -> tuple[np.ndarray, tuple[TokenLogprob | None, ...] | None]:
        self._flush_frees()
        first, *others = slots
        scores = None
        if prompt_top is None:
            logits = self._engine.prefill(first, prompt_ids)
        else:
            logits, scores = self._prefill_scoring(first, prompt_ids, prompt_top)
        for slot in others:
            self._engine.fork(first, slot)
        return logits, scores

    def _prefill_scoring(
        self, slot: int, prompt_ids: tuple[int, ...], top: int
    ) -> tuple[np.ndarray, tuple[TokenLogprob | None, ...]]:
        """Prefill in pieces, reducing each piece's logits at once: a long
        prompt's full-vocabulary logits are never all held together."""
        entries: list[TokenLogprob | None] = [None]
        logits = None
        for start in range(0, len(prompt_ids), PROMPT_SCORING_CHUNK):
            piece = prompt_ids[start : start + PROMPT_SCORING_CHUNK]
            every = self._engine.prefill(slot, piece, all_logits=True)
            targets = prompt_ids[start + 1 : start + 1 + len(piece)]
            entries += reduce_targets(every, targets, top)
            logits = every[-1:].copy()
            del every
        assert logits is not None
        return logits, tuple(entries)
