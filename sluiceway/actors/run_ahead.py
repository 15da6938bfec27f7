"""Decoding one step ahead of the scheduler, where the engine runs.

After a step whose tokens it picked (a greedy step, or one whose sampled rows
it drew: ``StepPlan.draws``) the engine already knows every row's next
token, and in
the steady state the scheduler's next plan is exactly "decode these rows with
those tokens". The engine thread does not wait for the plan: it hands the
step's outcome to the event loop and starts that decode at once, while the
outcome is fanned out and the plan is made, and when the plan comes it serves
it from the step already taken. The engine then never idles for the round
trip to the event loop, nor for the thread wake-up at its end.

What the plan may differ in, and how that is met:

- rows that finished or were cancelled are freed: the step taken ahead
  computed them too; their results are dropped and the others kept;
- prompts to prefill: run as usual. A row whose prompt such a step has just
  prefilled is foreseeable too (its first token is the prompt's argmax, or
  each choice's draw), and joins the decode taken ahead, so a new request
  does not cost the engine a round trip to the event loop on its first
  decode;
- with an engine that packs prefills into a decode step
  (:class:`~sluiceway.engines.base.PackingEngine`), a plan served from ahead
  leaves its prompts' final chunks (each up to ``PACKED_TOKENS`` tokens,
  and no prompt logprobs) to the next step decoded ahead: the first
  ``PACKED_TOKENS`` of them are prefilled in that step's forward pass, at
  the cost of their arithmetic rather than of a pass of their own, and the
  rest in passes of their own after it (where the engine prefills them
  faster apart from the decode, all of them go in passes of their own and
  the decode runs alone after them). Their outcomes come with the next
  plan's outcome (``StepOutcome.late``), and their rows join the step
  decoded after that.
  A new request's first token thus comes one step later, and each prompt
  saves the engine a forward pass. (Chunks a plan runs itself are packed
  into one pass too, with its decode when that is still to run:
  :func:`~sluiceway.actors.engine_work.execute`.)
- anything else (a row with another token, a row joining, a non-decode call):
  the step is taken back with :meth:`Engine.undo_decode` and the plan runs
  as if nothing had happened.

A decode is a pure function of the tokens, so a step served from ahead is
bit-identical to the step the plan would have run; a drawn row's pick from
it is made when its plan comes, with the plan's draw.

A greedy constrained row's token is the argmax under the grammar mask its
plan carried (``StepPlan.masks``), so the step ahead feeds only tokens the
grammar allows; the mask of the token after that comes with the next plan,
which the step ahead serves.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from sluiceway.actors.engine_work import (
    EngineThread,
    LoopLink,
    PrefillOutcome,
    PrefillWork,
    Running,
    StepOutcome,
    StepPlan,
    execute,
    packable,
    packed_passes,
    packs,
    pick_first,
)
from sluiceway.engines.base import ChainingEngine, DecodeResult, Engine

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Ahead:
    tokens: Mapping[int, int]
    result: DecodeResult


def _nothing() -> None:
    pass


class RunAhead:
    """Carries out plans on ``engine``, taking the next greedy decode ahead."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._packs = packs(engine)
        #: The engine, when it queues the step after a foreseeable one
        #: (checked once: a protocol's isinstance is slow).
        self._chaining = engine if isinstance(engine, ChainingEngine) and engine.chains else None
        self._ahead: _Ahead | None = None
        #: The last plan's deferred prefills, to run in the step decoded ahead.
        self._deferred: list[PrefillWork] = []
        #: Deferred prefills that ran, with their outcomes, for the next plan's outcome.
        self._late: list[tuple[PrefillWork, PrefillOutcome]] = []
        #: The ones just reported, whose rows the prediction has join.
        self._reported: list[tuple[PrefillWork, PrefillOutcome]] = []
        #: Steps served from ahead, and steps taken back (for tests and logs).
        self.served = 0
        self.taken_back = 0
        #: Prompt chunks packed into a step decoded ahead.
        self.packed = 0

    def execute(self, plan: StepPlan) -> StepOutcome:
        ahead, self._ahead = self._ahead, None
        late, self._late = self._late, []
        if self._deferred:  # no run_ahead came since they were left: run them now
            late += self._alone(self._deferred)
        outcome = self._execute(plan, ahead)
        outcome.late = [result for _, result in late]
        self._deferred = [
            work
            for work, result in zip(plan.prefills, outcome.prefills, strict=True)
            if result.deferred
        ]
        self._reported = late
        return outcome

    def _execute(self, plan: StepPlan, ahead: _Ahead | None) -> StepOutcome:
        if ahead is not None:
            if _serves(ahead, plan):
                self.served += 1
                decoded = _only(ahead.result, plan.decode)
                defer = self._deferrable(plan)
                return execute(self._engine, plan, decoded=decoded, defer=defer, pack=self._packs)
            self._take_back()
        return execute(self._engine, plan, pack=self._packs)

    def _deferrable(self, plan: StepPlan) -> Callable[[PrefillWork], bool] | None:
        """Which of a served plan's prefills wait for the step decoded ahead:
        every final chunk that a packed pass takes (whose rows join the step
        after it). Not only as many as one pass takes: a chunk the plan ran
        itself kept its reply, and with it the first tokens of the chunks
        deferred in the step before (``StepOutcome.late``), waiting for the
        whole of it. At 64 streams arriving at once, the 32nd first token
        came 250 ms after its prefill had ended."""
        if not (self._packs and plan.greedy and plan.prefills):
            return None
        return lambda work: work.final and packable(work)

    def settle(self) -> None:
        """Take back a step decoded ahead, before any call other than :meth:`execute`."""
        if self._ahead is not None:
            self._ahead = None
            self._take_back()

    def run_ahead(
        self, plan: StepPlan, outcome: StepOutcome, handover: Callable[[], None] = _nothing
    ) -> None:
        """After ``plan`` gave ``outcome``: decode the predicted next step.
        Even when the next plan is already queued: it is then most likely the
        prediction, and served as soon as it is read.

        ``handover`` (giving ``outcome`` to the event loop) is called once the
        decode is under way: after an engine that computes asynchronously has
        built the step, so that the event loop's burst of work overlaps the
        computation rather than the engine's own Python.
        """
        tokens = _prediction(plan, outcome, self._reported)
        self._reported = []
        deferred, self._deferred = self._deferred, []
        if deferred:
            handover()
            self._late = self._pack(tokens, deferred)
            return
        if tokens is None:
            handover()
            return
        try:
            finish = self._start_decode(plan, tokens)
        except Exception:
            # The plan will run the decode itself and report what fails.
            logger.exception("decoding ahead failed")
            handover()
            return
        handover()
        try:
            self._ahead = _Ahead(tokens, finish())
        except Exception:
            logger.exception("decoding ahead failed")
            with contextlib.suppress(Exception):  # the plan will fail on its own
                self._engine.undo_decode()

    def _start_decode(self, plan: StepPlan, tokens: dict[int, int]) -> Callable[[], DecodeResult]:
        """Start the decode taken ahead; where the engine can, with the step
        after it queued too, when that step is foreseeable: every row takes its
        argmax (no draws, no masks) and no row joins (a new request's
        sampling is not known here)."""
        foreseeable = not plan.draws and not plan.masks and tokens.keys() == plan.decode.keys()
        if self._chaining is not None and foreseeable:
            return self._chaining.start_decode_chained(tokens)
        return self._engine.start_decode(tokens)

    def _pack(
        self, tokens: dict[int, int] | None, works: list[PrefillWork]
    ) -> list[tuple[PrefillWork, PrefillOutcome]]:
        """Decode ``tokens`` ahead with ``works`` prefilled in the same pass
        (without a decode to join, prefill them alone, as the plan would)."""
        if tokens is None:
            return self._alone(works)
        decoded, outcomes = packed_passes(self._engine, tokens, works)
        if decoded is not None:
            self.packed += len(works)
            self._ahead = _Ahead(tokens, decoded)
        for work, outcome in zip(works, outcomes, strict=True):
            pick_first(work, outcome)  # the plan they came in was greedy
        return list(zip(works, outcomes, strict=True))

    def _alone(self, works: list[PrefillWork]) -> list[tuple[PrefillWork, PrefillOutcome]]:
        """Deferred prefills run without a decode, as their plan would have."""
        plan = StepPlan(prefills=tuple(works), greedy=True)
        return list(zip(works, execute(self._engine, plan, pack=True).prefills, strict=True))

    def _take_back(self) -> None:
        self.taken_back += 1
        self._engine.undo_decode()


def _prediction(
    plan: StepPlan, outcome: StepOutcome, late: list[tuple[PrefillWork, PrefillOutcome]]
) -> dict[int, int] | None:
    """The next step's decode, when the scheduler's next plan is foreseeable:
    every decoded row with the engine's pick, and every row whose prompt was
    just prefilled (its choices' forks too; ``late``: in the step decoded
    ahead of this plan) joining with its first token; nothing when every
    one of them ends (``StepPlan.ending``, ``StepPlan.stop_ids``)."""
    if not plan.greedy:
        return None
    tokens: dict[int, int] = {}
    if plan.decode:
        if outcome.decode is None or outcome.decode_greedy is None:
            return None
        decoded = outcome.decode_greedy.tolist()
        tokens = {
            slot: int(token) for slot, token in zip(outcome.decode.slots, decoded, strict=True)
        }
    freed = set(plan.frees)
    prefilled_now = zip(plan.prefills, outcome.prefills, strict=True)
    for work, prefilled in [*late, *prefilled_now]:
        if work.slot in freed:  # the request went away meanwhile
            continue
        if work.final and prefilled.greedy is not None and prefilled.error is None:
            slots = (work.slot, *work.forks)
            if work.draws:  # a pick per choice
                tokens.update(zip(slots, prefilled.greedy.tolist(), strict=True))
            else:
                tokens.update(dict.fromkeys(slots, int(prefilled.greedy[-1])))
    if tokens and (plan.ending or plan.stop_ids) and _all_end(tokens, plan):
        return None
    return tokens or None


def _all_end(tokens: dict[int, int], plan: StepPlan) -> bool:
    """Whether every row of ``tokens`` ends with its token. Then no step is
    decoded ahead: the next plan frees them all, and a request arriving
    meanwhile need not wait for a decode it throws away (at one stream,
    every request after the first did, and a wave of requests ending
    together made the next wave wait for one). A decode names every
    running row, so while one row goes on, those that end are decoded too.
    A row kept going by ``ignore_eos`` whose pick is an EOS id counts as
    ending: its plan then runs the step (rare, and exact either way)."""
    ending, stops = frozenset(plan.ending), plan.stop_ids
    return all(token in stops or slot in ending for slot, token in tokens.items())


def _serves(ahead: _Ahead, plan: StepPlan) -> bool:
    """Whether the step taken ahead is ``plan``'s decode, give or take freed rows."""
    if not plan.decode:
        return False
    if any(ahead.tokens.get(slot) != token for slot, token in plan.decode.items()):
        return False
    freed = set(plan.frees)
    return all(slot in plan.decode or slot in freed for slot in ahead.tokens)


def _only(result: DecodeResult, tokens: Mapping[int, int]) -> DecodeResult:
    """``result`` restricted to the slots of ``tokens``, in the engine's order."""
    if len(tokens) == len(result.slots):
        return result
    keep = [i for i, slot in enumerate(result.slots) if slot in tokens]
    return DecodeResult(tuple(result.slots[i] for i in keep), result.logits[keep])


class SteppingThread:
    """Runs the scheduler's steps on the engine thread, decoding ahead between them."""

    def __init__(self, engine: Engine, thread: EngineThread) -> None:
        self._runner = RunAhead(engine)
        self._thread = thread
        #: The event loop of the first step; a scheduler runs in one loop.
        self._link: LoopLink | None = None

    @property
    def runner(self) -> RunAhead:
        return self._runner

    def start(self, plan: StepPlan) -> Running[StepOutcome]:
        if self._link is None:
            self._link = LoopLink.here()
        return self._thread.start_reporting(self._link, self._step, plan)

    def _step(self, report: Callable[[StepOutcome], None], plan: StepPlan) -> None:
        outcome = self._runner.execute(plan)
        self._runner.run_ahead(plan, outcome, functools.partial(report, outcome))
