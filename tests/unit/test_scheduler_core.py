"""The scheduler's core driven directly, event by event, against a simple model.

A hypothesis state machine interleaves submissions (``n`` choices, prompts
of several lengths, some sharing a prefix), steps run on an engine that keeps
each slot's token ids as its "KV" (``SequenceEngine``: its next token is a
function of the whole sequence), readers that fall behind and catch up,
cancellations, choices the output actor ends, engine loss, drain and the
clock. After every rule it checks what the core promises:

- the engine never holds more rows than ``max_num_seqs``;
- a step prefills at most ``prefill_chunk_tokens`` prompt tokens;
- each request ends exactly once, for one cause (finished, failed or
  cancelled), and nothing reaches its output after that;
- no row is decoded once its choice ended;
- every choice's tokens are the model's own continuation of its prompt, so a
  choice paused and restored by recomputation resumes with exactly the tokens
  it had (the engine's sequence for its new slot is its prompt and tokens);
- the prefix cache's pins are back to zero whenever no request is known and
  the engine has nothing left to do;
- queued requests are admitted in the order they were submitted.
"""

from __future__ import annotations

import ast
import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from sluiceway.actors import scheduler_core
from sluiceway.actors.engine_work import PrefillOutcome, StepPlan, execute
from sluiceway.actors.sampling import Draw
from sluiceway.actors.scheduler_core import (
    RELEASE_INTERVAL_SECONDS,
    Batch,
    Choice,
    CloseOutput,
    Counters,
    Deliver,
    SchedulerConfig,
    SchedulerCore,
    with_draws,
)
from sluiceway.engines.grammar import every_token
from sluiceway.protocol.constraints import Constraint, ConstraintKind
from sluiceway.protocol.errors import ServiceUnavailable
from sluiceway.protocol.messages import (
    Cancel,
    ConstraintReport,
    FailureCause,
    FinishCause,
    FinishChoice,
    GenerationRequest,
    Limits,
    LogprobParams,
    PromptCached,
    RequestFailed,
    RequestOutput,
    Resume,
    SamplingParams,
    StepOutput,
    Submit,
    TokenLogprob,
    TokenSample,
)
from tests.unit.test_scheduler_prefix import (
    BYTES_PER_TOKEN,
    EOS,
    SequenceEngine,
    expected_tokens,
)

CAPACITY = 4
CHUNK = 8
STALL_SECONDS = 5.0
#: Prompts that share a prefix start with it (a system prompt, say).
SHARED = tuple(range(1, 13))


@dataclass
class Output:
    """A request's output as the shell would carry it, and what the model knows of it."""

    index: int
    spec: GenerationRequest
    messages: list[RequestOutput] = field(default_factory=list)
    closed: int = 0
    #: Whether its reader is too far behind (``Backlog.full``).
    full: bool = False
    #: A reader that falls behind after each step that brought it tokens,
    #: and catches up after the next.
    slow: bool = False
    cancelled: bool = False
    #: Choices the output actor ended (a stop string, say).
    ended: set[int] = field(default_factory=set)

    def send_nowait(self, message: RequestOutput) -> None:
        assert not self.closed, f"{self.spec.request_id}: {message!r} after its end"
        self.messages.append(message)

    def close(self) -> None:
        self.closed += 1

    def tokens(self, choice: int) -> list[int]:
        return [
            sample.token_id
            for message in self.messages
            if isinstance(message, StepOutput)
            for sample in message.samples
            if sample.choice == choice
        ]

    def finished(self, choice: int) -> bool:
        return choice in self.ended or any(
            sample.finish is not None
            for message in self.messages
            if isinstance(message, StepOutput)
            for sample in message.samples
            if sample.choice == choice
        )

    def causes(self) -> set[str]:
        found = set()
        if any(isinstance(m, RequestFailed) for m in self.messages):
            found.add("failed")
        if all(self.finished(c) for c in range(self.spec.n)):
            found.add("finished")
        if self.cancelled:
            found.add("cancelled")
        return found


class SchedulerMachine(RuleBasedStateMachine):
    #: The shortest cached prefix reused. One here, so that the short prompts
    #: below exercise restoring; :class:`ShortPrefixMachine` raises it.
    MIN_REUSE = 1

    def __init__(self) -> None:
        super().__init__()
        config = SchedulerConfig(
            eos_ids=frozenset({EOS}),
            max_num_seqs=CAPACITY,
            prefill_chunk_tokens=CHUNK,
            stall_timeout=STALL_SECONDS,
            prefix_cache_bytes=64 * BYTES_PER_TOKEN,
            min_prefix_reuse=self.MIN_REUSE,
        )
        self.engine = SequenceEngine()
        self.core = SchedulerCore(config, self.engine.info, guided=False)
        self.now = 0.0
        self.outputs: dict[str, Output] = {}
        self.draining = False
        #: Submission indices of requests, in the order of their first prefill.
        self.admitted: list[int] = []
        #: Slot -> request id, from the prefills that made the slot.
        self.owners: dict[int, str] = {}

    # --- the model's bookkeeping -------------------------------------------

    def carry(self) -> None:
        """Carry the core's messages, as the shell does."""
        for message in self.core.take_messages():
            output = self.outputs[message.request_id]
            assert message.output is output
            if isinstance(message, CloseOutput):
                output.close()
            else:
                assert isinstance(message, Deliver)
                output.send_nowait(message.message)

    def open(self) -> list[Output]:
        return [o for o in self.outputs.values() if not o.closed]

    # --- rules -----------------------------------------------------------------

    @precondition(lambda self: not self.draining)
    @rule(
        n=st.integers(1, 2),
        shared=st.booleans(),
        own=st.lists(st.integers(1, 31), min_size=1, max_size=14),
        max_tokens=st.integers(1, 9),
        slow=st.booleans(),
    )
    def submit(self, n: int, shared: bool, own: list[int], max_tokens: int, slow: bool) -> None:
        name = f"r{len(self.outputs)}"
        spec = GenerationRequest(
            request_id=name,
            prompt_ids=(SHARED if shared else ()) + tuple(own),
            n=n,
            sampling=SamplingParams(temperature=0.0),
            limits=Limits(max_tokens=max_tokens),
        )
        output = self.outputs[name] = Output(len(self.outputs), spec, slow=slow)
        self.core.command(Submit(request=spec, output=output, backlog=output), self.now)
        self.carry()

    @rule()
    def step(self) -> None:
        """Plan a step, run it on the engine, take its tokens (the argmax, as
        the engine or the sampler picks for a greedy row); then slow readers
        fall behind or catch up."""
        self.slow_readers(self.run_step())

    def run_step(self) -> set[str]:
        """One step; the requests it brought tokens."""
        planned = self.core.plan({}, self.now)
        self.carry()
        if planned is None:
            return set()
        plan = planned.plan
        # A step prefills at most one chunk's worth of prompt, in non-empty pieces.
        assert sum(len(work.tokens) for work in plan.prefills) <= CHUNK
        assert all(work.tokens for work in plan.prefills)
        for work in plan.prefills:
            if work.request_id not in self.owners.values():
                self.admitted.append(self.outputs[work.request_id].index)
            self.owners[work.slot] = work.request_id
            for fork in work.forks:
                self.owners[fork] = work.request_id
        for slot, token in plan.decode.items():
            self.check_decoded(slot, token)
        self.core.started()
        outcome = execute(self.engine, plan)  # type: ignore[arg-type]
        batch = self.core.absorb(plan, outcome)
        self.carry()
        if not batch.choices:
            return set()
        tokens = batch.greedy
        if tokens is None:
            tokens = [int(t) for t in np.argmax(self.core.sample_step(batch).logits, axis=1)]
        self.core.deliver_samples(self.core.decide(batch.choices, tokens, batch.scores))
        self.carry()
        self.check_ending(plan, batch.choices)
        return {choice.request.spec.request_id for choice in batch.choices}

    def check_ending(self, plan: StepPlan, choices: Sequence[Choice]) -> None:
        """The rows a greedy plan said end with this step's token are the
        rows whose token it was by ``max_tokens``, and its stop ids are the
        model's EOS (the step decoded ahead leaves such rows out)."""
        if not plan.greedy:
            return
        reached = {c.slot for c in choices if c.generated >= c.request.spec.limits.max_tokens}
        assert set(plan.ending) == reached
        assert plan.stop_ids == {EOS}

    def slow_readers(self, got: set[str]) -> None:
        """Slow readers fall behind once a step brought them tokens, and the
        ones already behind catch up."""
        for output in self.open():
            if output.full and output.slow:
                output.full = False
                self.core.command(Resume(request_id=output.spec.request_id), self.now)
            elif output.slow and output.spec.request_id in got:
                output.full = True
        self.carry()

    def check_decoded(self, slot: int, token: int) -> None:
        """The row of ``slot`` belongs to a choice still running, and the
        engine's sequence for it, with ``token``, is its prompt and tokens."""
        output = self.outputs[self.owners[slot]]
        assert not output.closed, f"slot {slot} decoded after {output.spec.request_id} ended"
        sequence = [*self.engine.sequences[slot], token]
        prompt = list(output.spec.prompt_ids)
        running = [c for c in range(output.spec.n) if not output.finished(c)]
        assert any(sequence == prompt + output.tokens(c) for c in running), (
            f"slot {slot} of {output.spec.request_id} decodes {sequence}, which is no"
            f" running choice's prompt and tokens"
        )

    @rule(data=st.data())
    def reader_falls_behind(self, data: st.DataObject) -> None:
        running = [o for o in self.open() if not o.full]
        if running:
            data.draw(st.sampled_from(running)).full = True

    @rule(data=st.data())
    def reader_catches_up(self, data: st.DataObject) -> None:
        behind = [o for o in self.open() if o.full]
        if behind:
            output = data.draw(st.sampled_from(behind))
            output.full = False
            self.core.command(Resume(request_id=output.spec.request_id), self.now)
            self.carry()

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        if running := self.open():
            output = data.draw(st.sampled_from(running))
            output.cancelled = True
            self.core.command(Cancel(request_id=output.spec.request_id), self.now)
            self.carry()

    @rule(data=st.data())
    def output_ends_a_choice(self, data: st.DataObject) -> None:
        """The output actor ends a choice early (a stop string)."""
        started = [
            (o, c)
            for o in self.open()
            for c in range(o.spec.n)
            if o.tokens(c) and not o.finished(c)
        ]
        if started:
            output, choice = data.draw(st.sampled_from(started))
            output.ended.add(choice)
            self.core.command(
                FinishChoice(request_id=output.spec.request_id, choice=choice), self.now
            )
            self.carry()

    @rule()
    def engine_lost(self) -> None:
        self.core.engine_lost()
        self.carry()
        self.engine = SequenceEngine()  # every slot and entry died with it
        self.owners.clear()

    @rule(seconds=st.floats(0.0, 3.0))
    def tick(self, seconds: float) -> None:
        self.now += seconds
        self.core.wake_after(self.now, poll=None)
        self.core.release_due(self.now)

    @precondition(lambda self: not self.draining)
    @rule()
    def drain(self) -> None:
        self.draining = True
        self.core.drain()
        spec = GenerationRequest(request_id="late", prompt_ids=(1,), limits=Limits(max_tokens=1))
        with pytest.raises(ServiceUnavailable):
            self.core.command(Submit(request=spec, output=Output(-1, spec)), self.now)

    # --- invariants --------------------------------------------------------

    @invariant()
    def rows_in_use_fit(self) -> None:
        assert len(self.engine.sequences) <= CAPACITY
        counters = self.core.counters()
        assert counters.running_rows + counters.free_rows <= CAPACITY

    @invariant()
    def each_request_ends_once_for_one_cause(self) -> None:
        for output in self.outputs.values():
            assert output.closed <= 1, f"{output.spec.request_id} closed {output.closed} times"
            failures = [m for m in output.messages if isinstance(m, RequestFailed)]
            assert len(failures) <= 1
            if output.closed:
                causes = output.causes()
                assert len(causes) == 1, f"{output.spec.request_id} ended for {causes}"
            else:
                assert not failures

    @invariant()
    def tokens_are_the_models(self) -> None:
        for output in self.outputs.values():
            for choice in range(output.spec.n):
                tokens = output.tokens(choice)
                assert tuple(tokens) == expected_tokens(output.spec.prompt_ids, len(tokens))
                assert len(tokens) <= output.spec.limits.max_tokens

    @invariant()
    def pins_return_to_zero(self) -> None:
        if self.core.quiet:  # a finished row's copy holds its path until it is made
            assert self.core.prefix_pins() == 0

    @invariant()
    def no_prefix_shorter_than_the_least_is_reused(self) -> None:
        for output in self.outputs.values():
            assert all(cached >= self.MIN_REUSE for cached in _cached(output))

    @invariant()
    def admitted_in_order(self) -> None:
        assert self.admitted == sorted(self.admitted)
        assert len(set(self.admitted)) == len(self.admitted)

    def settle_bound(self) -> int:
        """Steps that end every open request even one row at a time: each
        token of a slow reader's choice may take a decode, a pause and a
        prefill of its whole sequence again. (A fixed 500 was too few for
        one run of fifty requests, which settled after 563.)"""
        steps = 10
        for output in self.open():
            spec = output.spec
            prompt, tokens = len(spec.prompt_ids), spec.limits.max_tokens
            again = 2 + -(-(prompt + tokens) // CHUNK)
            steps += spec.n * (-(-prompt // CHUNK) + tokens * again)
        return steps

    def teardown(self) -> None:
        """The steps run out, slow readers still falling behind and catching
        up (so every run pauses and restores them), the others reading: each
        request ends, with the invariants checked after each step."""
        for output in self.open():
            if output.full and not output.slow:
                output.full = False
                self.core.command(Resume(request_id=output.spec.request_id), self.now)
        self.carry()
        for _ in range(self.settle_bound()):
            if self.core.quiet and not self.open():
                break
            self.step()
            self.rows_in_use_fit()
            self.each_request_ends_once_for_one_cause()
            self.tokens_are_the_models()
            self.pins_return_to_zero()
            self.no_prefix_shorter_than_the_least_is_reused()
            self.admitted_in_order()
        assert self.core.quiet
        for output in self.outputs.values():
            assert output.closed == 1, f"{output.spec.request_id} never ended"
        assert self.core.prefix_pins() == 0


class ShortPrefixMachine(SchedulerMachine):
    """Cached prefixes shorter than thirteen tokens are prefilled again: the
    twelve shared tokens are not reused, their holds still anchor what the
    prompt keeps, and a chunk (eight tokens) that ends inside such a prefix
    keeps nothing."""

    MIN_REUSE = len(SHARED) + 1


def test_the_core_keeps_its_promises() -> None:
    run_state_machine_as_test(
        SchedulerMachine,
        settings=settings(max_examples=100, stateful_step_count=50, deadline=None),
    )


def test_the_core_keeps_its_promises_when_short_prefixes_are_not_reused() -> None:
    run_state_machine_as_test(
        ShortPrefixMachine,
        settings=settings(max_examples=50, stateful_step_count=50, deadline=None),
    )


def test_the_core_does_no_io() -> None:
    """No event loop, thread, clock or socket inside the rules: time comes in
    as ``now``, and messages go out for the shell to carry."""
    tree = ast.parse(inspect.getsource(scheduler_core))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert "sluiceway" in imported  # the walk sees imports
    assert not imported & {"anyio", "asyncio", "trio", "threading", "time", "socket", "os"}


# --- single rules, driven through the machine's helpers -------------------------


def _one_request(machine: SchedulerMachine, *, max_tokens: int = 9) -> Output:
    """Submit one request and run the step that brings its first token."""
    machine.submit(n=1, shared=True, own=[20, 21], max_tokens=max_tokens, slow=False)
    (output,) = machine.outputs.values()
    while not output.tokens(0):
        machine.run_step()
    return output


def _failures(output: Output) -> list[RequestFailed]:
    return [m for m in output.messages if isinstance(m, RequestFailed)]


def test_a_paused_request_ends_as_stalled_at_the_stall_timeout_and_not_before(
    caplog: pytest.LogCaptureFixture,
) -> None:
    machine = SchedulerMachine()
    output = _one_request(machine)
    output.full = True
    machine.now = 10.0
    machine.run_step()  # paused here, at 10
    assert machine.core.counters().paused_requests == 1
    assert machine.core.wake_after(12.0, poll=None) == pytest.approx(3.0)
    assert machine.core.wake_after(12.0, poll=1.0) == 1.0
    assert machine.core.wake_after(12.0, poll=0.25) == 0.25
    assert machine.core.wake_after(16.0, poll=None) == 0.0  # overdue: at once
    machine.now = 10.0 + STALL_SECONDS - 0.01
    machine.run_step()
    assert not output.closed
    assert not _failures(output)
    machine.now = 10.0 + STALL_SECONDS
    with caplog.at_level("WARNING"):
        machine.run_step()
    assert output.closed == 1
    assert [(f.message, f.cause) for f in _failures(output)] == [
        ("the client stopped reading", FailureCause.STALLED)
    ]
    assert "request r0 stalled: its client stopped reading" in caplog.messages


def test_a_reader_that_keeps_up_never_stalls() -> None:
    machine = SchedulerMachine()
    output = _one_request(machine)
    machine.now = 100.0
    while not output.closed:
        machine.run_step()
    assert not _failures(output)
    assert output.tokens(0) == list(expected_tokens(output.spec.prompt_ids, 9))


def test_a_lost_engine_fails_every_request_and_empties_the_prefix_cache() -> None:
    machine = SchedulerMachine()
    output = _one_request(machine)
    assert machine.core.prefix_pins() > 0  # the request holds its prompt's path
    stats = machine.core.prefix_stats
    assert stats is not None
    assert stats.tokens > 0
    machine.engine_lost()
    assert [(f.message, f.cause) for f in _failures(output)] == [
        ("the engine process was lost", FailureCause.ENGINE)
    ]
    stats = machine.core.prefix_stats
    assert stats is not None
    assert stats.tokens == 0
    assert stats.lookups == 0
    assert machine.core.prefix_pins() == 0


def test_prefix_pins_are_zero_with_the_cache_off() -> None:
    core = SchedulerCore(
        SchedulerConfig(eos_ids=frozenset({EOS})), SequenceEngine().info, guided=False
    )
    assert core.prefix_stats is None
    assert core.prefix_pins() == 0


def test_a_restore_that_fails_fails_its_request_and_frees_its_slot() -> None:
    machine = SchedulerMachine()
    output = _one_request(machine)
    output.full = True
    machine.run_step()  # paused, its row freed
    output.full = False
    machine.core.command(Resume(request_id=output.spec.request_id), machine.now)
    planned = machine.core.plan({}, machine.now)
    assert planned is not None
    (work,) = planned.plan.prefills  # the first chunk of its restore
    assert not work.final
    outcome = execute(machine.engine, planned.plan)  # type: ignore[arg-type]
    outcome.prefills[0] = PrefillOutcome(error="out of memory")
    machine.core.absorb(planned.plan, outcome)
    machine.carry()
    assert [(f.message, f.cause) for f in _failures(output)] == [
        ("out of memory", FailureCause.ENGINE)
    ]
    assert output.closed == 1
    assert machine.core.counters().running_rows == 0
    assert machine.core.shutdown().frees == (work.slot,)


def _cached(output: Output) -> list[int]:
    return [m.tokens for m in output.messages if isinstance(m, PromptCached)]


def _settle(machine: SchedulerMachine) -> None:
    """Run steps until nothing is left to do."""
    while not machine.core.quiet:
        machine.run_step()


def _three_tokens_in(machine: SchedulerMachine) -> Output:
    """Request r0 (three prompt tokens, up to nine new), three tokens into its reply."""
    machine.submit(n=1, shared=False, own=[20, 21, 22], max_tokens=9, slow=False)
    first = machine.outputs["r0"]
    while len(first.tokens(0)) < 3:
        machine.run_step()
    return first


def test_a_finished_request_leaves_its_prompt_and_tokens_in_the_prefix_cache() -> None:
    machine = SchedulerMachine()
    first = _one_request(machine, max_tokens=4)
    while not first.closed:
        machine.run_step()
    _settle(machine)  # the finished row's copy into the cache
    prompt = first.spec.prompt_ids + tuple(first.tokens(0)) + (30,)
    machine.submit(n=1, shared=False, own=list(prompt), max_tokens=1, slow=False)
    second = machine.outputs["r1"]
    while not second.closed:
        machine.run_step()
    (cached,) = _cached(second)
    # Its prompt and every token it generated but the last (never fed back,
    # so the row has no KV for it).
    assert cached == len(first.spec.prompt_ids) + len(first.tokens(0)) - 1


def test_a_failed_cache_edit_starts_the_prefix_cache_afresh(
    caplog: pytest.LogCaptureFixture,
) -> None:
    machine = SchedulerMachine()
    output = _one_request(machine)
    stats = machine.core.prefix_stats
    assert stats is not None
    assert stats.tokens > 0
    planned = machine.core.plan({}, machine.now)
    assert planned is not None
    outcome = execute(machine.engine, planned.plan)  # type: ignore[arg-type]
    outcome.cache_error = "the copy failed"
    with caplog.at_level("ERROR"):
        machine.core.absorb(planned.plan, outcome)
    assert "the copy failed; the prefix cache starts afresh" in caplog.messages
    stats = machine.core.prefix_stats
    assert stats is not None
    assert stats.tokens == 0
    assert not _failures(output)  # the requests go on


def _submit(machine: SchedulerMachine, name: str, **fields: object) -> Output:
    """Submit a greedy request with these ``GenerationRequest`` fields."""
    defaults: dict[str, object] = {
        "prompt_ids": (1, 2, 3),
        "sampling": SamplingParams(temperature=0.0),
        "limits": Limits(max_tokens=9),
    }
    spec = GenerationRequest(request_id=name, **(defaults | fields))  # type: ignore[arg-type]
    output = machine.outputs[name] = Output(len(machine.outputs), spec)
    machine.core.command(Submit(request=spec, output=output, backlog=output), machine.now)
    return output


def _started(machine: SchedulerMachine, *outputs: Output) -> None:
    while not all(output.tokens(0) for output in outputs):
        machine.run_step()


def test_mask_needs_masks_eos_out_of_a_greedy_row_before_min_tokens() -> None:
    machine = SchedulerMachine()
    # Three short prompts, so that all three start in one step (one token each).
    plain_limits = Limits(max_tokens=9, min_tokens=1)  # past it at its first token
    _submit(machine, "plain", prompt_ids=(1, 2), limits=plain_limits)
    _submit(machine, "held", prompt_ids=(4, 5), limits=Limits(max_tokens=9, min_tokens=5))
    # ignore_eos: only its stop tokens are held back.
    limits = Limits(max_tokens=9, min_tokens=5, ignore_eos=True, stop_token_ids=frozenset({29}))
    _submit(machine, "stops", prompt_ids=(7, 8), limits=limits)
    _started(machine, *machine.outputs.values())
    assert [len(output.tokens(0)) for output in machine.outputs.values()] == [1, 1, 1]
    needs = machine.core.mask_needs()
    assert needs is not None
    masks, guided, slots = needs
    assert (guided, slots) == ([], [])
    held, stops = masks  # the plain row needs no mask
    vocab = machine.engine.info.vocab_size
    assert np.array_equal(masks[held], every_token(vocab, but=(EOS,)))
    assert np.array_equal(masks[stops], every_token(vocab, but=(29,)))


def test_mask_needs_leaves_other_rows_to_the_sampler() -> None:
    sampled = SamplingParams(temperature=1.0)
    for fields in (
        {"sampling": sampled, "limits": Limits(max_tokens=9, min_tokens=5)},
        {"constraint": Constraint(kind=ConstraintKind.JSON_OBJECT)},
    ):
        machine = SchedulerMachine()
        _started(machine, _submit(machine, "r", **fields))
        assert machine.core.mask_needs() is None, fields


def test_mask_needs_asks_nothing_once_every_row_is_free() -> None:
    # Past min_tokens (from its first token on), a sampled row needs no mask.
    machine = SchedulerMachine()
    limits = Limits(max_tokens=9, min_tokens=1)
    sampled = SamplingParams(temperature=1.0)
    _started(machine, _submit(machine, "r", limits=limits, sampling=sampled))
    assert machine.core.mask_needs() == ({}, [], [])


def test_memory_is_given_back_once_idle_for_the_configured_time() -> None:
    machine = SchedulerMachine()
    config = SchedulerConfig(
        eos_ids=frozenset({EOS}), prefill_chunk_tokens=CHUNK, release_memory_after=2.0
    )
    machine.core = SchedulerCore(config, machine.engine.info, guided=False)
    assert not machine.core.release_due(50.0)  # no work yet: nothing to give back
    output = _one_request(machine, max_tokens=2)
    assert machine.core.wake_after(55.0, poll=None) == math.inf  # busy: no release planned
    while not (output.closed and machine.core.quiet):
        machine.run_step()
    assert machine.core.wake_after(60.0, poll=None) == 2.0
    assert not machine.core.release_due(61.99)
    assert machine.core.release_due(62.0)
    assert not machine.core.release_due(62.0)  # given back once
    assert machine.core.wake_after(63.0, poll=None) == math.inf  # no work since
    # Work again: the next release waits the interval since the last one.
    machine.submit(n=1, shared=False, own=[7], max_tokens=1, slow=False)
    while not (machine.outputs["r1"].closed and machine.core.quiet):
        machine.run_step()
    assert machine.core.wake_after(63.0, poll=None) == 62.0 + RELEASE_INTERVAL_SECONDS - 63.0


def test_counters_count_what_runs_and_what_its_rows_hold() -> None:
    machine = SchedulerMachine()
    machine.submit(n=1, shared=True, own=[20, 21], max_tokens=9, slow=False)
    machine.run_step()  # the first chunk of its fourteen prompt tokens
    machine.submit(n=1, shared=False, own=[5], max_tokens=9, slow=False)  # waits
    assert machine.core.counters() == Counters(
        running_requests=1, running_rows=0, free_rows=3, paused_requests=0, cached_tokens=8
    )
    first, second = machine.outputs["r0"], machine.outputs["r1"]
    while len(first.tokens(0)) < 2 or not second.tokens(0):
        machine.run_step()
    counters = machine.core.counters()
    assert counters.running_requests == 2
    # Each running row holds its prompt and the tokens it generated.
    held = [len(o.spec.prompt_ids) + len(o.tokens(0)) for o in (first, second)]
    assert counters.cached_tokens == sum(held)
    first.full = True
    machine.run_step()
    assert machine.core.counters().paused_requests == 1


def test_a_client_gone_ends_its_request_without_a_message() -> None:
    machine = SchedulerMachine()
    output = _one_request(machine)
    (slot,) = machine.owners  # its one row
    count = len(output.messages)
    machine.core.client_gone("nobody")  # an unknown request: nothing happens
    machine.core.client_gone(output.spec.request_id)
    machine.carry()
    assert output.closed == 1
    assert len(output.messages) == count
    assert machine.core.idle
    assert machine.core.shutdown().frees == (slot,)


def test_running_keys_are_every_choice_the_sampler_must_remember() -> None:
    machine = SchedulerMachine()
    machine.submit(n=2, shared=False, own=[5, 6], max_tokens=9, slow=False)
    first = machine.outputs["r0"]
    assert machine.core.running_keys() == set()  # waiting: nothing drawn yet
    _started(machine, first)
    assert machine.core.running_keys() == {("r0", 0), ("r0", 1)}
    first.full = True
    machine.run_step()  # paused
    assert machine.core.counters().paused_requests == 1
    assert machine.core.running_keys() == {("r0", 0), ("r0", 1)}
    first.full = False
    machine.core.command(Resume(request_id="r0"), machine.now)
    planned = machine.core.plan({}, machine.now)  # being prefilled back
    assert planned is not None
    assert planned.plan.prefills
    assert machine.core.running_keys() == {("r0", 0), ("r0", 1)}


def test_a_failed_grammar_fails_its_request() -> None:
    machine = SchedulerMachine()
    _submit(machine, "a")
    _submit(machine, "b")
    _started(machine, *machine.outputs.values())
    planned = machine.core.plan({}, machine.now)
    assert planned is not None
    outcome = execute(machine.engine, planned.plan)  # type: ignore[arg-type]
    batch = machine.core.absorb(planned.plan, outcome)
    rows = machine.core.rows(batch.choices)
    assert [(row.request_id, row.choice, row.first) for row in rows] == [
        ("a", 0, False),
        ("b", 0, False),
    ]
    assert [row.prompt_ids for row in rows] == [(1, 2, 3), (1, 2, 3)]
    report = ConstraintReport(failed=((1, "the grammar failed"),))
    machine.core.fail_constrained(batch.choices, report)
    machine.core.fail_constrained(batch.choices, report)  # already ended: once
    machine.carry()
    a, b = machine.outputs["a"], machine.outputs["b"]
    assert [f.message for f in _failures(b)] == ["the grammar failed"]
    assert b.closed == 1
    assert not _failures(a)
    assert not a.closed


def _guided_machine() -> SchedulerMachine:
    """A machine whose core has the sampler's guides and draws (the engine
    may pick guided and drawn rows' tokens)."""
    machine = SchedulerMachine()
    config = SchedulerConfig(
        eos_ids=frozenset({EOS}), max_num_seqs=CAPACITY, prefill_chunk_tokens=CHUNK
    )
    machine.core = SchedulerCore(config, machine.engine.info, guided=True)
    return machine


def _draws(*uniforms: float) -> list[Draw]:
    return [Draw(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, uniform=u) for u in uniforms]


def test_the_engine_draws_the_tokens_of_unadjusted_sampled_rows() -> None:
    machine = _guided_machine()
    sampled = SamplingParams(temperature=1.0)
    drawn = _submit(machine, "s", n=2, sampling=sampled)
    _submit(machine, "g")  # greedy: its first token is a plain argmax, no draw
    planned = machine.core.plan({}, machine.now)
    assert planned is not None
    assert planned.plan.greedy
    assert planned.drawn == []
    assert {
        name: [(r.choice, r.first) for r in rows] for name, rows in planned.starting.items()
    } == {"s": [(0, True), (1, True)]}
    first = _draws(0.1, 0.9)
    plan = with_draws(planned, first)
    assert plan.draws == {}
    assert {work.request_id: work.draws for work in plan.prefills} == {"s": tuple(first), "g": ()}
    batch = machine.core.absorb(plan, execute(machine.engine, plan))  # type: ignore[arg-type]
    assert batch.greedy is not None
    machine.core.deliver_samples(machine.core.decide(batch.choices, batch.greedy, batch.scores))
    machine.carry()
    assert drawn.tokens(0)
    assert drawn.tokens(1)
    planned = machine.core.plan({}, machine.now)  # now both rows of "s" decode, drawn
    assert planned is not None
    assert planned.plan.greedy
    assert planned.starting == {}
    slots = [choice.slot for choice, _ in planned.drawn]
    assert [row.request_id for _, row in planned.drawn] == ["s", "s"]
    later = _draws(0.2, 0.3)
    assert with_draws(planned, later).draws == dict(zip(slots, later, strict=True))


def test_rows_the_engine_cannot_pick_go_to_the_sampler() -> None:
    # min_tokens: the first row suppresses EOS, which the engine's draw does not.
    machine = _guided_machine()
    limits = Limits(max_tokens=9, min_tokens=2)
    _submit(machine, "s", sampling=SamplingParams(temperature=1.0), limits=limits)
    planned = machine.core.plan({}, machine.now)
    assert planned is not None
    assert not planned.plan.greedy
    assert (planned.drawn, planned.starting) == ([], {})
    # A constraint: the sampler's grammar picks the first token.
    machine = _guided_machine()
    json_object = Constraint(kind=ConstraintKind.JSON_OBJECT)
    _submit(machine, "c", sampling=SamplingParams(temperature=1.0), constraint=json_object)
    planned = machine.core.plan({}, machine.now)
    assert planned is not None
    assert not planned.plan.greedy


def test_a_greedy_constrained_row_is_picked_under_its_grammar_by_the_engine() -> None:
    machine = _guided_machine()
    constrained = _submit(machine, "c", constraint=Constraint(kind=ConstraintKind.JSON_OBJECT))
    _started(machine, constrained)
    needs = machine.core.mask_needs()
    assert needs is not None
    masks, rows, slots = needs
    assert masks == {}
    assert [row.request_id for row in rows] == ["c"]
    assert slots == list(machine.owners)


@pytest.mark.parametrize("first_copy", ["cancelled", "failed"])
def test_a_chunk_copy_settles_whatever_became_of_the_one_before(first_copy: str) -> None:
    # Two prompt chunks copied into the cache in one step; the first request
    # is cancelled meanwhile (its copy is linked, then let go), or the engine
    # fails to copy it (nothing linked). The second's copy is linked either way.
    machine = SchedulerMachine()
    machine.submit(n=1, shared=False, own=[9, 8, 7, 6], max_tokens=2, slow=False)
    machine.submit(n=1, shared=False, own=[5, 4, 3], max_tokens=2, slow=False)
    planned = machine.core.plan({}, machine.now)
    assert planned is not None
    assert [work.keep is not None for work in planned.plan.prefills] == [True, True]
    machine.owners.update((work.slot, work.request_id) for work in planned.plan.prefills)
    outcome = execute(machine.engine, planned.plan)  # type: ignore[arg-type]
    if first_copy == "cancelled":
        machine.core.command(Cancel(request_id="r0"), machine.now)
    else:
        outcome.prefills[0].kept = False
    batch = machine.core.absorb(planned.plan, outcome)
    machine.core.deliver_samples(machine.core.decide(batch.choices, batch.greedy, batch.scores))
    for name in ("r0", "r1"):  # neither keeps a row: only the chunks are cached
        machine.core.command(Cancel(request_id=name), machine.now)
    machine.carry()
    _settle(machine)
    assert machine.core.prefix_pins() == 0
    for prompt in ((9, 8, 7, 6, 1), (5, 4, 3, 1)):
        machine.submit(n=1, shared=False, own=list(prompt), max_tokens=1, slow=False)
    _settle(machine)
    first_cached = [4] if first_copy == "cancelled" else []
    assert [_cached(machine.outputs[name]) for name in ("r2", "r3")] == [first_cached, [3]]


def test_a_chunk_kept_beside_a_restore_is_kept() -> None:
    # A restore's chunk keeps nothing; a new request's chunk in the same step does.
    machine = SchedulerMachine()
    machine.submit(n=1, shared=False, own=[20, 21], max_tokens=9, slow=False)
    paused = machine.outputs["r0"]
    _started(machine, paused)
    paused.full = True
    machine.run_step()  # paused
    paused.full = False
    machine.core.command(Resume(request_id=paused.spec.request_id), machine.now)
    machine.submit(n=1, shared=False, own=[9, 8, 7], max_tokens=1, slow=False)
    planned = machine.core.plan({}, machine.now)
    assert planned is not None
    kinds = [(work.request_id, work.keep is not None) for work in planned.plan.prefills]
    assert kinds == [("r0", False), ("r1", True)]
    machine.owners.update((work.slot, work.request_id) for work in planned.plan.prefills)
    machine.admitted.append(1)
    outcome = execute(machine.engine, planned.plan)  # type: ignore[arg-type]
    batch = machine.core.absorb(planned.plan, outcome)
    machine.core.deliver_samples(machine.core.decide(batch.choices, batch.greedy, batch.scores))
    machine.carry()
    machine.core.command(Cancel(request_id="r1"), machine.now)  # before its row is kept
    while not (paused.closed and machine.core.quiet):
        machine.run_step()
    assert machine.core.prefix_pins() == 0
    machine.submit(n=1, shared=False, own=[9, 8, 7, 1], max_tokens=1, slow=False)
    _settle(machine)
    assert _cached(machine.outputs["r2"]) == [3]


def test_a_cancelled_row_leaves_only_its_prompt_in_the_prefix_cache() -> None:
    # Only a row that ended normally gives its generated tokens to the cache.
    machine = SchedulerMachine()
    first = _three_tokens_in(machine)
    first.cancelled = True
    machine.core.command(Cancel(request_id="r0"), machine.now)
    machine.carry()
    _settle(machine)
    prompt = first.spec.prompt_ids + tuple(first.tokens(0)) + (30,)
    machine.submit(n=1, shared=False, own=list(prompt), max_tokens=1, slow=False)
    _settle(machine)
    assert _cached(machine.outputs["r1"]) == [len(first.spec.prompt_ids)]


def test_a_draining_core_refuses_submissions_by_name() -> None:
    machine = SchedulerMachine()
    machine.core.drain()
    spec = GenerationRequest(request_id="late", prompt_ids=(1,), limits=Limits(max_tokens=1))
    with pytest.raises(ServiceUnavailable, match=r"^the server is shutting down$"):
        machine.core.command(Submit(request=spec, output=Output(0, spec)), 0.0)


def test_admission_reports_each_request_s_time_in_the_queue() -> None:
    waited: list[float] = []
    machine = SchedulerMachine()
    config = SchedulerConfig(
        eos_ids=frozenset({EOS}), prefill_chunk_tokens=CHUNK, on_admitted=waited.append
    )
    machine.core = SchedulerCore(config, machine.engine.info, guided=False)
    machine.now = 1.0
    machine.submit(n=1, shared=False, own=[5], max_tokens=1, slow=False)
    machine.now = 3.5
    machine.run_step()
    assert waited == [2.5]


def test_leaving_the_queue_or_a_prefill_is_counted_and_frees_its_rows() -> None:
    machine = SchedulerMachine()
    machine.submit(n=1, shared=False, own=[5], max_tokens=9, slow=False)
    running = machine.outputs["r0"]
    _started(machine, running)
    machine.submit(n=2, shared=True, own=[20, 21], max_tokens=9, slow=False)  # two chunks
    machine.run_step()  # its first chunk: two rows reserved
    for own in ([5], [6]):
        machine.submit(n=1, shared=False, own=own, max_tokens=9, slow=False)
    assert machine.core.take_dequeued() == 2  # r0 and r1 left the queue
    for name in ("r0", "r2", "r3", "r1"):
        machine.outputs[name].cancelled = True
        machine.core.command(Cancel(request_id=name), machine.now)
    machine.carry()
    assert machine.core.take_dequeued() == 2
    assert all(output.closed == 1 for output in machine.outputs.values())
    frees = machine.core.shutdown().frees
    assert len(set(frees)) == len(frees) == 3  # r0's row and r1's two
    assert set(machine.owners) < set(frees)


def test_a_request_cancelled_while_being_restored_frees_the_restore_s_row() -> None:
    machine = SchedulerMachine()
    output = _one_request(machine)
    output.full = True
    machine.run_step()  # paused
    output.full = False
    machine.core.command(Resume(request_id=output.spec.request_id), machine.now)
    planned = machine.core.plan({}, machine.now)
    assert planned is not None
    (work,) = planned.plan.prefills  # the first chunk of its restore
    machine.core.absorb(planned.plan, execute(machine.engine, planned.plan))  # type: ignore[arg-type]
    machine.core.command(Cancel(request_id=output.spec.request_id), machine.now)
    assert machine.core.shutdown().frees == (work.slot,)


def test_a_choice_the_output_ended_gives_its_tokens_to_the_prefix_cache() -> None:
    machine = SchedulerMachine()
    first = _three_tokens_in(machine)
    first.ended.add(0)
    machine.core.command(FinishChoice(request_id="r0", choice=0), machine.now)
    machine.carry()
    assert first.closed == 1
    _settle(machine)
    prompt = first.spec.prompt_ids + tuple(first.tokens(0)) + (30,)
    machine.submit(n=1, shared=False, own=list(prompt), max_tokens=1, slow=False)
    _settle(machine)
    assert _cached(machine.outputs["r1"]) == [len(prompt) - 2]


def test_each_step_fills_its_prefill_budget_in_arrival_order() -> None:
    machine = SchedulerMachine()
    for own in ([1] * 10, [2] * 10, [3] * 3, [4] * 5):
        machine.submit(n=1, shared=False, own=own, max_tokens=9, slow=False)
    steps = []
    for _ in range(3):
        planned = machine.core.plan({}, machine.now)
        assert planned is not None
        steps.append([(w.request_id, len(w.tokens), w.final) for w in planned.plan.prefills])
        outcome = execute(machine.engine, planned.plan)  # type: ignore[arg-type]
        batch = machine.core.absorb(planned.plan, outcome)
        if batch.choices:
            assert batch.greedy is not None
            machine.core.deliver_samples(
                machine.core.decide(batch.choices, batch.greedy, batch.scores)
            )
        machine.carry()
    assert steps == [
        [("r0", 8, False)],
        [("r0", 2, True), ("r1", 6, False)],
        [("r1", 4, True), ("r2", 3, True), ("r3", 1, False)],
    ]


def test_a_deferred_final_chunk_does_not_hold_up_the_next_prompt() -> None:
    machine = SchedulerMachine()
    for own in ([1] * 10, [2] * 10, [3] * 3):
        machine.submit(n=1, shared=False, own=own, max_tokens=9, slow=False)
    for defer in (False, True):
        planned = machine.core.plan({}, machine.now)
        assert planned is not None
        outcome = execute(machine.engine, planned.plan)  # type: ignore[arg-type]
        if defer:  # r0's final chunk goes into the next step's forward pass
            assert planned.plan.prefills[0].final
            outcome.prefills[0] = PrefillOutcome(deferred=True)
        machine.core.absorb(planned.plan, outcome)
    planned = machine.core.plan({}, machine.now)
    assert planned is not None
    prefills = [(w.request_id, len(w.tokens)) for w in planned.plan.prefills]
    assert prefills == [("r1", 4), ("r2", 3)]
    # This step's outcome lacks the deferred chunk's (the engine lost it): r0 fails.
    machine.core.absorb(planned.plan, execute(machine.engine, planned.plan))  # type: ignore[arg-type]
    machine.carry()
    assert [(f.message, f.cause) for f in _failures(machine.outputs["r0"])] == [
        ("the engine lost this prefill", FailureCause.ENGINE)
    ]
    assert not _failures(machine.outputs["r1"])


def test_a_request_is_admitted_when_its_rows_just_fit() -> None:
    machine = SchedulerMachine()
    machine.submit(n=2, shared=False, own=[5], max_tokens=9, slow=False)
    machine.submit(n=2, shared=False, own=[6], max_tokens=9, slow=False)
    planned = machine.core.plan({}, machine.now)
    assert planned is not None
    assert [w.request_id for w in planned.plan.prefills] == ["r0", "r1"]  # 2 + 2 rows of 4


def test_a_step_with_masked_and_drawn_rows_is_the_engine_s_to_pick() -> None:
    machine = _guided_machine()
    limits_held = Limits(max_tokens=9, min_tokens=5)
    held = _submit(machine, "held", limits=limits_held)
    plain = _submit(machine, "plain")
    _started(machine, held, plain)  # first tokens by the sampler's argmax
    drawn = _submit(machine, "s", sampling=SamplingParams(temperature=1.0))
    _started(machine, drawn)
    needs = machine.core.mask_needs()
    assert needs is not None
    masks, guided, _ = needs
    assert guided == []
    (held_slot,) = masks
    planned = machine.core.plan(masks, machine.now)
    assert planned is not None
    assert planned.plan.greedy
    assert planned.plan.masks == masks
    assert [(row.request_id, row.first) for _, row in planned.drawn] == [("s", False)]
    assert held_slot not in [choice.slot for choice, _ in planned.drawn]
    assert [(row.choice, row.first) for _, row in planned.drawn] == [(0, False)]
    # Without the masks, the held row needs the sampler: the step is not greedy.
    planned = machine.core.plan({}, machine.now)
    assert planned is not None
    assert not planned.plan.greedy
    assert planned.plan.masks == {}
    assert planned.drawn == []
    # A request starting with min_tokens needs the sampler too: the masks and
    # the draws are left out, though the decoding rows could use them.
    _submit(machine, "late", sampling=SamplingParams(temperature=1.0), limits=limits_held)
    planned = machine.core.plan(masks, machine.now)
    assert planned is not None
    assert not planned.plan.greedy
    assert planned.plan.masks == {}
    assert planned.drawn == []


def test_a_reader_that_caught_up_comes_back_before_one_still_behind() -> None:
    machine = SchedulerMachine()
    for own in ([5], [6]):
        machine.submit(n=1, shared=False, own=own, max_tokens=9, slow=False)
    behind, caught_up = machine.outputs["r0"], machine.outputs["r1"]
    _started(machine, behind, caught_up)
    behind.full = caught_up.full = True
    machine.run_step()  # both paused
    caught_up.full = False
    machine.core.command(Resume(request_id="r1"), machine.now)
    planned = machine.core.plan({}, machine.now)
    assert planned is not None
    assert [w.request_id for w in planned.plan.prefills] == ["r1"]


def test_a_request_for_prompt_logprobs_reuses_no_cached_prefix() -> None:
    # Every prompt position is scored, so none comes from the cache.
    machine = SchedulerMachine()
    for name, logprobs in (("first", None), ("scored", 1), ("plain", None)):
        output = _submit(machine, name, logprobs=LogprobParams(prompt_top=logprobs))
        while not (output.closed and machine.core.quiet):
            machine.run_step()
    cached = {name: _cached(machine.outputs[name]) for name in ("first", "scored", "plain")}
    assert cached == {"first": [], "scored": [], "plain": [2]}  # all of (1, 2, 3) but the last


def _prefills_of_a_step(machine: SchedulerMachine) -> list[tuple[str, int]]:
    """Plan and run one step; its prefills (request, tokens)."""
    planned = machine.core.plan({}, machine.now)
    assert planned is not None
    machine.owners.update((w.slot, w.request_id) for w in planned.plan.prefills)
    batch = machine.core.absorb(planned.plan, execute(machine.engine, planned.plan))  # type: ignore[arg-type]
    if batch.choices:
        assert batch.greedy is not None
        machine.core.deliver_samples(machine.core.decide(batch.choices, batch.greedy, batch.scores))
    machine.carry()
    return [(w.request_id, len(w.tokens)) for w in planned.plan.prefills]


def test_restores_share_each_step_s_prefill_budget_in_order() -> None:
    machine = SchedulerMachine()
    for _ in range(2):
        machine.submit(n=1, shared=True, own=[20, 21], max_tokens=9, slow=False)
    outputs = list(machine.outputs.values())
    _started(machine, *outputs)
    for output in outputs:
        output.full = True
    machine.run_step()  # both paused
    for output in outputs:
        output.full = False
        machine.core.command(Resume(request_id=output.spec.request_id), machine.now)
    # Each is prefilled back with its prompt and its tokens but the last, in
    # order, CHUNK tokens a step.
    left = {o.spec.request_id: len(o.spec.prompt_ids) + len(o.tokens(0)) - 1 for o in outputs}
    expected = []
    while any(left.values()):
        budget, step = CHUNK, []
        for name, count in left.items():
            if count and budget:
                take = min(count, budget)
                step.append((name, take))
                left[name] -= take
                budget -= take
        expected.append(step)
    assert len(expected) > 2
    assert [_prefills_of_a_step(machine) for _ in expected] == expected


def test_chunks_carry_their_targets_and_forks_only_where_asked() -> None:
    # Prompt logprobs score each position against the next prompt token; the
    # choices fork from the first row after the final chunk.
    machine = SchedulerMachine()
    prompt = tuple(range(1, 15))
    _submit(machine, "scored", prompt_ids=prompt, n=2, logprobs=LogprobParams(prompt_top=1))
    works = []
    for _ in range(2):
        planned = machine.core.plan({}, machine.now)
        assert planned is not None
        (work,) = planned.plan.prefills
        works.append(work)
        machine.core.absorb(planned.plan, execute(machine.engine, planned.plan))  # type: ignore[arg-type]
    first, final = works
    assert (first.tokens, first.targets, first.forks) == (prompt[:8], prompt[1:9], ())
    assert (final.tokens, final.targets) == (prompt[8:], prompt[9:])
    assert len(final.forks) == 1
    assert final.forks[0] != final.slot
    machine = SchedulerMachine()
    _submit(machine, "plain", prompt_ids=prompt)
    planned = machine.core.plan({}, machine.now)
    assert planned is not None
    assert planned.plan.prefills[0].targets == ()


def test_a_one_token_budget_still_prefills_a_token_a_step() -> None:
    machine = SchedulerMachine()
    config = SchedulerConfig(eos_ids=frozenset({EOS}), prefill_chunk_tokens=1)
    machine.core = SchedulerCore(config, machine.engine.info, guided=False)
    _submit(machine, "r", prompt_ids=(1, 2, 3))
    assert [_prefills_of_a_step(machine) for _ in range(3)] == [[("r", 1)]] * 3


def test_a_row_past_min_tokens_is_no_longer_held_back() -> None:
    machine = SchedulerMachine()
    early = _submit(machine, "early", prompt_ids=(1, 2), limits=Limits(max_tokens=9, min_tokens=2))
    _submit(machine, "late", prompt_ids=(4, 5), limits=Limits(max_tokens=9, min_tokens=5))
    _started(machine, *machine.outputs.values())
    needs = machine.core.mask_needs()
    assert needs is not None
    assert len(needs[0]) == 2  # both held back at their first token
    while len(early.tokens(0)) < 2:
        machine.run_step()
    needs = machine.core.mask_needs()
    assert needs is not None
    assert len(needs[0]) == 1  # only "late" now


def test_sample_steps_count_and_carry_their_rows_and_live_keys() -> None:
    machine = SchedulerMachine()
    output = _submit(machine, "s", sampling=SamplingParams(temperature=1.0))
    steps = []
    for _ in range(2):
        planned = machine.core.plan({}, machine.now)
        assert planned is not None
        batch = machine.core.absorb(planned.plan, execute(machine.engine, planned.plan))  # type: ignore[arg-type]
        assert batch.greedy is None  # a sampled row: the sampler picks
        step = machine.core.sample_step(batch)
        steps.append(step.step)
        assert step.rows == tuple(machine.core.rows(batch.choices))
        assert step.live == frozenset({("s", 0)})
        tokens = [int(t) for t in np.argmax(step.logits, axis=1)]
        machine.core.deliver_samples(machine.core.decide(batch.choices, tokens, batch.scores))
        machine.carry()
    assert steps[1] == steps[0] + 1
    assert steps[0] == 1
    assert len(output.tokens(0)) == 2


def _decoding_batch(machine: SchedulerMachine) -> Batch:
    planned = machine.core.plan({}, machine.now)
    assert planned is not None
    return machine.core.absorb(planned.plan, execute(machine.engine, planned.plan))  # type: ignore[arg-type]


def test_decide_ends_rows_for_each_cause_and_passes_logprobs_on() -> None:
    machine = SchedulerMachine()
    config = SchedulerConfig(eos_ids=frozenset({EOS}), max_num_seqs=8, prefill_chunk_tokens=CHUNK)
    machine.core = SchedulerCore(config, machine.engine.info, guided=False)  # five rows at once
    stop = expected_tokens((1,), 2)[1]  # "stop"'s second token
    _submit(machine, "failed", prompt_ids=(4,))
    _submit(
        machine,
        "stop",
        prompt_ids=(1,),
        limits=Limits(max_tokens=9, stop_token_ids=frozenset({stop})),
    )
    _submit(machine, "grammar", prompt_ids=(7,))
    _submit(machine, "eos", prompt_ids=(10,))
    _submit(machine, "ignores", prompt_ids=(12,), limits=Limits(max_tokens=9, ignore_eos=True))
    _started(machine, *machine.outputs.values())
    batch = _decoding_batch(machine)
    assert [c.request.spec.request_id for c in batch.choices] == [
        "failed",
        "stop",
        "grammar",
        "eos",
        "ignores",
    ]
    machine.core.fail_constrained(batch.choices, ConstraintReport(failed=((0, "bad"),)))
    tokens = [expected_tokens(c.request.spec.prompt_ids, 2)[1] for c in batch.choices[:3]]
    tokens += [EOS, EOS]
    scores = [None, TokenLogprob(logprob=-0.5), None, None, None]
    decided = machine.core.decide(
        batch.choices, tokens, scores, ConstraintReport(complete=frozenset({2}))
    )
    assert decided == {
        "stop": [
            TokenSample(
                choice=0, token_id=tokens[1], logprob=scores[1], finish=FinishCause.STOP_TOKEN
            )
        ],
        "grammar": [
            TokenSample(choice=0, token_id=tokens[2], logprob=None, finish=FinishCause.GRAMMAR)
        ],
        "eos": [TokenSample(choice=0, token_id=EOS, logprob=None, finish=FinishCause.EOS)],
        "ignores": [TokenSample(choice=0, token_id=EOS, logprob=None)],
    }
    machine.core.deliver_samples(decided)
    machine.carry()
    closed = [machine.outputs[n].closed for n in ("failed", "stop", "grammar", "eos", "ignores")]
    assert closed == [1, 1, 1, 1, 0]


def test_samples_of_a_request_gone_meanwhile_are_dropped_and_the_others_delivered() -> None:
    machine = SchedulerMachine()
    gone, stays = _submit(machine, "gone", prompt_ids=(4, 5)), _submit(machine, "stays")
    _started(machine, gone, stays)
    batch = _decoding_batch(machine)
    tokens = [expected_tokens(c.request.spec.prompt_ids, 2)[1] for c in batch.choices]
    decided = machine.core.decide(batch.choices, tokens, batch.scores)
    machine.core.command(Cancel(request_id="gone"), machine.now)
    machine.core.deliver_samples(decided)
    machine.carry()
    assert len(gone.tokens(0)) == 1
    assert len(stays.tokens(0)) == 2


def test_a_restored_choice_resumes_with_exactly_its_tokens() -> None:
    # run_step checks that the engine's sequence for each decoded row is its
    # prompt and tokens: the restore must have fed back every token it had.
    machine = SchedulerMachine()
    output = _one_request(machine)
    while len(output.tokens(0)) < 3:
        machine.run_step()
    output.full = True
    machine.run_step()  # paused
    output.full = False
    machine.core.command(Resume(request_id=output.spec.request_id), machine.now)
    for _ in range(20):  # a bounded number of steps: a restore gone wrong fails here
        if len(output.tokens(0)) >= 6 or output.closed:
            break
        machine.run_step()
    assert not _failures(output)
    assert tuple(output.tokens(0)[:6]) == expected_tokens(output.spec.prompt_ids, 6)


def test_a_batch_lines_up_scores_and_picks_with_its_rows() -> None:
    # Rows without scores get None beside rows with; one block without the
    # engine's picks leaves the whole batch to the sampler.
    rows = [object() for _ in range(3)]
    score = TokenLogprob(logprob=-1.0)
    block = np.zeros((1, 4), dtype=np.float32)
    for first, second, expected in (
        (None, [score, score], [None, score, score]),
        ([score], None, [score, None, None]),
    ):
        batch = Batch()
        batch.add(rows[:1], block, np.array([1]), first)  # type: ignore[list-item]
        batch.add(rows[1:], np.ones((2, 4), dtype=np.float32), np.array([2, 3]), second)  # type: ignore[list-item]
        assert batch.scores == expected
        assert batch.greedy == [1, 2, 3]
        assert batch.logits().shape == (3, 4)
    batch = Batch()
    batch.add(rows[:1], block, np.array([1]), None)  # type: ignore[list-item]
    assert batch.scores is None
    batch.add(rows[1:2], block, None, None)  # type: ignore[list-item]
    assert batch.greedy is None


def test_a_failed_prefill_fails_only_its_request() -> None:
    machine = SchedulerMachine()
    bad, good = _submit(machine, "bad", prompt_ids=(4,)), _submit(machine, "good")
    planned = machine.core.plan({}, machine.now)
    assert planned is not None
    assert [w.request_id for w in planned.plan.prefills] == ["bad", "good"]
    outcome = execute(machine.engine, planned.plan)  # type: ignore[arg-type]
    outcome.prefills[0] = PrefillOutcome(error="out of memory")
    batch = machine.core.absorb(planned.plan, outcome)
    machine.carry()
    assert [(f.message, f.cause) for f in _failures(bad)] == [
        ("out of memory", FailureCause.ENGINE)
    ]
    assert [c.request.spec.request_id for c in batch.choices] == ["good"]
    assert not _failures(good)


def test_a_failed_decode_fails_every_decoding_request() -> None:
    machine = SchedulerMachine()
    first, second = _submit(machine, "a", prompt_ids=(4,)), _submit(machine, "b")
    _started(machine, first, second)
    planned = machine.core.plan({}, machine.now)
    assert planned is not None
    outcome = execute(machine.engine, planned.plan)  # type: ignore[arg-type]
    outcome.decode, outcome.decode_error = None, "the engine crashed"
    assert machine.core.absorb(planned.plan, outcome).choices == []
    machine.carry()
    for output in (first, second):
        assert [f.message for f in _failures(output)] == ["the engine crashed"]


def test_results_of_rows_that_left_during_the_step_are_dropped() -> None:
    machine = SchedulerMachine()
    names = ("a", "gone", "c")
    outputs = [_submit(machine, name, prompt_ids=(4 + i,)) for i, name in enumerate(names)]
    _started(machine, *outputs)
    planned = machine.core.plan({}, machine.now)
    assert planned is not None
    outcome = execute(machine.engine, planned.plan)  # type: ignore[arg-type]
    assert outcome.decode is not None
    assert outcome.decode_greedy is not None
    outcome.decode_logprobs = [TokenLogprob(logprob=-float(i)) for i in range(3)]
    machine.core.command(Cancel(request_id="gone"), machine.now)  # while the step ran
    batch = machine.core.absorb(planned.plan, outcome)
    kept = [0, 2]  # the rows of "a" and "c"
    assert [c.request.spec.request_id for c in batch.choices] == ["a", "c"]
    assert batch.greedy == [int(outcome.decode_greedy[i]) for i in kept]
    assert np.array_equal(batch.logits(), np.asarray(outcome.decode.logits)[kept])
    assert batch.scores == [outcome.decode_logprobs[i] for i in kept]


def test_the_prefix_cache_is_on_with_any_budget_and_kv_size() -> None:
    info = SequenceEngine().info
    for budget, per_token, on in ((1, 1, True), (0, 1, False), (64, 0, False)):
        config = SchedulerConfig(eos_ids=frozenset({EOS}), prefix_cache_bytes=budget)
        engine = replace(info, kv_bytes_per_token=per_token)
        core = SchedulerCore(config, engine, guided=False)
        assert (core.prefix_stats is not None) == on, (budget, per_token)


def test_a_constrained_start_goes_to_the_sampler_without_guides() -> None:
    machine = SchedulerMachine()  # guided=False: the engine cannot mask a grammar
    _submit(machine, "c", constraint=Constraint(kind=ConstraintKind.JSON_OBJECT))
    planned = machine.core.plan({}, machine.now)
    assert planned is not None
    assert not planned.plan.greedy


def test_sampled_results_of_rows_that_left_during_the_step_are_dropped() -> None:
    machine = SchedulerMachine()
    sampled = SamplingParams(temperature=1.0)
    outputs = [
        _submit(machine, n, prompt_ids=(4 + i,), sampling=sampled) for i, n in enumerate("ab")
    ]
    _started(machine, *outputs)
    planned = machine.core.plan({}, machine.now)
    assert planned is not None
    outcome = execute(machine.engine, planned.plan)  # type: ignore[arg-type]
    assert outcome.decode_greedy is None
    machine.core.command(Cancel(request_id="a"), machine.now)
    batch = machine.core.absorb(planned.plan, outcome)
    assert [c.request.spec.request_id for c in batch.choices] == ["b"]
    assert batch.greedy is None
    assert batch.scores is None


def test_drawn_first_tokens_keep_the_logprobs_the_engine_reduced() -> None:
    machine = _guided_machine()
    sampled, logprobs = SamplingParams(temperature=1.0), LogprobParams(top=1)
    _submit(machine, "s", n=2, sampling=sampled, logprobs=logprobs)
    planned = machine.core.plan({}, machine.now)
    assert planned is not None
    draws = [draw._replace(top=1) for draw in _draws(0.1, 0.9)]
    plan = with_draws(planned, draws)
    outcome = execute(machine.engine, plan)  # type: ignore[arg-type]
    first = outcome.prefills[0].first_logprobs
    assert first is not None
    batch = machine.core.absorb(plan, outcome)
    assert batch.scores == first
    assert all(score is not None for score in batch.scores)


@pytest.mark.parametrize("restoring", [False, True], ids=["paused", "being-restored"])
def test_a_choice_ended_while_its_row_is_parked_never_comes_back(restoring: bool) -> None:
    """A stop string ends a choice whose reader lagged, so that its row was
    freed (paused) or is being prefilled again (restoring): the choice stays
    ended, and only the other choice decodes on (found by the state machine:
    the ended choice came back and decoded past its end)."""
    machine = SchedulerMachine()
    machine.submit(n=2, shared=False, own=[1], max_tokens=7, slow=True)
    output = machine.outputs["r0"]
    while not output.tokens(0):
        machine.step()
    machine.run_step()  # the lagging reader's rows are freed: both choices paused
    assert machine.core.counters().paused_requests == 1
    planned = None
    if restoring:  # the choices' prefills are under way when choice 0 ends
        output.full = False
        machine.core.command(Resume(request_id="r0"), machine.now)
        planned = machine.core.plan({}, machine.now)
        assert planned is not None
        assert len(planned.plan.prefills) == 2
        machine.owners.update((work.slot, work.request_id) for work in planned.plan.prefills)
        machine.core.started()
        outcome = execute(machine.engine, planned.plan)  # type: ignore[arg-type]
    ended = len(output.tokens(0))
    output.ended.add(0)
    machine.core.command(FinishChoice(request_id="r0", choice=0), machine.now)
    machine.carry()
    if planned is not None:
        assert not machine.core.absorb(planned.plan, outcome).choices
        machine.carry()
    machine.teardown()
    assert len(output.tokens(0)) == ended
    assert len(output.tokens(1)) == 7
