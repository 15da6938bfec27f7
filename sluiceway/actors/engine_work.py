"""One scheduler step's engine work, run on the engine's own thread.

The scheduler plans a step on the event loop (which slots to free, which
prompt chunks to prefill, which rows to decode) and this module carries it
out in one call on the engine thread, so a step costs one thread hop. Each
part's failure is caught and reported for the requests it concerns: an engine
error ends those requests, never the server.

All engine work -- loading included -- runs on one dedicated thread: mlx
binds arrays to the stream of the thread that made them, and torch keeps
per-thread state, so the engine must not wander between pool threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from queue import SimpleQueue
from typing import Concatenate, Generic, ParamSpec, Protocol, TypeVar, cast, runtime_checkable

import anyio
import numpy as np
import numpy.typing as npt
import sniffio

from sluiceway.actors.channels import event_factory
from sluiceway.actors.logprobs import reduce_targets
from sluiceway.actors.sampling import Draw, draw_rows
from sluiceway.engines.base import CacheOp, DecodeResult, Engine, KeepKV, Logits, PackingEngine
from sluiceway.engines.grammar import Bitmask, mask_logits
from sluiceway.engines.memory import give_back_heap
from sluiceway.protocol.messages import TokenLogprob

logger = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")


def _soon_in_this_loop() -> Callable[[Callable[[], object]], None]:
    """A thread-safe "call this soon in the running event loop" for asyncio or trio."""
    if sniffio.current_async_library() == "trio":
        import trio

        run_soon: Callable[[Callable[[], object]], None] = (
            trio.lowlevel.current_trio_token().run_sync_soon
        )
    else:
        loop = asyncio.get_running_loop()

        def run_soon(callback: Callable[[], object]) -> None:
            loop.call_soon_threadsafe(callback)

    def call(callback: Callable[[], object]) -> None:
        # A loop that has already finished has nobody left to wake.
        with contextlib.suppress(RuntimeError):
            run_soon(callback)

    return call


@dataclass(frozen=True, slots=True)
class LoopLink:
    """How the engine thread reaches one event loop: a thread-safe way to
    call into it, and its events. Made inside that loop; a caller that starts
    work every step keeps one rather than looking the loop up each time."""

    call_soon: Callable[[Callable[[], object]], None]
    make_event: Callable[[], anyio.Event]

    @classmethod
    def here(cls) -> LoopLink:
        return cls(_soon_in_this_loop(), event_factory())


class Running(Generic[T]):
    """A call under way on the engine thread; it reports once, from that thread."""

    __slots__ = ("_done", "_error", "_value", "_wake", "reported")

    def __init__(self, link: LoopLink) -> None:
        self._done = link.make_event()
        self._wake = link.call_soon
        self._value: T | None = None
        self._error: BaseException | None = None
        self.reported = False

    def report(self, value: T) -> None:
        self._value = value
        self.reported = True
        self._wake(self._done.set)

    def fail(self, error: BaseException) -> None:
        self._error = error
        self.reported = True
        self._wake(self._done.set)

    async def result(self) -> T:
        """Wait for the call. A cancelled caller still waits for the engine
        to finish, so the engine is never left mid-call (the shield is only
        set up on that path: it costs a task lookup per step)."""
        try:
            await self._done.wait()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._done.wait()
            raise
        if self._error is not None:
            raise self._error
        return cast(T, self._value)


class EngineThread:
    """The one thread that runs the engine."""

    def __init__(self) -> None:
        self._jobs: SimpleQueue[Callable[[], None] | None] = SimpleQueue()
        # A daemon: a process that ends without close() (a crash, a failed
        # start-up) must not hang at exit on an engine stuck in a call.
        self._thread = threading.Thread(target=self._serve, name="engine", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    async def run(self, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run ``function`` on the engine thread and wait for it."""
        return await self.start(function, *args, **kwargs).result()

    def start(self, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> Running[T]:
        """Start ``function`` on the engine thread; await ``result()`` later."""

        def call(report: Callable[[T], None]) -> None:
            report(function(*args, **kwargs))

        return self.start_reporting(LoopLink.here(), call)

    def start_reporting(
        self,
        link: LoopLink,
        function: Callable[Concatenate[Callable[[T], None], P], None],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> Running[T]:
        """Start ``function`` on the engine thread; it hands its result over
        through the callback it gets first, and may go on working after that
        (the engine decoding ahead). The caller's wait ends at the handover.

        The engine thread wakes the event loop itself: one thread hop each way
        (a worker thread parked on a future would add two).
        """
        running: Running[T] = Running(link)

        def job() -> None:
            try:
                function(running.report, *args, **kwargs)
            except BaseException as error:
                if running.reported:
                    logger.exception("engine work after the handover failed")
                else:
                    running.fail(error)

        self._jobs.put(job)
        return running

    def close(self) -> None:
        """Finish the work already started, then end the thread."""
        self._jobs.put(None)
        self._thread.join()


#: The most prompt tokens packed into one forward pass (:func:`packed_pass`).
#: A chunk costs its arithmetic there, which grows with its length, while the
#: pass it saves does not; and a decode step packed with chunks waits for them.
PACKED_TOKENS = 512
#: The most prompt tokens in one pass of new prompts that the engine prefills
#: apart from the decode (:meth:`~sluiceway.engines.base.PackingEngine.prefills_apart`):
#: no decode waits inside such a pass, and one pass of sixteen 64-token
#: prompts took 72.9 ms against 83.8 for two of eight (42M bench model,
#: compiled prefill, engine alone).
APART_TOKENS = 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillWork:
    """One chunk of one prompt. ``targets`` are the prompt tokens that follow
    each position of the chunk, scored when ``top`` is set; ``forks`` are the
    slots the prefilled slot is copied into after its final chunk.

    Prefix cache: the first chunk of a prompt whose start is cached first
    restores ``restore_length`` positions from the entries ``restore`` into
    the slot; ``keep`` copies the slot's new positions into an entry after
    the chunk."""

    request_id: str
    slot: int
    tokens: tuple[int, ...]
    final: bool
    top: int | None = None
    targets: tuple[int, ...] = ()
    forks: tuple[int, ...] = ()
    restore: tuple[int, ...] = ()
    restore_length: int = 0
    keep: KeepKV | None = None
    #: In a step whose tokens the engine picks, the final chunk of a request
    #: whose choices are drawn: one draw per choice (``slot``, then ``forks``).
    draws: tuple[Draw, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class StepPlan:
    """``greedy``: every row sampled this step is greedy with no logprobs,
    bias or penalties, so the engine thread picks the tokens itself; a
    decoded row with a grammar (or ``min_tokens``) to obey has its mask in
    ``masks`` (by slot: the tokens it may pick, as the sampler would mask
    them), and its pick is the argmax among those.
    ``draws`` (by slot) are the decoded rows the engine thread picks
    otherwise, in a step it picks the tokens of: sampled rows, and rows that
    want logprobs, with nothing to adjust (``Row.unadjusted``); their
    logprobs come back in ``StepOutcome.decode_logprobs``.
    ``cache_ops`` (prefix-cache edits, and copies of finished rows) run
    first, before ``frees``.
    ``ending`` (slots: rows decoded or starting) and ``stop_ids``: the rows
    whose token from this step is their last (``max_tokens``), and the ids
    that end a row when it picks them (the model's EOS); the step decoded
    ahead (:mod:`sluiceway.actors.run_ahead`) leaves such rows out."""

    cache_ops: tuple[CacheOp, ...] = ()
    frees: tuple[int, ...] = ()
    prefills: tuple[PrefillWork, ...] = ()
    decode: Mapping[int, int] = field(default_factory=dict)
    greedy: bool = False
    masks: Mapping[int, Bitmask] = field(default_factory=dict)
    draws: Mapping[int, Draw] = field(default_factory=dict)
    ending: tuple[int, ...] = ()
    stop_ids: frozenset[int] = frozenset()

    def __reduce__(self) -> tuple[Callable[..., StepPlan], tuple[object, ...]]:
        # A sampled step's plan crosses the engine's pipe with one draw per
        # row: as plain tuples 16 of them pickle in ~2 µs, against ~13 µs
        # as named tuples (whose pickling calls Python once each).
        draws = {slot: tuple(draw) for slot, draw in self.draws.items()}
        fields = (self.cache_ops, self.frees, self.prefills, self.decode, self.greedy)
        return (_unpickled_plan, (*fields, self.masks, draws, self.ending, self.stop_ids))


def _unpickled_plan(
    cache_ops: tuple[CacheOp, ...],
    frees: tuple[int, ...],
    prefills: tuple[PrefillWork, ...],
    decode: Mapping[int, int],
    greedy: bool,
    masks: Mapping[int, Bitmask],
    draws: Mapping[int, tuple[object, ...]],
    ending: tuple[int, ...],
    stop_ids: frozenset[int],
) -> StepPlan:
    return StepPlan(
        cache_ops=cache_ops,
        frees=frees,
        prefills=prefills,
        decode=decode,
        greedy=greedy,
        masks=masks,
        draws={slot: Draw._make(values) for slot, values in draws.items()},
        ending=ending,
        stop_ids=stop_ids,
    )


@dataclass(slots=True)
class PrefillOutcome:
    logits: Logits | None = None
    scores: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None
    #: The first token, in a step whose tokens the engine picks: the argmax
    #: of ``logits``, or with ``PrefillWork.draws`` each choice's pick.
    greedy: npt.NDArray[np.int64] | None = None
    #: Each choice's logprobs for its drawn first token, where one asked.
    first_logprobs: list[TokenLogprob | None] | None = None
    #: The work's ``keep`` was carried out.
    kept: bool = False
    #: Not run yet: it goes into the forward pass of the step decoded ahead,
    #: and its outcome comes in the next step's ``StepOutcome.late``
    #: (:mod:`sluiceway.actors.run_ahead`).
    deferred: bool = False


@dataclass(slots=True)
class StepOutcome:
    prefills: list[PrefillOutcome]
    decode: DecodeResult | None = None
    decode_error: str | None = None
    #: The token of each decoded row, in a greedy step: its argmax, or its
    #: pick by the plan's ``draws``.
    decode_greedy: npt.NDArray[np.int64] | None = None
    #: The logprobs of each decoded row, when a drawn row asked for them.
    decode_logprobs: list[TokenLogprob | None] | None = None
    #: Why the plan's ``cache_ops`` did not all run.
    cache_error: str | None = None
    #: The outcomes of the previous step's deferred prefills, in its order.
    late: list[PrefillOutcome] = field(default_factory=list)


class PendingStep(Protocol):
    """A step under way; ``result()`` waits for it, shielded from cancellation."""

    async def result(self) -> StepOutcome: ...


@runtime_checkable
class StepChannel(Protocol):
    """An engine that takes whole steps over a channel of its own (one in a
    child process), started and awaited from the event loop."""

    def start_step(self, plan: StepPlan) -> PendingStep: ...


def failed_step(plan: StepPlan, message: str) -> StepOutcome:
    """The outcome of a step the engine could not run at all: every part failed."""
    return StepOutcome(
        prefills=[PrefillOutcome(error=message) for _ in plan.prefills],
        decode_error=message if plan.decode else None,
        cache_error=message if plan.cache_ops else None,
    )


def execute(
    engine: Engine,
    plan: StepPlan,
    *,
    decoded: DecodeResult | None = None,
    defer: Callable[[PrefillWork], bool] | None = None,
    pack: bool = False,
) -> StepOutcome:
    """Carry out ``plan``. ``decoded``: the plan's decode, already run ahead
    of the plan; ``defer``: which prefills to leave for the step decoded
    ahead next (see :mod:`sluiceway.actors.run_ahead`); ``pack``: the engine
    packs chunks into one forward pass (:func:`packed_pass`), with the
    plan's decode if it is still to run, unless it takes them apart from
    the decode (:func:`_apart`)."""
    if not (plan.cache_ops or plan.frees or plan.prefills):
        # The steady step: nothing but a decode. Skipping the machinery
        # below saves the engine's process ~4 µs a step (17.7 -> 13.8 µs
        # median at batch 1), on the path between two forward passes.
        return _decoded(engine, plan, StepOutcome(prefills=[], decode=decoded))
    cache_error = _edit_cache(engine, plan.cache_ops)
    for slot in plan.frees:
        engine.free(slot)
    # A pass takes one chunk per slot (each writes at its slot's end).
    pack = pack and len({work.slot for work in plan.prefills}) == len(plan.prefills)
    prefills: list[PrefillOutcome | None] = []
    to_pack: list[PrefillWork] = []
    for work in plan.prefills:
        if cache_error is not None and work.restore_length:
            # After a failed edit, an entry may hold other positions than
            # the plan assumed: no restore in this step.
            prefills.append(PrefillOutcome(error=cache_error))
        elif defer is not None and defer(work):
            prefills.append(PrefillOutcome(deferred=True))
        elif pack and packable(work):
            to_pack.append(work)
            prefills.append(None)
        else:
            prefills.append(_prefill(engine, work))
    outcome = StepOutcome(prefills=[], decode=decoded, cache_error=cache_error)
    tokens = plan.decode if decoded is None else {}
    # Taken apart, the decode runs on its own in _decoded().
    packed, groups = _passes(engine, tokens, to_pack)
    ran = iter(_run_groups(engine, outcome, packed, groups))
    outcome.prefills = [p if p is not None else next(ran) for p in prefills]
    return _decoded(engine, plan, outcome)


def packed_passes(
    engine: Engine, tokens: Mapping[int, int], works: Sequence[PrefillWork]
) -> tuple[DecodeResult | None, list[PrefillOutcome]]:
    """Decode ``tokens`` (if any) and prefill ``works`` (each
    :func:`packable`, one per slot) in as few forward passes as
    :data:`PACKED_TOKENS` allows, the decode in the first (or, where the
    engine takes them apart, passes of :data:`APART_TOKENS` and the decode
    alone after them); returns the decode's result (None without one, or
    when its pass failed) and each chunk's outcome."""
    outcome = StepOutcome(prefills=[])
    packed, groups = _passes(engine, tokens, works)
    ran = _run_groups(engine, outcome, packed, groups)
    if tokens and not packed:  # taken apart: the decode after the passes
        outcome.decode, _ = _decode_alone(engine, tokens)
    return outcome.decode, ran


def _passes(
    engine: Engine, tokens: Mapping[int, int], works: Sequence[PrefillWork]
) -> tuple[Mapping[int, int], list[list[PrefillWork]]]:
    """The decode to pack into the first pass (none where the engine takes
    ``works`` apart from it), and ``works`` cut into the groups of one pass
    each: :data:`PACKED_TOKENS` a pass, or :data:`APART_TOKENS` apart."""
    if _apart(engine, tokens, works):
        return {}, _pass_groups(works, APART_TOKENS)
    return tokens, _pass_groups(works)


def _apart(engine: Engine, tokens: Mapping[int, int], works: Sequence[PrefillWork]) -> bool:
    """Whether ``works``, new prompts only, go in passes of their own, and
    the decode of ``tokens`` in one of its own after them (the engine's call:
    :meth:`~sluiceway.engines.base.PackingEngine.prefills_apart`)."""
    if not tokens or not works or any(work.restore_length for work in works):
        return False
    assert isinstance(engine, PackingEngine)
    return engine.prefills_apart([(work.slot, len(work.tokens)) for work in works])


def _decode_alone(
    engine: Engine, tokens: Mapping[int, int]
) -> tuple[DecodeResult | None, str | None]:
    """Decode ``tokens``; the result, or None and why it failed (reported to
    the requests in the batch, not raised)."""
    try:
        return engine.decode(tokens), None
    except Exception as error:
        logger.exception("decode failed")
        return None, f"decode failed: {error}"


def _pass_groups(works: Sequence[PrefillWork], cap: int = PACKED_TOKENS) -> list[list[PrefillWork]]:
    """``works`` in order, cut into the groups of one packed pass each, of
    at most ``cap`` tokens."""
    groups: list[list[PrefillWork]] = []
    budget = PackBudget(left=0)
    for work in works:
        if not budget.take(work):  # this pass is full: start the next
            budget = PackBudget(left=cap)
            budget.take(work)
            groups.append([])
        groups[-1].append(work)
    return groups


def _decoded(engine: Engine, plan: StepPlan, outcome: StepOutcome) -> StepOutcome:
    """``outcome`` with the plan's decode run (unless it ran already) and,
    in a greedy step, every token picked."""
    if outcome.decode is None and plan.decode:
        outcome.decode, outcome.decode_error = _decode_alone(engine, plan.decode)
    if plan.greedy:
        # An argmax is cheaper than a round trip to the sampler and back.
        for work, prefilled in zip(plan.prefills, outcome.prefills, strict=True):
            pick_first(work, prefilled)
        if outcome.decode is not None:
            picks = greedy_picks(outcome.decode, plan.masks)
            if plan.draws:
                outcome.decode_logprobs = _draw(outcome.decode, picks, plan.draws)
            outcome.decode_greedy = picks
    return outcome


def packs(engine: Engine) -> bool:
    """Whether ``engine`` prefills chunks inside a decode's forward pass."""
    return isinstance(engine, PackingEngine) and engine.packs_prefills


def packable(work: PrefillWork) -> bool:
    """Whether a chunk may go into a packed pass: not one that asks for
    prompt logprobs (those need every position's logits), nor a longer one
    than a pass takes."""
    return work.top is None and len(work.tokens) <= PACKED_TOKENS


@dataclass(slots=True)
class PackBudget:
    """What is left of one packed pass's :data:`PACKED_TOKENS`."""

    left: int = PACKED_TOKENS

    def take(self, work: PrefillWork) -> bool:
        if not packable(work) or len(work.tokens) > self.left:
            return False
        self.left -= len(work.tokens)
        return True


def _run_groups(
    engine: Engine,
    outcome: StepOutcome,
    tokens: Mapping[int, int],
    groups: list[list[PrefillWork]],
) -> list[PrefillOutcome]:
    """Each group of chunks in a packed pass, the first with the plan's
    decode (``tokens``, if it is still to run; its result goes in
    ``outcome``); a lone chunk without a decode takes a pass of its own."""
    results: list[PrefillOutcome] = []
    for group in groups:
        if tokens or len(group) > 1:  # only then is a pass saved
            together, ran = packed_pass(engine, tokens, group)
            if together is not None:
                outcome.decode = together
            tokens = {}
        else:
            ran = [_prefill(engine, group[0])]
        results += ran
    return results


def packed_pass(
    engine: Engine, tokens: Mapping[int, int], works: Sequence[PrefillWork]
) -> tuple[DecodeResult | None, list[PrefillOutcome]]:
    """Decode ``tokens`` (if any) and prefill ``works`` in one forward pass;
    returns the decode's result (None without one) and each chunk's outcome.

    If the pass fails, each chunk is prefilled alone, so that a failure
    reaches only the requests it concerns, and the decode is left to the
    caller (None)."""
    assert isinstance(engine, PackingEngine)
    try:
        for work in works:
            _restore(engine, work)
        result, logits = engine.decode_prefilling(
            tokens, [(work.slot, work.tokens) for work in works]
        )
    except Exception:
        logger.exception("a forward pass with prompt chunks packed into it failed")
        for work in works:
            if work.restore_length:  # its slot holds no more than the restored prefix
                engine.free(work.slot)
        return None, [_prefill(engine, work) for work in works]
    finished = [_finish_chunk(engine, w, last) for w, last in zip(works, logits, strict=True)]
    return (result if tokens else None), finished


def pick_first(work: PrefillWork, prefilled: PrefillOutcome) -> None:
    """In a step whose tokens the engine picks: the first token of each of
    the prompt's choices, once its final chunk has logits."""
    if prefilled.logits is None:
        return
    if work.draws:
        prefilled.greedy, prefilled.first_logprobs = _draw_first(prefilled.logits, work.draws)
    else:
        prefilled.greedy = prefilled.logits.argmax(axis=-1)


def _draw(
    decoded: DecodeResult, picks: npt.NDArray[np.int64], draws: Mapping[int, Draw]
) -> list[TokenLogprob | None] | None:
    """Pick the drawn rows of a decode (in ``picks``): sampled here, where
    the logits are, the logits need not travel to the sampler, and the next
    step is decoded ahead of its plan as a greedy one is."""
    rows = [(i, draws[slot]) for i, slot in enumerate(decoded.slots) if slot in draws]
    return draw_rows(decoded.logits, picks, rows)


def _draw_first(
    logits: Logits, draws: tuple[Draw, ...]
) -> tuple[npt.NDArray[np.int64], list[TokenLogprob | None] | None]:
    """Each choice's first token from its prompt's last logits, and its logprobs."""
    block = np.repeat(np.asarray(logits[-1:], dtype=np.float32), len(draws), axis=0)
    picks: npt.NDArray[np.int64] = block.argmax(axis=-1)
    return picks, draw_rows(block, picks, list(enumerate(draws)))


def release_memory(engine: Engine) -> None:
    """While no slot is in use: the engine gives back what it keeps for
    speed, then this process's heap its free pages (an engine in a child
    process does both there, and this process then trims its own heap)."""
    engine.release_memory()
    give_back_heap()


def greedy_picks(decoded: DecodeResult, masks: Mapping[int, Bitmask]) -> npt.NDArray[np.int64]:
    """Each row's argmax; a masked row's among what its mask allows. The
    mask goes on a copy of the row: the logits stay the model's."""
    picks: npt.NDArray[np.int64] = decoded.logits.argmax(axis=-1)
    if masks:
        for i, slot in enumerate(decoded.slots):
            mask = masks.get(slot)
            if mask is not None:
                row = np.array(decoded.logits[i], dtype=np.float32)
                mask_logits(row, mask)
                picks[i] = row.argmax()
    return picks


def _edit_cache(engine: Engine, ops: tuple[CacheOp, ...]) -> str | None:
    """Apply every edit, even after one failed (the scheduler then forgets
    the whole cache and drops every entry it knows of: the drops queued
    before that must have run too). Returns the first failure."""
    failure = None
    for op in ops:
        try:
            engine.cache_op(op)
        except Exception as error:
            logger.exception("prefix cache edit %s failed", op)
            failure = failure or f"prefix cache edit failed: {error}"
    return failure


def _prefill(engine: Engine, work: PrefillWork) -> PrefillOutcome:
    scores: list[TokenLogprob] = []
    try:
        _restore(engine, work)
        if work.top is None:
            logits = engine.prefill(work.slot, work.tokens)
        else:
            every = engine.prefill(work.slot, work.tokens, all_logits=True)
            # Reduced at once: a prompt's full logits are never all held.
            scores = reduce_targets(every, work.targets, work.top)
            logits = np.ascontiguousarray(every[-1:])
            del every
    except Exception as error:  # reported to this request only
        logger.exception("prefill failed")
        return PrefillOutcome(error=f"prefill failed: {error}")
    outcome = _finish_chunk(engine, work, logits)
    outcome.scores = scores
    return outcome


def _restore(engine: Engine, work: PrefillWork) -> None:
    """Before a prompt's first chunk: the start the prefix cache holds, if any."""
    if work.restore_length:
        engine.restore(work.slot, work.restore, work.restore_length)


def _finish_chunk(engine: Engine, work: PrefillWork, logits: Logits) -> PrefillOutcome:
    """After a chunk's forward pass (``logits``: its last position's): a
    final chunk's logits and its choices' forks, then the prefix-cache keep."""
    outcome = PrefillOutcome()
    if work.final:
        try:
            for slot in work.forks:
                engine.fork(work.slot, slot)
        except Exception as error:  # reported to this request only
            logger.exception("prefill failed")
            return PrefillOutcome(error=f"prefill failed: {error}")
        outcome.logits = logits
    if work.keep is not None:
        try:
            engine.cache_op(work.keep)
            outcome.kept = True
        except Exception:  # the request goes on; its tokens are just not cached
            logger.exception("keeping a prefilled chunk in the prefix cache failed")
    return outcome
