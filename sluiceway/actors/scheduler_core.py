"""The scheduler's rules, without I/O: events in, the next plan and messages out.

Theory of operation. :class:`SchedulerCore` holds every request the
scheduler knows of and decides what the engine does next; it never waits,
never reads a clock (each event that needs the time is given ``now``), and
never touches a channel. The actor in :mod:`sluiceway.actors.scheduler` is
its shell: it feeds it the events, runs its plans on the engine, and carries
its messages to each request's output (:meth:`SchedulerCore.take_messages`).
h11's connection has the same shape, and vLLM v1's scheduler keeps its rules
in ``schedule()`` and ``update_from_output()`` for the same reason: the
rules can be driven directly, by a test, one event at a time.

Events: :meth:`~SchedulerCore.command` (a request submitted, cancelled,
its reader caught up, one of its choices finished by the output actor),
:meth:`~SchedulerCore.plan` (the next step; a request whose reader is too
far behind, its ``Backlog.full``, is paused there), :meth:`~SchedulerCore.absorb`
and :meth:`~SchedulerCore.decide` (a step finished with these outcomes, these
tokens), :meth:`~SchedulerCore.engine_lost`, :meth:`~SchedulerCore.drain` and
the clock-driven rules (:meth:`~SchedulerCore.wake_after`,
:meth:`~SchedulerCore.release_due`: a tick with a time).

Each step the core plans:

- free the KV cache of rows that finished or were cancelled;
- prefill up to ``prefill_chunk_tokens`` prompt tokens: first the prompts
  already being prefilled, then paused choices coming back, then newly
  admitted requests in arrival order while rows are free (a request reserves
  its ``n`` rows when admitted; its choices share one prefill and fork the
  cache after the last chunk), so a long prompt never stalls the running
  streams for more than one chunk;
- decode every running row in one batched call.

With the prefix cache on (:mod:`sluiceway.actors.prefix_cache`), an admitted
request first takes the longest cached prefix of its prompt (copied into its
slot in the step of its first chunk) and prefills only the rest; each chunk
it prefills, and each row that finishes, is kept in the cache for later
requests.

Pacing. A request whose reader falls behind leaves the batch: its rows are
freed, their KV caches with them (the engines advance every running row
together, so a row cannot sit out a step in place), and the others decode as
if it were not there. When its reader has caught up and a row is free, each
of its choices is prefilled again with its prompt and the tokens it has
generated (vLLM's preemption by recomputation) and rejoins the batch where it
left off. A request paused for longer than ``stall_timeout`` ends
(``FailureCause.STALLED``).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from sluiceway.actors.engine_work import PrefillOutcome, PrefillWork, StepOutcome, StepPlan
from sluiceway.actors.prefix_cache import Hold, PrefixCacheStats, PrefixIndex
from sluiceway.actors.sampling import Draw
from sluiceway.engines.base import EngineInfo, KeepKV
from sluiceway.engines.grammar import Bitmask, every_token
from sluiceway.protocol.errors import ServiceUnavailable
from sluiceway.protocol.messages import (
    Cancel,
    ConstraintReport,
    FailureCause,
    FinishCause,
    GenerationRequest,
    LogitsStep,
    Outbox,
    PromptCached,
    PromptScores,
    RequestFailed,
    RequestOutput,
    Resume,
    Row,
    SchedulerCommand,
    StepOutput,
    Submit,
    TokenLogprob,
    TokenSample,
    is_argmax,
    is_unadjusted,
)

logger = logging.getLogger(__name__)

#: Least seconds between two give-backs of memory, so that a trickle of
#: requests does not pay for one after each.
RELEASE_INTERVAL_SECONDS = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    eos_ids: frozenset[int]
    max_num_seqs: int = 32
    max_queued_requests: int = 256
    prefill_chunk_tokens: int = 2048
    #: A request paused this long by a reader that does not keep up ends (None: never).
    stall_timeout: float | None = None
    #: Called with each request's seconds in the queue, when it is admitted.
    on_admitted: Callable[[float], None] | None = None
    #: What the prefix cache may hold, in bytes; 0 turns it off.
    prefix_cache_bytes: int = 0
    #: A cached prefix shorter than this is prefilled again, not restored:
    #: restoring costs a copy and sends the prompt down the eager packed
    #: path, where a fresh prompt takes the compiled prefill; a chat
    #: template's opening is such a prefix of nearly every prompt. Sixteen
    #: is vLLM's block, the least its prefix cache reuses.
    min_prefix_reuse: int = 16
    #: Seconds with no request after some work before the engine and the
    #: heap give memory back (``engine_work.release_memory``; None: never).
    release_memory_after: float | None = None


# The two messages are named tuples, not frozen dataclasses: one goes out
# per request per step, and a frozen dataclass's ``__init__`` (a
# ``object.__setattr__`` per field) showed in the event loop's CPU per token.
class Deliver(NamedTuple):
    """Put ``message`` in a request's output."""

    request_id: str
    output: Outbox[RequestOutput]
    message: RequestOutput


class CloseOutput(NamedTuple):
    """The request is over: close its output."""

    request_id: str
    output: Outbox[RequestOutput]


Message = Deliver | CloseOutput


class Counters(NamedTuple):
    """What the scheduler reports (``SchedulerHandle``'s fields)."""

    running_requests: int
    running_rows: int
    free_rows: int
    paused_requests: int
    cached_tokens: int


@dataclass(slots=True)
class Choice:
    """One choice of a running request: a row of the batch while it decodes."""

    request: Request
    index: int
    slot: int
    generated: int = 0
    last_token: int = -1
    row: Row | None = None
    #: Every token sampled, with the prefix cache on (to key the row's KV).
    tokens: list[int] | None = None
    #: The ids generated so far (to rebuild the KV cache after a pause).
    ids: list[int] = field(default_factory=list)

    @property
    def key(self) -> tuple[str, int]:
        """As ``Row.key``: the sampler's key for this choice's state."""
        return (self.request.spec.request_id, self.index)


@dataclass(slots=True)
class _Restore:
    """A paused choice being prefilled back into a new slot."""

    choice: Choice
    slot: int
    tokens: tuple[int, ...]
    #: Tokens prefilled so far.
    done: int = 0


@dataclass(slots=True)
class Request:
    submit: Submit
    #: When it was submitted (the shell's clock).
    arrived: float
    choices: dict[int, Choice] = field(default_factory=dict)
    #: Slots reserved at admission; the first one is prefilled, the others are forks.
    slots: tuple[int, ...] = ()
    prefilled: int = 0
    scores: list[TokenLogprob | None] | None = None
    #: Since when its reader has been too far behind (None: it keeps up).
    paused_since: float | None = None
    #: The prefix-cache path that holds the prompt's first tokens.
    hold: Hold | None = None
    #: Prompt tokens restored from the cache, and the entries to restore them from.
    cached: int = 0
    restore: tuple[int, ...] = ()

    @property
    def spec(self) -> GenerationRequest:
        return self.submit.request


@dataclass(frozen=True, slots=True)
class Planned:
    """The next step: its plan, the decoded rows the engine is to draw the
    tokens of, and the requests starting in it whose first tokens it draws
    (both need draws from the sampler's core before the plan runs:
    :func:`with_draws`)."""

    plan: StepPlan
    drawn: list[tuple[Choice, Row]]
    starting: dict[str, list[Row]]


class SchedulerCore:
    """Every planning rule of the scheduler, over plain data (see the module)."""

    def __init__(self, config: SchedulerConfig, info: EngineInfo, *, guided: bool) -> None:
        self._config = config
        self._info = info
        #: The sampler lends its guides and draws (the engine may pick
        #: guided and drawn rows' tokens).
        self._guided = guided
        self._waiting: deque[Request] = deque()
        self._prefilling: list[Request] = []
        #: Final chunks the engine left for its next step decoded ahead
        #: (``PrefillOutcome.deferred``); their outcomes come in the next
        #: step's ``StepOutcome.late``.
        self._deferred: list[PrefillWork] = []
        self._requests: dict[str, Request] = {}
        self._rows: dict[int, Choice] = {}
        #: Choices out of the batch because their reader fell behind.
        self._paused: list[Choice] = []
        #: Masks of free rows before ``min_tokens``, by the ids they suppress.
        self._suppress_masks: dict[tuple[int, ...], Bitmask] = {}
        self._restoring: dict[int, _Restore] = {}
        self._to_free: list[int] = []
        self._next_slot = 0
        self._step = 0
        self._prefix = _prefix_index(config, info)
        self._messages: list[Message] = []
        #: Requests that left the queue since the shell last asked.
        self._dequeued = 0
        self._draining = False
        #: Memory: whether steps ran since it was given back, when to give it back.
        self._worked = False
        self._release_at: float | None = None
        self._released = -math.inf

    # --- what the shell reads ------------------------------------------------

    @property
    def prefix_stats(self) -> PrefixCacheStats | None:
        return self._prefix.stats if self._prefix is not None else None

    @property
    def idle(self) -> bool:
        """No request is known (waiting, running or paused)."""
        return not self._requests

    @property
    def quiet(self) -> bool:
        """Idle, and nothing left for the engine to do (no slot to free, no
        prefix-cache edit to carry out, no prefill outcome to come)."""
        has_ops = self._prefix is not None and self._prefix.has_ops
        return self.idle and not (self._to_free or has_ops or self._deferred)

    def prefix_pins(self) -> int:
        """Pins on the prefix cache's paths (0 with it off)."""
        return self._prefix.pins() if self._prefix is not None else 0

    def take_messages(self) -> Sequence[Message]:
        if not self._messages:
            return ()
        messages, self._messages = self._messages, []
        return messages

    def take_dequeued(self) -> int:
        """Requests that left the queue (admitted or gone) since last asked."""
        dequeued, self._dequeued = self._dequeued, 0
        return dequeued

    def counters(self) -> Counters:
        return Counters(
            running_requests=len(self._requests) - len(self._waiting),
            running_rows=len(self._rows),
            free_rows=max(0, self._config.max_num_seqs - self._reserved_rows()),
            paused_requests=len({c.request.spec.request_id for c in self._paused}),
            cached_tokens=sum(
                len(c.request.spec.prompt_ids) + c.generated for c in self._rows.values()
            )
            + sum(r.prefilled for r in self._prefilling),
        )

    def running_keys(self) -> set[tuple[str, int]]:
        """The sampler's keys of every running choice, those this step does
        not decode included. The sampler forgets any other key, and
        forgetting one of these would restart its seeded stream (and its
        penalty counts and grammar walk):

        - a request whose final chunk was planned has drawn its first
          tokens, and until that step is back its choices are not rows yet;
        - a paused choice, or one being prefilled back, must come back
          where it was.
        """
        keys = {c.key for c in self._rows.values()}
        keys.update((r.spec.request_id, i) for r in self._prefilling for i in range(r.spec.n))
        keys.update(c.key for c in self._paused)
        keys.update(restore.choice.key for restore in self._restoring.values())
        return keys

    # --- events: commands ----------------------------------------------------

    def command(self, command: SchedulerCommand, now: float) -> None:
        """A command from the handle: submitted, cancelled, resumed, a choice finished."""
        if isinstance(command, Submit):
            if self._draining:
                raise ServiceUnavailable("the server is shutting down")
            admitted = Request(command, arrived=now)
            self._requests[command.request.request_id] = admitted
            self._waiting.append(admitted)
            return
        request = self._requests.get(command.request_id)
        if request is None:
            return  # already finished
        if isinstance(command, Cancel):
            self._close(request)
        elif isinstance(command, Resume):
            pass  # the next plan sees its backlog drained
        elif (choice := request.choices.get(command.choice)) is not None:
            self._drop_choice(request, choice, keep=True)

    def client_gone(self, request_id: str) -> None:
        """A request's output could not take a message: it ends (no message)."""
        request = self._requests.get(request_id)
        if request is not None:
            self._close(request)

    def drain(self) -> None:
        """No more submissions; what is known runs to its end."""
        self._draining = True

    # --- events: the engine --------------------------------------------------

    def engine_lost(self) -> None:
        """The engine died: every request fails, and its state died with it."""
        for request in list(self._requests.values()):
            self._fail(request, "the engine process was lost")
        self._to_free.clear()  # those slots died with the engine
        self._restoring.clear()
        self._deferred.clear()
        if self._prefix is not None:
            # The cached KV died with the engine too.
            self._prefix = _prefix_index(self._config, self._info)

    def shutdown(self) -> StepPlan:
        """Every request ends; the plan that frees what they held."""
        for request in list(self._requests.values()):
            self._close(request)
        return StepPlan(frees=self._take_frees())

    # --- ticks: the clock-driven rules --------------------------------------

    def started(self) -> None:
        """A plan went to the engine: memory is in use again."""
        self._worked, self._release_at = True, None

    def wake_after(self, now: float, *, poll: float | None) -> float:
        """Seconds an idle shell may wait for a command before the next tick:
        to end a stalled request, give memory back, or ``poll`` the engine."""
        self._plan_release(now)
        limit = math.inf
        if self._release_at is not None:
            limit = self._release_at - now
        timeout = self._config.stall_timeout
        if timeout is not None:
            for request in self._requests.values():
                if request.paused_since is not None:
                    limit = min(limit, request.paused_since + timeout - now)
        if poll is not None:
            limit = min(limit, poll)
        return max(limit, 0.0)

    def release_due(self, now: float) -> bool:
        """Whether to give memory back now (it is then counted as given)."""
        # A request that came in during the wait goes first.
        due = self._release_at is not None and now >= self._release_at and not self._requests
        if due:
            self._worked, self._release_at, self._released = False, None, now
        return due

    def _plan_release(self, now: float) -> None:
        """Once idle after some work: give memory back after the configured
        quiet time (and not sooner than an interval after the last time)."""
        delay = self._config.release_memory_after
        if delay is None or not self._worked or self._requests or self._release_at is not None:
            return
        self._release_at = max(now + delay, self._released + RELEASE_INTERVAL_SECONDS)

    # --- planning ------------------------------------------------------------

    def _reserved_rows(self) -> int:
        reserved = len(self._rows) + len(self._restoring)
        return reserved + sum(r.spec.n for r in self._prefilling)

    def _can_admit(self) -> bool:
        if not self._waiting:
            return False
        reserved = self._reserved_rows()
        return reserved == 0 or reserved + self._waiting[0].spec.n <= self._config.max_num_seqs

    def mask_needs(self) -> tuple[dict[int, Bitmask], list[Row], list[int]] | None:
        """What lets the next step be greedy with masked rows in it: the masks
        known here (by slot: the ids a free row may not pick before
        ``min_tokens``), and the guided rows whose masks the sampler has
        (with their slots). None: some decoding row needs the sampler anyway,
        which masks it then."""
        # The common step has no constrained row and none held back from EOS:
        # decide that from the specs, without building a Row per running
        # choice before every plan.
        if all(_free(c) for c in self._rows.values()):
            return {}, [], []
        masks: dict[int, Bitmask] = {}
        guided: list[Choice] = []
        for choice in self._rows.values():
            if choice.generated == 0:
                continue
            row = self._row(choice)
            if row.plain or self._drawable(row):
                continue
            if row.constraint is None and _greedy_suppressing(row):
                masks[choice.slot] = self._suppress_mask(row.suppress)
            elif self._guided and _greedy_guided(row):
                guided.append(choice)
            else:
                return None
        return masks, [self._row(c) for c in guided], [c.slot for c in guided]

    def _suppress_mask(self, suppress: tuple[int, ...]) -> Bitmask:
        """Every id but ``suppress``: a free greedy row before ``min_tokens``
        (kept per set of ids; a server sees few)."""
        mask = self._suppress_masks.get(suppress)
        if mask is None:
            mask = every_token(self._info.vocab_size, but=suppress)
            if len(self._suppress_masks) >= 64:
                self._suppress_masks.clear()
            self._suppress_masks[suppress] = mask
        return mask

    def plan(self, masks: Mapping[int, Bitmask], now: float) -> Planned | None:
        """The next step (None: nothing to do). ``masks``: by slot, the masks
        that let guided and suppressing rows be picked by the engine."""
        self._pause_lagging(now)
        budget = self._config.prefill_chunk_tokens
        prefills = []
        for request in self._prefilling:
            if budget <= 0:
                break
            if request.prefilled == len(request.spec.prompt_ids):
                continue  # its final chunk is under way (deferred by the engine)
            work = self._next_chunk(request, budget)
            budget -= len(work.tokens)
            prefills.append(work)
        restores = self._plan_restores(budget)
        budget -= sum(len(work.tokens) for work in restores)
        prefills += restores
        while budget > 0 and self._can_admit():
            request = self._admit(self._waiting.popleft(), now)
            work = self._next_chunk(request, budget)
            budget -= len(work.tokens)
            prefills.append(work)
        decoding = [c for c in self._rows.values() if c.generated > 0]
        decode = {c.slot: c.last_token for c in decoding}
        frees = self._take_frees()
        # Taken last: keeping the chunks above may have evicted entries.
        cache_ops = self._prefix.take_ops() if self._prefix is not None else ()
        # A step with nothing else in it still brings deferred chunks' outcomes.
        if not (cache_ops or frees or prefills or decode or self._deferred):
            return None
        starting = [self._requests[w.request_id] for w in prefills if w.final]
        drawn = self._drawn(decoding, masks)
        greedy = drawn is not None and all(
            _starts_plain(r.spec) or (self._guided and _starts_unadjusted(r.spec)) for r in starting
        )
        plan = StepPlan(
            cache_ops=cache_ops,
            frees=frees,
            prefills=tuple(prefills),
            decode=decode,
            greedy=greedy,
            masks={c.slot: masks[c.slot] for c in decoding if c.slot in masks} if greedy else {},
            ending=self._ending(decoding, prefills) if greedy else (),
            stop_ids=self._config.eos_ids if greedy else frozenset(),
        )
        to_draw: dict[str, list[Row]] = {}
        if greedy and self._guided:
            to_draw = {
                work.request_id: _first_rows(self._requests[work.request_id].spec)
                for work in prefills
                if work.final and not _starts_plain(self._requests[work.request_id].spec)
            }
        return Planned(plan, drawn if greedy and drawn else [], to_draw)

    def _ending(self, decoding: list[Choice], prefills: list[PrefillWork]) -> tuple[int, ...]:
        """The rows whose token from this step is their last by ``max_tokens``:
        decoding rows, and the choices of prompts whose final chunk this step
        prefills (a paused choice coming back is never a final chunk)."""
        ending = [c.slot for c in decoding if c.generated + 1 >= c.request.spec.limits.max_tokens]
        for work in prefills:
            if work.final and self._requests[work.request_id].spec.limits.max_tokens <= 1:
                ending += (work.slot, *work.forks)
        return tuple(ending)

    def _drawn(
        self, decoding: list[Choice], masks: Mapping[int, Bitmask]
    ) -> list[tuple[Choice, Row]] | None:
        """The rows the engine must draw when it picks the step's tokens
        (the others take their argmax, masked or not); None when a row needs
        the sampler."""
        drawn = []
        for choice in decoding:
            if choice.slot in masks:
                continue
            row = self._row(choice)
            if row.plain:
                continue
            if not self._drawable(row):
                return None
            drawn.append((choice, row))
        return drawn

    # --- pacing ----------------------------------------------------------------

    def _pause_lagging(self, now: float) -> None:
        """Take the rows of requests whose reader fell behind out of the
        batch; end the requests paused past the stall timeout."""
        lagging = [c for c in self._rows.values() if c.generated > 0 and _lags(c.request)]
        for choice in lagging:
            self._rows.pop(choice.slot)
            self._to_free.append(choice.slot)
            self._paused.append(choice)
            if choice.request.paused_since is None:
                choice.request.paused_since = now
        if not self._paused:
            return
        for request in {c.request.spec.request_id: c.request for c in self._paused}.values():
            if self._stalled(request, now):
                logger.warning(
                    "request %s stalled: its client stopped reading", request.spec.request_id
                )
                self._fail(request, "the client stopped reading", FailureCause.STALLED)

    def _stalled(self, request: Request, now: float) -> bool:
        timeout = self._config.stall_timeout
        since = request.paused_since
        return timeout is not None and since is not None and now - since >= timeout

    def _plan_restores(self, budget: int) -> list[PrefillWork]:
        """Prefill work that brings paused choices back, once their reader
        caught up: those under way first, then new ones while rows are free."""
        for choice in list(self._paused):
            if _lags(choice.request):
                continue
            if self._reserved_rows() >= self._config.max_num_seqs:
                break
            self._paused.remove(choice)
            choice.request.paused_since = None
            tokens = choice.request.spec.prompt_ids + tuple(choice.ids[:-1])
            slot = self._new_slot()
            self._restoring[slot] = _Restore(choice, slot, tokens)
        works = []
        for restore in self._restoring.values():
            if budget <= 0:
                break
            end = min(len(restore.tokens), restore.done + budget)
            if end == restore.done:
                continue  # the last chunk is under way
            works.append(
                PrefillWork(
                    request_id=restore.choice.request.spec.request_id,
                    slot=restore.slot,
                    tokens=restore.tokens[restore.done : end],
                    final=False,
                )
            )
            budget -= end - restore.done
            restore.done = end
        return works

    def _restored(self, work: PrefillWork, error: str | None) -> None:
        """A restore's chunk came back; after the last, the choice rejoins."""
        restore = self._restoring.get(work.slot)
        if restore is None:
            return
        request = restore.choice.request
        if error is not None:
            self._restoring.pop(work.slot)
            self._to_free.append(work.slot)
            if request.spec.request_id in self._requests:
                self._fail(request, error)
            return
        if restore.done == len(restore.tokens):  # that was the last chunk
            self._restoring.pop(work.slot)
            restore.choice.slot = work.slot
            self._rows[work.slot] = restore.choice

    def _admit(self, request: Request, now: float) -> Request:
        self._dequeued += 1
        if self._config.on_admitted is not None:
            self._config.on_admitted(now - request.arrived)
        spec = request.spec
        request.slots = tuple(self._new_slot() for _ in range(spec.n))
        if spec.logprobs.prompt_top is not None:
            request.scores = [None]
        if self._prefix is not None:
            # The last prompt token is always prefilled: its logits pick the
            # first token. A request for prompt logprobs reuses nothing, so
            # that every position is scored; its prompt is still kept.
            # A hold on a prefix too short to reuse still anchors the chunks
            # the prompt keeps (from its end on).
            reuse = 0 if request.scores is not None else len(spec.prompt_ids) - 1
            least = self._config.min_prefix_reuse
            hold = request.hold = self._prefix.lookup(spec.prompt_ids, reuse, least=least)
            if hold.length >= least:
                request.prefilled = request.cached = hold.length
                request.restore = hold.entries
        self._prefilling.append(request)
        return request

    def _next_chunk(self, request: Request, budget: int) -> PrefillWork:
        prompt = request.spec.prompt_ids
        start = request.prefilled
        end = min(len(prompt), start + budget)
        request.prefilled = end
        final = end == len(prompt)
        top = request.spec.logprobs.prompt_top
        restore, request.restore = request.restore, ()
        return PrefillWork(
            request_id=request.spec.request_id,
            slot=request.slots[0],
            tokens=prompt[start:end],
            final=final,
            top=top,
            targets=prompt[start + 1 : end + 1] if top is not None else (),
            forks=request.slots[1:] if final else (),
            restore=restore,
            restore_length=start if restore else 0,
            keep=self._keep_chunk(request, end),
        )

    def _keep_chunk(self, request: Request, end: int) -> KeepKV | None:
        """Room in the prefix cache for the prompt up to ``end``, beyond what it holds."""
        hold = request.hold
        if self._prefix is None or hold is None:
            return None
        entry = self._prefix.reserve(hold, request.spec.prompt_ids[:end])
        if entry is None:
            return None
        return KeepKV(entry=entry, slot=request.slots[0], start=hold.length, end=end)

    def _keep_row(self, request: Request, choice: Choice) -> None:
        """Keep a finished row's generated tokens (with the prompt's end, if
        that was not kept): a next turn that sends them back reuses them."""
        if self._prefix is None or request.hold is None or not choice.tokens:
            return
        # The last sampled token was never fed back, so the row has no KV for it.
        path = request.spec.prompt_ids + tuple(choice.tokens[:-1])
        self._prefix.keep_row(request.hold, path, choice.slot)

    # --- events: a step finished ----------------------------------------------

    def _prefilled(
        self, plan: StepPlan, outcome: StepOutcome
    ) -> list[tuple[PrefillWork, PrefillOutcome]]:
        """The prefills this outcome settles: the last step's deferred ones
        (a step that failed as a whole fails them too), then this plan's that
        ran; this plan's deferred ones are settled by the next."""
        late = outcome.late
        if len(late) != len(self._deferred):
            failure = PrefillOutcome(error=outcome.decode_error or "the engine lost this prefill")
            late = [failure] * len(self._deferred)
        settled = list(zip(self._deferred, late, strict=True))
        self._deferred = []
        for work, result in zip(plan.prefills, outcome.prefills, strict=True):
            if result.deferred:
                self._deferred.append(work)
            else:
                settled.append((work, result))
        return settled

    def absorb(self, plan: StepPlan, outcome: StepOutcome) -> Batch:
        """Bring the step's results in; return the rows to sample, with logits."""
        prefilled = self._prefilled(plan, outcome)
        if self._prefix is not None:
            self._settle_cache(self._prefix, plan, outcome, prefilled)
        rows = Batch()
        for work, result in prefilled:
            if work.slot in self._restoring:
                self._restored(work, result.error)
                continue
            request = self._requests.get(work.request_id)
            if request is None:
                continue
            if result.error is not None:
                self._fail(request, result.error)
                continue
            if request.scores is not None:
                request.scores += result.scores
            if work.final and result.logits is not None:
                for choice in self._start_choices(request):
                    picks, scores = result.greedy, None
                    if work.draws and picks is not None:  # a pick per choice
                        picks = picks[choice.index : choice.index + 1]
                        if result.first_logprobs is not None:
                            scores = [result.first_logprobs[choice.index]]
                    rows.add([choice], result.logits, picks, scores)
        if outcome.decode_error is not None:
            for choice in [c for c in self._rows.values() if c.generated > 0]:
                if choice.request.spec.request_id in self._requests:
                    self._fail(choice.request, outcome.decode_error)
        elif outcome.decode is not None:
            slots = outcome.decode.slots
            logits, greedy = outcome.decode.logits, outcome.decode_greedy
            scores = outcome.decode_logprobs
            kept = [i for i, slot in enumerate(slots) if slot in self._rows]
            if len(kept) < len(slots):
                # Rows that left while the step ran (cancelled, stopped): drop their results.
                logits = logits[kept]
                greedy = None if greedy is None else greedy[kept]
                scores = None if scores is None else [scores[i] for i in kept]
            rows.add([self._rows[slots[i]] for i in kept], logits, greedy, scores)
        return rows

    def _settle_cache(
        self,
        prefix: PrefixIndex,
        plan: StepPlan,
        outcome: StepOutcome,
        prefilled: list[tuple[PrefillWork, PrefillOutcome]],
    ) -> None:
        """Link what the engine kept into the prefix cache's tree."""
        if outcome.cache_error is not None:
            logger.error("%s; the prefix cache starts afresh", outcome.cache_error)
            prefix.reset()
        for op in plan.cache_ops:
            if isinstance(op, KeepKV) and (hold := prefix.kept(op.entry, ok=True)) is not None:
                prefix.release(hold)  # a finished row's: nobody goes on with it
        for work, result in prefilled:
            if work.keep is None:
                continue
            hold = prefix.kept(work.keep.entry, ok=result.kept)
            request = self._requests.get(work.request_id)
            if hold is None:
                continue
            if request is None or request.hold is None:
                prefix.release(hold)
                continue
            prefix.release(request.hold)
            request.hold = hold

    def _start_choices(self, request: Request) -> list[Choice]:
        self._prefilling.remove(request)
        if request.cached:
            self._deliver(request, PromptCached(tokens=request.cached))
        if request.scores is not None:
            self._deliver(request, PromptScores(entries=tuple(request.scores)))
            request.scores = None
        if request.spec.request_id not in self._requests:  # the client went away
            self._to_free += request.slots
            return []
        started = []
        keep_tokens = self._prefix is not None
        for index, slot in enumerate(request.slots):
            choice = Choice(
                request=request, index=index, slot=slot, tokens=[] if keep_tokens else None
            )
            request.choices[index] = choice
            self._rows[slot] = choice
            started.append(choice)
        return started

    def sample_step(self, batch: Batch) -> LogitsStep:
        """The step that asks the sampler for ``batch``'s tokens."""
        self._step += 1
        return LogitsStep(
            step=self._step,
            rows=tuple(self._row(c) for c in batch.choices),
            logits=batch.logits(),
            live=frozenset(self.running_keys()),
        )

    def rows(self, choices: Sequence[Choice]) -> list[Row]:
        return [self._row(c) for c in choices]

    def fail_constrained(self, choices: Sequence[Choice], report: ConstraintReport) -> None:
        """End the requests whose grammar failed; ``decide`` drops their rows' tokens."""
        for index, message in report.failed:
            request = choices[index].request
            if request.spec.request_id in self._requests:
                self._fail(request, message)

    def _row(self, choice: Choice) -> Row:
        spec = choice.request.spec
        limits = spec.limits
        suppress: tuple[int, ...] = ()
        if choice.generated < limits.min_tokens:
            eos = () if limits.ignore_eos else tuple(self._config.eos_ids)
            suppress = eos + tuple(limits.stop_token_ids)
        first = choice.generated == 0
        row = choice.row
        if row is None or row.first != first or row.suppress != suppress:
            row = choice.row = _spec_row(spec, choice.index, first=first, suppress=suppress)
        return row

    def _drawable(self, row: Row) -> bool:
        """Whether the engine can draw ``row``'s token (the sampler's core
        lends it the row's random number)."""
        return self._guided and row.unadjusted

    def decide(
        self,
        rows: Sequence[Choice],
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprob | None] | None,
        constraints: ConstraintReport | None = None,
    ) -> dict[str, list[TokenSample]]:
        """Take one step's tokens in: advance each row, end the rows that
        finished. The samples go out by :meth:`deliver_samples`."""
        per_request: dict[str, list[TokenSample]] = {}
        scores = logprobs or (None,) * len(rows)
        complete = constraints.complete if constraints is not None else frozenset()
        for index, (choice, token, logprob) in enumerate(zip(rows, token_ids, scores, strict=True)):
            if choice.request.spec.request_id not in self._requests:
                continue  # failed in this step
            token = int(token)
            choice.generated += 1
            choice.last_token = token
            choice.ids.append(token)
            if choice.tokens is not None:
                choice.tokens.append(token)
            finish = self._finish_cause(choice, token, grammar_complete=index in complete)
            sample = TokenSample(
                choice=choice.index, token_id=token, logprob=logprob, finish=finish
            )
            per_request.setdefault(choice.request.spec.request_id, []).append(sample)
            if finish is not None:
                self._drop_choice(choice.request, choice, close=False, keep=True)
        return per_request

    def deliver_samples(self, per_request: dict[str, list[TokenSample]]) -> None:
        for request_id, samples in per_request.items():
            request = self._requests.get(request_id)
            if request is None:
                continue
            self._deliver(request, StepOutput(samples=tuple(samples)))
            if not request.choices:
                self._close(request)

    def _finish_cause(
        self, choice: Choice, token: int, *, grammar_complete: bool = False
    ) -> FinishCause | None:
        # Before min_tokens the sampler cannot pick EOS or a stop token (they
        # are suppressed in its row), so these checks need no min_tokens test;
        # a grammar that allows only EOS overrides min_tokens.
        limits = choice.request.spec.limits
        if token in self._config.eos_ids and not limits.ignore_eos:
            return FinishCause.EOS
        if token in limits.stop_token_ids:
            return FinishCause.STOP_TOKEN
        if grammar_complete:
            return FinishCause.GRAMMAR
        if choice.generated >= limits.max_tokens:
            return FinishCause.MAX_TOKENS
        return None

    # --- bookkeeping -----------------------------------------------------------

    def _deliver(self, request: Request, message: RequestOutput) -> None:
        self._messages.append(Deliver(request.spec.request_id, request.submit.output, message))

    def _drop_choice(
        self, request: Request, choice: Choice, *, close: bool = True, keep: bool = False
    ) -> None:
        """``keep``: the row ended normally, and its KV goes to the prefix cache."""
        request.choices.pop(choice.index, None)
        if self._rows.pop(choice.slot, None) is not None:
            if keep:
                self._keep_row(request, choice)
            self._to_free.append(choice.slot)
        else:
            self._forget_parked(choice)
        if close and not request.choices:
            self._close(request)

    def _forget_parked(self, choice: Choice) -> None:
        """A choice that is no row ends: paused (its row was freed while its
        reader lagged) or being restored. Left there, it would come back and
        decode past its end."""
        self._paused = [c for c in self._paused if c is not choice]
        for slot in [s for s, r in self._restoring.items() if r.choice is choice]:
            del self._restoring[slot]
            self._to_free.append(slot)

    def _close(self, request: Request) -> None:
        if self._requests.pop(request.spec.request_id, None) is None:
            return
        # Dropping each choice also forgets the parked ones (paused or being restored).
        for choice in list(request.choices.values()):
            self._drop_choice(request, choice, close=False)
        if request in self._waiting:
            self._waiting.remove(request)
            self._dequeued += 1
        if request in self._prefilling:
            self._prefilling.remove(request)
            self._to_free += request.slots
        if request.hold is not None and self._prefix is not None:
            self._prefix.release(request.hold)
            request.hold = None
        self._messages.append(CloseOutput(request.spec.request_id, request.submit.output))

    def _fail(
        self, request: Request, message: str, cause: FailureCause = FailureCause.ENGINE
    ) -> None:
        self._deliver(request, RequestFailed(message=message, cause=cause))
        self._close(request)

    def _take_frees(self) -> tuple[int, ...]:
        frees, self._to_free = tuple(self._to_free), []
        return frees

    def _new_slot(self) -> int:
        self._next_slot += 1
        return self._next_slot


def with_draws(planned: Planned, draws: Sequence[Draw]) -> StepPlan:
    """``planned``'s plan with the sampler's draws: one per drawn row, then
    one per choice of each starting request (as :attr:`Planned.starting`
    lists them)."""
    plan = planned.plan
    given = iter(draws)
    by_slot = {choice.slot: next(given) for choice, _ in planned.drawn}
    starting = planned.starting
    prefills = tuple(
        replace(work, draws=tuple(next(given) for _ in starting[work.request_id]))
        if work.final and work.request_id in starting
        else work
        for work in plan.prefills
    )
    return replace(plan, draws=by_slot, prefills=prefills)


@dataclass(slots=True)
class Batch:
    """The rows of one sampling step, with their logits as engine blocks."""

    choices: list[Choice] = field(default_factory=list)
    blocks: list[np.ndarray] = field(default_factory=list)
    #: The engine's pick per row, when it picked the whole step's tokens.
    greedy_blocks: list[np.ndarray] | None = field(default_factory=list)
    #: The logprobs of the rows the engine drew, where one asked (else None).
    scores: list[TokenLogprob | None] | None = None

    def add(
        self,
        choices: list[Choice],
        block: np.ndarray,
        greedy: np.ndarray | None,
        scores: list[TokenLogprob | None] | None,
    ) -> None:
        assert len(choices) == block.shape[0]
        if scores is not None or self.scores is not None:
            none: list[TokenLogprob | None] = [None]
            before = self.scores if self.scores is not None else none * len(self.choices)
            self.scores = before + (scores if scores is not None else none * len(choices))
        self.choices += choices
        self.blocks.append(block)
        if greedy is None or self.greedy_blocks is None:
            self.greedy_blocks = None
        else:
            self.greedy_blocks.append(greedy)

    @property
    def greedy(self) -> list[int] | None:
        if self.greedy_blocks is None or not self.choices:
            return None
        return [int(t) for block in self.greedy_blocks for t in block.tolist()]

    def logits(self) -> np.ndarray:
        # The usual step is one decode block, passed on without a copy.
        return self.blocks[0] if len(self.blocks) == 1 else np.concatenate(self.blocks)


def _lags(request: Request) -> bool:
    """Whether the request's reader is too far behind (its mailbox says
    ``full``: the "reader full" event is read where it is kept)."""
    backlog = request.submit.backlog
    return backlog is not None and backlog.full


def _prefix_index(config: SchedulerConfig, info: EngineInfo) -> PrefixIndex | None:
    if config.prefix_cache_bytes <= 0 or info.kv_bytes_per_token <= 0:
        return None
    return PrefixIndex(
        budget_bytes=config.prefix_cache_bytes, bytes_per_token=info.kv_bytes_per_token
    )


def _free(choice: Choice) -> bool:
    """A choice that needs no mask: no constraint, and past ``min_tokens``."""
    spec = choice.request.spec
    return spec.constraint is None and choice.generated >= spec.limits.min_tokens


def _masked_argmax(row: Row) -> bool:
    """Whether a row's next token is an argmax among what a mask allows:
    greedy, nothing to adjust, no logprobs, and not its first token (the
    first goes through the sampler with the rest of its prefill's step)."""
    sampling = row.sampling
    return (
        not row.first
        and sampling.greedy
        and not sampling.logit_bias
        and not sampling.penalised
        and not row.logprobs.per_token
    )


def _greedy_guided(row: Row) -> bool:
    """A constrained row whose next token the engine can pick under its
    grammar's mask (the grammar engine computes a row's first mask as it
    starts the row, in the sampler). ``suppress`` goes into the mask."""
    return row.constraint is not None and _masked_argmax(row)


def _greedy_suppressing(row: Row) -> bool:
    """A free greedy row held back from EOS and stop tokens (``min_tokens``):
    an argmax among every other id, as the sampler would pick."""
    return bool(row.suppress) and _masked_argmax(row)


def _starts_unadjusted(spec: GenerationRequest) -> bool:
    """Whether a request's first tokens can be drawn by the engine (its
    first rows are ``Row.unadjusted``: with ``min_tokens`` they suppress EOS)."""
    return is_unadjusted(spec.sampling, spec.constraint) and spec.limits.min_tokens == 0


def _spec_row(
    spec: GenerationRequest, index: int, *, first: bool, suppress: tuple[int, ...] = ()
) -> Row:
    return Row(
        request_id=spec.request_id,
        choice=index,
        sampling=spec.sampling,
        logprobs=spec.logprobs,
        prompt_ids=spec.prompt_ids,
        first=first,
        suppress=suppress,
        constraint=spec.constraint,
    )


def _first_rows(spec: GenerationRequest) -> list[Row]:
    """The rows of a request's choices for their first token, as ``_row``
    makes them (for a request that starts unadjusted, so none suppresses)."""
    return [_spec_row(spec, index, first=True) for index in range(spec.n)]


def _starts_plain(spec: GenerationRequest) -> bool:
    """Whether a request's first token is a plain argmax (``Row.plain``; with
    ``min_tokens`` its first row suppresses EOS)."""
    return is_argmax(spec.sampling, spec.logprobs, spec.constraint) and spec.limits.min_tokens == 0
