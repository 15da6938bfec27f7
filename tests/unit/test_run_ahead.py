"""Decoding ahead of the scheduler changes nothing the scheduler can see.

A fake engine whose logits depend on each slot's whole token history (so a
step applied twice, lost, or applied to the wrong row shows up at once) runs a
random schedule twice: once plainly, once through :class:`RunAhead`. Every
outcome, and the engine's final state, must be the same. Some greedy rows
carry a grammar mask: the engine's pick is the argmax among what it allows,
and the step decoded ahead feeds that pick.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sluiceway.actors.engine_work import (
    APART_TOKENS,
    PACKED_TOKENS,
    PrefillOutcome,
    PrefillWork,
    StepOutcome,
    StepPlan,
    execute,
)
from sluiceway.actors.run_ahead import RunAhead
from sluiceway.actors.sampling import Draw
from sluiceway.engines.base import DecodeResult, EngineInfo, Logits
from sluiceway.engines.grammar import allowed_ids, pack
from sluiceway.protocol.messages import SamplingParams

VOCAB = 12


def _logits_after(history: Sequence[int]) -> Logits:
    seed = int.from_bytes(hashlib.sha256(bytes(history)).digest()[:8], "little")
    return np.random.default_rng(seed).standard_normal(VOCAB).astype(np.float32)


@dataclass
class HistoryEngine:
    pending: dict[int, list[int]] = field(default_factory=dict)
    running: dict[int, list[int]] = field(default_factory=dict)
    decodes: int = 0

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(
            name="history", device="cpu", dtype="float32", vocab_size=VOCAB, max_context=999
        )

    @property
    def histories(self) -> dict[int, list[int]]:
        """Every slot's tokens. A row that joined in a decode taken back stays
        in the batch, but holds what it held before (its prompt)."""
        return self.pending | self.running

    def prefill(self, slot: int, token_ids: Sequence[int], *, all_logits: bool = False) -> Logits:
        history = self.pending.setdefault(slot, [])
        history.extend(token_ids)
        return _logits_after(history)[None]

    def fork(self, source: int, target: int) -> None:
        self.pending[target] = list(self.pending[source])

    def decode(self, tokens: Mapping[int, int]) -> DecodeResult:
        assert set(self.running) <= set(tokens), "decode names every running slot"
        for slot in tokens:
            if slot not in self.running:
                self.running[slot] = self.pending.pop(slot)
        self.decodes += 1
        order = tuple(self.running)
        for slot in order:
            self.running[slot].append(tokens[slot])
        return DecodeResult(order, np.stack([_logits_after(self.running[s]) for s in order]))

    def start_decode(self, tokens: Mapping[int, int]) -> Callable[[], DecodeResult]:
        return functools.partial(self.decode, dict(tokens))

    def undo_decode(self) -> None:
        for history in self.running.values():
            history.pop()

    def free(self, slot: int) -> None:
        self.pending.pop(slot, None)
        self.running.pop(slot, None)

    def close(self) -> None:
        pass


@dataclass
class Schedule:
    """A toy scheduler: decides each plan from the last outcome, as the real one does."""

    draw: st.DataObject
    next_slot: int = 0
    tokens: dict[int, int] = field(default_factory=dict)  # slot -> next token to feed
    joining: dict[int, int] = field(default_factory=dict)

    def plan(self) -> StepPlan:
        draw = self.draw.draw
        frees = tuple(s for s in list(self.tokens) if draw(st.integers(0, 5)) == 0)
        for slot in frees:
            del self.tokens[slot]
        decode = self.tokens | self.joining
        self.tokens, self.joining = decode, {}
        greedy = True
        if decode and draw(st.integers(0, 6)) == 0:
            # A sampled row: the token fed is not the argmax the engine saw.
            slot = draw(st.sampled_from(sorted(decode)))
            decode[slot] = (decode[slot] + 1) % VOCAB
            greedy = False
        prefills: list[PrefillWork] = []
        if not decode or draw(st.integers(0, 3)) == 0:
            slot, self.next_slot = self.next_slot, self.next_slot + 1
            prompt = tuple(draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3)))
            final = draw(st.booleans())
            prefills.append(
                PrefillWork(request_id=f"r{slot}", slot=slot, tokens=prompt, final=final)
            )
            if not final:  # the rest of the prompt comes next step
                prefills.append(
                    PrefillWork(request_id=f"r{slot}", slot=slot, tokens=(1,), final=True)
                )
        masks = {}
        if greedy:
            # Constrained rows: the engine picks among what each mask allows.
            for slot in decode:
                if draw(st.integers(0, 2)) == 0:
                    allowed = draw(st.lists(st.booleans(), min_size=VOCAB, max_size=VOCAB))
                    masks[slot] = pack(np.array(allowed) | (np.arange(VOCAB) == slot % VOCAB))
        # Rows said to end (by length, or on a stop id) that the toy
        # schedule keeps going anyway: the step ahead left them out, and
        # must be taken back exactly.
        ending: tuple[int, ...] = ()
        stop_ids: frozenset[int] = frozenset()
        if greedy and draw(st.booleans()):
            ending = tuple(s for s in [*decode, *(w.slot for w in prefills)] if draw(st.booleans()))
            stop_ids = frozenset(draw(st.sets(st.integers(0, VOCAB - 1), max_size=3)))
        return StepPlan(
            frees=frees,
            prefills=tuple(prefills),
            decode=dict(decode),
            greedy=greedy,
            masks=masks,
            ending=ending,
            stop_ids=stop_ids,
        )

    def absorb(self, plan: StepPlan, outcome: StepOutcome) -> None:
        if outcome.decode is not None:
            picks = outcome.decode_greedy
            if picks is None:
                picks = outcome.decode.logits.argmax(axis=-1)
            else:
                _check_picks(plan, outcome.decode, picks.tolist())
            for slot, token in zip(outcome.decode.slots, picks.tolist(), strict=True):
                self.tokens[slot] = int(token)
        for work, prefilled in zip(plan.prefills, outcome.prefills, strict=True):
            if work.final and prefilled.logits is not None:
                self.joining[work.slot] = int(prefilled.logits[-1].argmax())


def _check_picks(plan: StepPlan, decoded: DecodeResult, picks: list[int]) -> None:
    """Each pick is the argmax of its row among the ids its mask allows."""
    for slot, row, pick in zip(decoded.slots, decoded.logits, picks, strict=True):
        mask = plan.masks.get(slot)
        allowed = np.ones(VOCAB, dtype=bool) if mask is None else allowed_ids(mask, VOCAB)
        assert allowed[pick]
        assert pick == int(np.where(allowed, row, -np.inf).argmax())


def same_outcome(left: StepOutcome, right: StepOutcome) -> None:
    assert (left.decode is None) == (right.decode is None)
    if left.decode is not None and right.decode is not None:
        assert left.decode.slots == right.decode.slots
        np.testing.assert_array_equal(left.decode.logits, right.decode.logits)
    for mine, theirs in zip(left.prefills, right.prefills, strict=True):
        np.testing.assert_array_equal(mine.logits, theirs.logits)
    for mine, theirs in ((left.decode_greedy, right.decode_greedy),):
        assert (mine is None) == (theirs is None)
        if mine is not None:
            assert mine.tolist() == theirs.tolist()  # type: ignore[union-attr]


@settings(max_examples=120, deadline=None)
@given(draw=st.data(), steps=st.integers(1, 40))
def test_running_ahead_is_invisible(draw: st.DataObject, steps: int) -> None:
    plain, ahead = HistoryEngine(), HistoryEngine()
    runner = RunAhead(ahead)
    schedule = Schedule(draw)
    for _ in range(steps):
        plan = schedule.plan()
        expected = execute(plain, plan)
        got = runner.execute(plan)
        same_outcome(expected, got)
        assert ahead.histories == plain.histories
        schedule.absorb(plan, got)
        if draw.draw(st.booleans(), label="decode ahead"):
            runner.run_ahead(plan, got)
    runner.settle()
    assert ahead.histories == plain.histories


def test_steady_greedy_steps_are_served_from_ahead() -> None:
    engine = HistoryEngine()
    runner = RunAhead(engine)
    engine.prefill(0, [1, 2])
    plan = StepPlan(decode={0: 3}, greedy=True)
    for _ in range(5):
        outcome = runner.execute(plan)
        runner.run_ahead(plan, outcome)
        assert outcome.decode_greedy is not None
        plan = StepPlan(decode={0: int(outcome.decode_greedy[0])}, greedy=True)
    assert runner.served == 4
    assert runner.taken_back == 0
    # Five steps asked for, six decoded: the last one waits, ahead, for a plan.
    assert engine.decodes == 6
    runner.settle()
    assert runner.taken_back == 1
    assert len(engine.running[0]) == 2 + 5


def test_no_step_is_decoded_ahead_when_every_row_ends() -> None:
    """When every row's token is its last (``ending``) or an id that ends it
    (``stop_ids``), nothing runs ahead, so the next request's prefill does
    not wait for a decode thrown away. While one row goes on, every running
    row is decoded ahead (a decode names them all)."""
    engine = HistoryEngine()
    runner = RunAhead(engine)
    engine.prefill(0, [1, 2])
    engine.prefill(1, [3])
    plan = StepPlan(decode={0: 3, 1: 4}, greedy=True)
    outcome = runner.execute(plan)
    assert outcome.decode_greedy is not None
    picks = outcome.decode_greedy.tolist()
    runner.run_ahead(replace(plan, ending=(0, 1)), outcome)
    runner.run_ahead(replace(plan, ending=(0,), stop_ids=frozenset({picks[1]})), outcome)
    assert engine.decodes == 1
    runner.run_ahead(replace(plan, ending=(0,)), outcome)
    assert engine.decodes == 2
    served = runner.execute(StepPlan(frees=(0,), decode={1: picks[1]}, greedy=True))
    assert (runner.served, runner.taken_back) == (1, 0)
    assert served.decode is not None
    assert served.decode.slots == (1,)


def test_a_row_that_goes_on_past_a_stop_id_is_decoded_by_its_plan() -> None:
    """A row kept going by ``ignore_eos`` that picks an EOS id was left out
    of the step ahead; its plan takes that step back and runs its own."""
    plain, engine = HistoryEngine(), HistoryEngine()
    runner = RunAhead(engine)
    for each in (plain, engine):
        each.prefill(0, [1, 2])
    plan = StepPlan(decode={0: 3}, greedy=True)
    outcome = runner.execute(plan)
    execute(plain, plan)
    assert outcome.decode_greedy is not None
    pick = int(outcome.decode_greedy[0])
    runner.run_ahead(replace(plan, stop_ids=frozenset({pick})), outcome)
    assert engine.decodes == 1
    runner.execute(StepPlan(decode={0: pick}, greedy=True))
    execute(plain, StepPlan(decode={0: pick}, greedy=True))
    assert (runner.served, runner.taken_back) == (0, 0)
    assert engine.histories == plain.histories


class AsyncHistoryEngine(HistoryEngine):
    """Records when a decode is started and when it is waited for."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[str] = []

    def start_decode(self, tokens: Mapping[int, int]) -> Callable[[], DecodeResult]:
        self.log.append("start")
        result = self.decode(tokens)

        def finish() -> DecodeResult:
            self.log.append("finish")
            return result

        return finish


def test_the_handover_comes_between_starting_and_finishing_the_decode() -> None:
    engine = AsyncHistoryEngine()
    runner = RunAhead(engine)
    engine.prefill(0, [1, 2])
    plan = StepPlan(decode={0: 3}, greedy=True)
    outcome = runner.execute(plan)
    runner.run_ahead(plan, outcome, lambda: engine.log.append("handover"))
    assert engine.log == ["start", "handover", "finish"]
    # Nothing to predict (a sampled step): the handover still happens, once.
    engine.log.clear()
    sampled = StepPlan(decode={0: 4})
    runner.settle()
    outcome = runner.execute(sampled)
    runner.run_ahead(sampled, outcome, lambda: engine.log.append("handover"))
    assert engine.log == ["handover"]


def test_a_prefilled_row_and_its_forks_join_the_decode_taken_ahead() -> None:
    engine = HistoryEngine()
    runner = RunAhead(engine)
    prompt = PrefillWork(request_id="r0", slot=0, tokens=(1, 2), final=True, forks=(1,))
    plan = StepPlan(prefills=(prompt,), greedy=True)
    outcome = runner.execute(plan)
    runner.run_ahead(plan, outcome)
    assert engine.decodes == 1
    assert outcome.prefills[0].greedy is not None
    first = int(outcome.prefills[0].greedy[-1])
    joined = runner.execute(StepPlan(decode={0: first, 1: first}, greedy=True))
    assert (runner.served, runner.taken_back) == (1, 0)
    assert joined.decode is not None
    assert joined.decode.slots == (0, 1)
    # A first token the scheduler sampled otherwise: the step is taken back.
    runner.run_ahead(StepPlan(decode={0: first, 1: first}, greedy=True), joined)
    runner.execute(StepPlan(decode={0: 3, 1: 4}))
    assert (runner.served, runner.taken_back) == (1, 1)
    assert engine.histories == {0: [1, 2, first, 3], 1: [1, 2, first, 4]}


def test_drawn_rows_and_drawn_forks_are_decoded_ahead_with_their_picks() -> None:
    """Sampled rows the engine draws run ahead as greedy ones do; the forks
    of a drawn prompt each join with their own first token."""
    engine = HistoryEngine()
    runner = RunAhead(engine)
    draws = tuple(Draw.of(SamplingParams(temperature=1.0), u) for u in (0.05, 0.95))
    prompt = PrefillWork(
        request_id="r0", slot=0, tokens=(1, 2), final=True, forks=(1,), draws=draws
    )
    plan = StepPlan(prefills=(prompt,), greedy=True)
    outcome = runner.execute(plan)
    runner.run_ahead(plan, outcome)
    assert outcome.prefills[0].greedy is not None
    firsts = outcome.prefills[0].greedy.tolist()
    assert firsts[0] != firsts[1]  # the two ends of one distribution
    plan = StepPlan(decode={0: firsts[0], 1: firsts[1]}, greedy=True, draws={1: draws[1]})
    for _ in range(3):
        outcome = runner.execute(plan)
        runner.run_ahead(plan, outcome)
        assert outcome.decode_greedy is not None
        picks = outcome.decode_greedy.tolist()
        plan = StepPlan(decode={0: picks[0], 1: picks[1]}, greedy=True, draws={1: draws[1]})
    assert (runner.served, runner.taken_back) == (3, 0)


def test_a_failed_prefill_does_not_join() -> None:
    engine = HistoryEngine()
    runner = RunAhead(engine)
    plan = StepPlan(
        prefills=(PrefillWork(request_id="r0", slot=0, tokens=(1,), final=True),), greedy=True
    )
    outcome = runner.execute(plan)
    outcome.prefills[0].error = "prefill failed: out of memory"
    runner.run_ahead(plan, outcome)
    assert engine.decodes == 0


class PackingHistoryEngine(HistoryEngine):
    """Packs prompt chunks into a decode: as if they were prefilled first."""

    packs_prefills = True

    def __init__(self, apart: bool = False) -> None:
        super().__init__()
        self.packed_calls = 0
        #: What :meth:`prefills_apart` answers, and the chunks it was asked about.
        self.apart, self.asked_apart = apart, 0
        #: Each pass's decoded rows and chunk tokens, in order.
        self.passes: list[tuple[int, int]] = []

    def prefills_apart(self, chunks: Sequence[tuple[int, int]]) -> bool:
        self.asked_apart += 1
        return self.apart

    def decode_prefilling(
        self, tokens: Mapping[int, int], chunks: Sequence[tuple[int, Sequence[int]]]
    ) -> tuple[DecodeResult, list[Logits]]:
        slots = [slot for slot, _ in chunks]
        assert not set(tokens) & set(slots)
        assert len(set(slots)) == len(slots), "one chunk per slot in a pass"
        self.packed_calls += 1
        self.passes.append((len(tokens), sum(len(ids) for _, ids in chunks)))
        last = [self.prefill(slot, ids) for slot, ids in chunks]
        if not tokens:  # a pass that only prefills
            return DecodeResult((), np.zeros((0, VOCAB), dtype=np.float32)), last
        return self.decode(tokens), last


@dataclass
class PackedSchedule(Schedule):
    """:class:`Schedule`, told which prefills came back (deferred ones a step late)."""

    def settle(self, settled: list[tuple[PrefillWork, PrefillOutcome]]) -> None:
        for work, prefilled in settled:
            if work.final and prefilled.logits is not None:
                self.joining[work.slot] = int(prefilled.logits[-1].argmax())


@settings(max_examples=120, deadline=None)
@given(draw=st.data(), steps=st.integers(1, 40))
def test_packing_prefills_into_the_step_ahead_is_invisible(draw: st.DataObject, steps: int) -> None:
    """Each deferred prefill's outcome, when it comes a step late, is the
    one the plan would have given; everything else is as without packing."""
    plain, ahead = HistoryEngine(), PackingHistoryEngine(apart=draw.draw(st.booleans()))
    runner = RunAhead(ahead)
    schedule = PackedSchedule(draw)
    owed: list[tuple[PrefillWork, PrefillOutcome]] = []
    for _ in range(steps):
        plan = schedule.plan()
        expected = execute(plain, plan)
        got = runner.execute(plan)
        assert len(got.late) == len(owed)
        for (_, wanted), late in zip(owed, got.late, strict=True):
            np.testing.assert_array_equal(late.logits, wanted.logits)
            if late.greedy is not None:
                assert wanted.logits is not None
                assert late.greedy.tolist() == wanted.logits.argmax(axis=-1).tolist()
        settled = [(work, late) for (work, _), late in zip(owed, got.late, strict=True)]
        owed = []
        for work, mine, theirs in zip(plan.prefills, got.prefills, expected.prefills, strict=True):
            if mine.deferred:
                assert plan.greedy
                assert work.final
                assert work.top is None
                owed.append((work, theirs))
            else:
                np.testing.assert_array_equal(mine.logits, theirs.logits)
                settled.append((work, mine))
        same_outcome(expected, replace(got, prefills=expected.prefills))
        schedule.absorb(replace(plan, prefills=()), replace(got, prefills=[]))
        schedule.settle(settled)
        runner.run_ahead(plan, got)
    # The last plan's deferred prefills ran in the step ahead, which is taken back.
    runner.settle()
    assert ahead.histories == plain.histories


def test_final_chunks_wait_for_the_step_ahead_and_join_the_one_after() -> None:
    engine = PackingHistoryEngine()
    runner = RunAhead(engine)
    engine.prefill(0, [1, 2])
    plan = StepPlan(decode={0: 3}, greedy=True)
    outcome = runner.execute(plan)
    runner.run_ahead(plan, outcome)
    assert outcome.decode_greedy is not None
    token = int(outcome.decode_greedy[0])
    long = (1,) * (PACKED_TOKENS + 1)
    plan = StepPlan(
        decode={0: token},
        greedy=True,
        prefills=(
            PrefillWork(request_id="a", slot=1, tokens=(4, 5), final=True, forks=(2,)),
            PrefillWork(request_id="b", slot=3, tokens=(6,), final=True, top=1),
            PrefillWork(request_id="c", slot=4, tokens=(7,), final=False),
            PrefillWork(request_id="d", slot=5, tokens=long, final=True),
        ),
    )
    outcome = runner.execute(plan)
    assert [p.deferred for p in outcome.prefills] == [True, False, False, False]
    assert 1 not in engine.pending, "not prefilled before the handover"
    runner.run_ahead(plan, outcome)
    assert engine.packed_calls == 1
    assert runner.packed == 1
    assert engine.pending[1] == engine.pending[2] == [4, 5], "prefilled, then forked"
    assert outcome.decode_greedy is not None
    following = dict(zip(outcome.decode.slots, outcome.decode_greedy.tolist(), strict=True))  # type: ignore[union-attr]
    following |= {3: int(outcome.prefills[1].greedy[-1])}  # type: ignore[index]
    following |= {5: int(outcome.prefills[3].greedy[-1])}  # type: ignore[index]
    plan = StepPlan(decode=following, greedy=True)
    outcome = runner.execute(plan)
    assert runner.taken_back == 0, "the step ahead was the plan's"
    (late,) = outcome.late
    assert late.greedy is not None
    first = int(late.greedy[-1])
    np.testing.assert_array_equal(late.logits, _logits_after([4, 5])[None])
    runner.run_ahead(plan, outcome)
    # The packed rows join the step decoded after that one.
    assert engine.running[1][-1] == engine.running[2][-1] == first


def _one_row_ahead(engine: HistoryEngine, plain: HistoryEngine) -> tuple[RunAhead, int]:
    """Row 0 decoded one step on both engines, and on ``engine`` the next
    step decoded ahead; returns its runner and row 0's next token."""
    runner = RunAhead(engine)
    for each in (engine, plain):
        each.prefill(0, [1])
    plan = StepPlan(decode={0: 2}, greedy=True)
    outcome = runner.execute(plan)
    execute(plain, plan)
    runner.run_ahead(plan, outcome)
    assert outcome.decode_greedy is not None
    return runner, int(outcome.decode_greedy[0])


def test_a_served_plan_defers_more_prompts_than_one_pass_takes() -> None:
    """Every final chunk a pass takes waits for the step decoded ahead, not
    only the first pass's worth: the plan's reply, with the tokens of the
    chunks deferred before it, goes out at once. The step ahead then
    prefills them in passes of at most ``PACKED_TOKENS`` tokens, the first
    with its decode, as a plan would."""
    engine, plain = PackingHistoryEngine(), HistoryEngine()
    works = _burst(PACKED_TOKENS // 4, 9)
    runner, plan, outcome = _deferred_burst(engine, plain, works)
    assert engine.packed_calls == 0, "nothing prefilled before the reply"
    runner.run_ahead(plan, outcome)
    # 4 + 4 + 1 prompts: the first four with the decode ahead.
    assert engine.packed_calls == 2
    assert runner.packed == 9
    _serve_the_late(runner, engine, plain, outcome, works)


def _burst(size: int, count: int) -> tuple[PrefillWork, ...]:
    return tuple(
        PrefillWork(request_id=f"r{slot}", slot=slot, tokens=(slot % 7,) * size, final=True)
        for slot in range(1, count + 1)
    )


def _deferred_burst(
    engine: HistoryEngine, plain: HistoryEngine, works: tuple[PrefillWork, ...]
) -> tuple[RunAhead, StepPlan, StepOutcome]:
    """Row 0 decoded ahead on ``engine``, then a plan that brings ``works``,
    run on both engines: on ``engine`` every one of them is deferred."""
    runner, token = _one_row_ahead(engine, plain)
    plan = StepPlan(decode={0: token}, greedy=True, prefills=works)
    outcome = runner.execute(plan)
    execute(plain, plan)
    assert all(p.deferred for p in outcome.prefills)
    return runner, plan, outcome


def _serve_the_late(
    runner: RunAhead,
    engine: HistoryEngine,
    plain: HistoryEngine,
    outcome: StepOutcome,
    works: tuple[PrefillWork, ...],
) -> None:
    """The next plan, served from the step decoded ahead: each deferred
    prompt's outcome comes with it, as the plain path's, and both engines
    end with the same caches."""
    assert outcome.decode_greedy is not None
    following = {0: int(outcome.decode_greedy[0])}
    outcome = runner.execute(StepPlan(decode=following, greedy=True))
    execute(plain, StepPlan(decode=following, greedy=True))
    assert (runner.served, runner.taken_back) == (2, 0)
    assert len(outcome.late) == len(works)
    for work, late in zip(works, outcome.late, strict=True):
        np.testing.assert_array_equal(late.logits, _logits_after(plain.histories[work.slot])[None])
    runner.settle()
    assert engine.histories == plain.histories


def test_a_failed_packed_pass_runs_its_parts_alone() -> None:
    """A packed pass that fails (say, out of memory) costs nobody their
    request: each chunk is prefilled alone, and the plan decodes itself."""

    class Failing(PackingHistoryEngine):
        def decode_prefilling(
            self, tokens: Mapping[int, int], chunks: Sequence[tuple[int, Sequence[int]]]
        ) -> tuple[DecodeResult, list[Logits]]:
            self.packed_calls += 1
            raise RuntimeError("out of memory")

    engine, plain = Failing(), HistoryEngine()
    runner, token = _one_row_ahead(engine, plain)
    plan = StepPlan(
        decode={0: token},
        greedy=True,
        prefills=(PrefillWork(request_id="a", slot=1, tokens=(3,), final=True),),
    )
    outcome = runner.execute(plan)
    execute(plain, plan)
    assert outcome.prefills[0].deferred
    runner.run_ahead(plan, outcome)
    assert engine.packed_calls == 1
    assert outcome.decode_greedy is not None
    plan = StepPlan(decode={0: int(outcome.decode_greedy[0])}, greedy=True)
    outcome = runner.execute(plan)
    execute(plain, plan)
    (late,) = outcome.late
    assert late.error is None
    np.testing.assert_array_equal(late.logits, _logits_after([3])[None])
    assert outcome.decode is not None
    assert outcome.decode.slots == (0,)
    assert runner.taken_back == 0, "nothing was decoded ahead: the plan decoded itself"
    assert engine.histories == plain.histories


def test_a_burst_of_prompts_is_packed_into_as_few_passes_as_fit() -> None:
    """Prompts a plan prefills itself go into passes of at most
    ``PACKED_TOKENS`` tokens, the first with the plan's decode; a prompt
    asking for prompt logprobs, or longer than a pass, runs alone."""
    engine, plain = PackingHistoryEngine(), HistoryEngine()
    for each in (engine, plain):
        each.prefill(0, [1])
    size = PACKED_TOKENS // 4
    works = [
        PrefillWork(request_id=f"r{slot}", slot=slot, tokens=(slot % 7,) * size, final=True)
        for slot in range(1, 10)
    ]
    works += [
        PrefillWork(request_id="top", slot=20, tokens=(3,), final=True, top=2, targets=()),
        PrefillWork(request_id="long", slot=21, tokens=(4,) * (PACKED_TOKENS + 1), final=True),
    ]
    plan = StepPlan(decode={0: 2}, greedy=True, prefills=tuple(works))
    got = execute(engine, plan, pack=True)
    expected = execute(plain, plan)
    # 4 + 4 + 1 prompts: the first four with the decode; the last one alone
    # would save no pass, so it takes its own.
    assert engine.packed_calls == 2
    assert engine.decodes == 1
    same_outcome(expected, got)
    for mine, theirs in zip(got.prefills, expected.prefills, strict=True):
        assert mine.greedy is not None
        assert theirs.greedy is not None
        assert mine.greedy.tolist() == theirs.greedy.tolist()
    assert engine.histories == plain.histories


def test_prompts_the_engine_takes_apart_skip_the_decodes_pass() -> None:
    """Where the engine prefills new prompts faster in passes of their own
    (:meth:`~sluiceway.engines.base.PackingEngine.prefills_apart`), they go
    in passes of up to ``APART_TOKENS`` tokens with no decode, and the
    plan's decode runs on its own after them: the same outcome."""
    engine, plain = PackingHistoryEngine(apart=True), HistoryEngine()
    for each in (engine, plain):
        each.prefill(0, [1])
    works = _burst(APART_TOKENS // 8, 9)
    plan = StepPlan(decode={0: 2}, greedy=True, prefills=works)
    got = execute(engine, plan, pack=True)
    expected = execute(plain, plan)
    # Eight prompts fill a pass; the ninth alone saves no pass, so it takes its own.
    assert engine.passes == [(0, APART_TOKENS)]
    assert (engine.asked_apart, engine.decodes) == (1, 1)
    same_outcome(expected, got)
    assert engine.histories == plain.histories


def test_a_step_ahead_takes_apart_what_the_engine_asks() -> None:
    """The step decoded ahead, with deferred prompts the engine takes apart:
    their passes first, then the decode, which is served to the next plan."""
    engine, plain = PackingHistoryEngine(apart=True), HistoryEngine()
    works = _burst(APART_TOKENS // 4, 6)
    runner, plan, outcome = _deferred_burst(engine, plain, works)
    runner.run_ahead(plan, outcome)
    assert engine.passes == [(0, APART_TOKENS), (0, APART_TOKENS // 2)]
    assert runner.packed == 6
    _serve_the_late(runner, engine, plain, outcome, works)


def test_a_decode_alone_that_fails_reaches_only_its_rows() -> None:
    """The decode run after the prompts taken apart fails: the prompts keep
    their prefill, the batch's requests get the decode's error."""

    class Failing(PackingHistoryEngine):
        def decode(self, tokens: Mapping[int, int]) -> DecodeResult:
            raise RuntimeError("out of memory")

    engine = Failing(apart=True)
    engine.prefill(0, [1])
    works = _burst(APART_TOKENS // 8, 8)
    got = execute(engine, StepPlan(decode={0: 2}, greedy=True, prefills=works), pack=True)
    assert got.decode is None
    assert got.decode_error == "decode failed: out of memory"
    assert all(p.error is None and p.logits is not None for p in got.prefills)


class ChainingHistoryEngine(HistoryEngine):
    """Records which way each decode ahead was started."""

    def __init__(self, chains: bool = True) -> None:
        super().__init__()
        self.chains = chains
        self.starts: list[str] = []

    def start_decode(self, tokens: Mapping[int, int]) -> Callable[[], DecodeResult]:
        self.starts.append("plain")
        return super().start_decode(tokens)

    def start_decode_chained(self, tokens: Mapping[int, int]) -> Callable[[], DecodeResult]:
        self.starts.append("chained")
        return super().start_decode(tokens)


def _step_ahead(runner: RunAhead, plan: StepPlan) -> StepOutcome:
    outcome = runner.execute(plan)
    runner.run_ahead(plan, outcome)
    return outcome


def test_only_a_foreseeable_step_is_queued_after_the_one_ahead() -> None:
    """The step after the one decoded ahead is foreseeable when every row
    takes its argmax and no row joins: not with a drawn row, a mask, or a
    prompt whose row joins the step ahead."""
    engine = ChainingHistoryEngine()
    runner = RunAhead(engine)
    engine.prefill(0, [1, 2])
    outcome = _step_ahead(runner, StepPlan(decode={0: 3}, greedy=True))
    assert engine.starts == ["chained"]
    assert outcome.decode_greedy is not None
    picked = int(outcome.decode_greedy[0])
    draw = Draw.of(SamplingParams(temperature=1.0), 0.5)
    outcome = _step_ahead(runner, StepPlan(decode={0: picked}, greedy=True, draws={0: draw}))
    assert outcome.decode_greedy is not None
    picked = int(outcome.decode_greedy[0])
    masked = {0: pack(np.ones(VOCAB, dtype=bool))}
    outcome = _step_ahead(runner, StepPlan(decode={0: picked}, greedy=True, masks=masked))
    assert outcome.decode_greedy is not None
    joining = PrefillWork(request_id="r1", slot=1, tokens=(4, 5), final=True)
    plan = StepPlan(prefills=(joining,), decode={0: int(outcome.decode_greedy[0])}, greedy=True)
    _step_ahead(runner, plan)
    assert engine.starts == ["chained", "plain", "plain", "plain"]
    # An engine that can queue but does not (``chains`` off) is never asked to.
    quiet = ChainingHistoryEngine(chains=False)
    quiet.prefill(0, [1, 2])
    _step_ahead(RunAhead(quiet), StepPlan(decode={0: 3}, greedy=True))
    assert quiet.starts == ["plain"]
