"""The sampler with constrained rows, on random logits over the default
model's vocabulary: whatever the row's parameters the token keeps the output
inside the grammar; the reasoning gate; logprobs stay the model's."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluiceway.actors import sampler as sampler_actor
from sluiceway.actors.engine_work import greedy_picks
from sluiceway.actors.guide import GuideState, RowGuide
from sluiceway.actors.sampler import SamplerConfig, StepSampler, sample_step
from sluiceway.actors.sampling import Sampler, _suppress
from sluiceway.engines.base import DecodeResult
from sluiceway.engines.grammar import GrammarEngine, allowed_ids
from sluiceway.engines.tokenizer import ModelTokenizer
from sluiceway.protocol.constraints import Constraint, ConstraintKind, ReasoningGate
from sluiceway.protocol.messages import LogitsStep, LogprobParams, Row, SampledStep, SamplingParams

VOCAB = 1920
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no", 3]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["answer"],
    "additionalProperties": False,
}
CONSTRAINT = Constraint(kind=ConstraintKind.JSON_SCHEMA, text=json.dumps(SCHEMA))


@dataclass(frozen=True)
class Kit:
    tokenizer: ModelTokenizer
    grammars: GrammarEngine
    eos: int
    think: int
    end_think: int


@pytest.fixture(scope="module")
def kit(default_model: Path) -> Kit:
    tokenizer = ModelTokenizer(default_model, VOCAB)
    think, end_think = tokenizer.single_token("<think>"), tokenizer.single_token("</think>")
    assert think is not None
    assert end_think is not None
    grammars = GrammarEngine(tokenizer.hf, VOCAB, tokenizer.eos_ids)
    return Kit(tokenizer, grammars, min(tokenizer.eos_ids), think, end_think)


def row(
    name: str = "r",
    *,
    first: bool,
    constraint: Constraint | None = CONSTRAINT,
    logprobs: LogprobParams | None = None,
    suppress: tuple[int, ...] = (),
    **params: object,
) -> Row:
    return Row(
        request_id=name,
        choice=0,
        sampling=SamplingParams(**params),  # type: ignore[arg-type]
        logprobs=logprobs or LogprobParams(),
        prompt_ids=(1, 2, 3),
        first=first,
        suppress=suppress,
        constraint=constraint,
    )


def decode_row(
    sampler: Sampler,
    eos: int,
    params: dict[str, object],
    seed: int,
    *,
    steps: int = 200,
    **kw: object,
) -> tuple[list[int], str]:
    """Sample one row until its grammar completes or it picks kit.eos; return the
    tokens and how it ended."""
    rng = np.random.default_rng(seed)
    tokens: list[int] = []
    for step in range(steps):
        logits = rng.normal(0, 3, size=(1, VOCAB)).astype(np.float32)
        result = sampler.sample(logits, [row(first=step == 0, **params, **kw)])  # type: ignore[arg-type]
        token = int(result.token_ids[0])
        tokens.append(token)
        report = result.constraints
        assert report is not None
        assert not report.failed, report.failed
        if 0 in report.complete:
            return tokens, "complete"
        if token == eos:
            return tokens, "eos"
    return tokens, "length"


sampling_params = st.fixed_dictionaries(
    {
        "temperature": st.sampled_from([0.0, 0.5, 1.0, 2.0]),
        "top_p": st.floats(0.1, 1.0),
        "top_k": st.integers(0, 50),
        "min_p": st.sampled_from([0.0, 0.1]),
        "seed": st.integers(0, 2**16),
        "presence_penalty": st.sampled_from([0.0, 1.5]),
        "repetition_penalty": st.sampled_from([1.0, 1.3]),
        # A bias large enough to win any unmasked draw, on ids the grammar
        # mostly forbids.
        "logit_bias": st.lists(
            st.tuples(st.integers(0, VOCAB - 1), st.just(100.0)),
            max_size=3,
            unique_by=lambda t: t[0],
        ).map(tuple),
    }
)


@settings(max_examples=40, deadline=None)
@given(params=sampling_params, seed=st.integers(0, 2**16))
def test_whatever_the_parameters_the_output_validates(
    kit: Kit, params: dict[str, object], seed: int
) -> None:
    tokens, ended = decode_row(Sampler(kit.grammars), kit.eos, params, seed)
    assert ended in ("complete", "eos")
    text = kit.tokenizer.decode([t for t in tokens if t != kit.eos])
    jsonschema.validate(json.loads(text), SCHEMA)


def test_a_greedy_row_takes_the_argmax_of_the_masked_logits(kit: Kit) -> None:
    sampler = Sampler(kit.grammars)
    matcher = kit.grammars.compile(CONSTRAINT).matcher()
    masks = kit.grammars.new_masks(1)
    rng = np.random.default_rng(5)
    for step in range(8):
        logits = rng.normal(size=(1, VOCAB)).astype(np.float32)
        kit.grammars.fill_masks([matcher], masks)
        allowed = allowed_ids(masks[0], VOCAB)
        expected = int(np.where(allowed, logits[0], -np.inf).argmax())
        got = int(sampler.sample(logits, [row(first=step == 0, temperature=0.0)]).token_ids[0])
        assert got == expected
        assert got != int(logits[0].argmax()) or allowed[got]
        assert matcher.consume_token(got)


def test_masks_computed_ahead_change_nothing(kit: Kit) -> None:
    def run(ahead: bool) -> list[int]:
        sampler = Sampler(kit.grammars)
        rng = np.random.default_rng(11)
        tokens = []
        for step in range(12):
            logits = rng.normal(size=(2, VOCAB)).astype(np.float32)
            rows = [
                row("a", first=step == 0, temperature=1.0, seed=3),
                row("b", first=step == 0, temperature=0.0),
            ]
            tokens += sampler.sample(logits, rows).token_ids.tolist()
            if ahead:
                assert sampler.masks_due()
                sampler.prepare_masks()
                assert not sampler.masks_due()
        return tokens

    assert run(ahead=True) == run(ahead=False)


def test_only_constrained_rows_are_masked(kit: Kit) -> None:
    logits = np.random.default_rng(2).normal(size=(2, VOCAB)).astype(np.float32)
    sampler = Sampler(kit.grammars)
    result = sampler.sample(
        logits,
        [
            row("free", first=True, constraint=None, temperature=0.0),
            row("json", first=True, temperature=0.0),
        ],
        keep_processed=True,
    )
    assert result.token_ids[0] == logits[0].argmax()
    assert result.processed is not None
    np.testing.assert_array_equal(result.processed[0], logits[0])
    assert np.isinf(result.processed[1]).sum() > VOCAB // 2
    assert result.constraints is not None
    assert result.constraints.complete == frozenset()


def test_logprobs_are_the_models_by_default_and_the_masked_ones_when_processed(kit: Kit) -> None:
    logits = np.random.default_rng(4).normal(size=(1, VOCAB)).astype(np.float32)
    step = LogitsStep(
        step=1,
        rows=(row(first=True, temperature=0.0, logprobs=LogprobParams(top=3)),),
        logits=logits,
    )
    before = logits.copy()
    raw = sample_step(Sampler(kit.grammars), step, SamplerConfig(grammars=kit.grammars))
    # The model's logits, unmasked, go to the reducer.
    assert raw.logits is logits
    np.testing.assert_array_equal(logits, before)
    assert raw.processed is None
    processed = sample_step(
        Sampler(kit.grammars), step, SamplerConfig(grammars=kit.grammars, processed_logprobs=True)
    )
    assert processed.logits is None
    assert processed.processed is not None
    assert processed.processed[0, raw.token_ids[0]] == logits[0, raw.token_ids[0]]
    assert np.isinf(processed.processed[0]).sum() > VOCAB // 2


def test_a_constraint_that_does_not_compile_fails_its_row_only(kit: Kit) -> None:
    bad = Constraint(kind=ConstraintKind.REGEX, text="((")
    logits = np.zeros((2, VOCAB), dtype=np.float32)
    rows = [row("bad", first=True, constraint=bad), row("good", first=True)]
    result = Sampler(kit.grammars).sample(logits, rows)
    assert result.constraints is not None
    ((index, message),) = result.constraints.failed
    assert index == 0
    assert "unclosed group" in message
    no_engine = Sampler(None).sample(logits[:1], [row("x", first=True)])
    assert no_engine.constraints is not None
    assert "no grammar engine" in no_engine.constraints.failed[0][1]


def test_a_choice_completes_without_an_eos_token(kit: Kit) -> None:
    choice = Constraint.choice(["yes", "no"])
    tokens, ended = decode_row(
        Sampler(kit.grammars), kit.eos, {"temperature": 1.0, "seed": 1}, 0, constraint=choice
    )
    assert ended == "complete"
    assert kit.tokenizer.decode(tokens) in ("yes", "no")


def test_min_tokens_give_way_to_a_grammar_that_allows_only_eos(kit: Kit) -> None:
    eos = max(kit.grammars.eos_ids)  # not id 0, which an all -inf row's argmax would give
    x = np.full(VOCAB, -np.inf, dtype=np.float32)
    x[eos] = 1.0
    _suppress(x, (eos, 5), guided=True)
    assert x[eos] == 1.0
    assert x.argmax() == eos
    x[7] = 0.5  # something else allowed: the suppression holds
    _suppress(x, (eos,), guided=True)
    assert x.argmax() == 7
    free = np.zeros(VOCAB, dtype=np.float32)
    _suppress(free, (kit.eos,), guided=False)
    assert free[kit.eos] == -np.inf


def test_reasoning_stays_free_and_never_ends_the_row(kit: Kit) -> None:
    """Inside reasoning any token but kit.eos may come, constraint or not; after
    the closing token the grammar holds."""
    gate = ReasoningGate(end_id=kit.end_think, inside=True)
    constraint = Constraint.choice(["yes", "no"], reasoning=gate)
    sampler = Sampler(kit.grammars)
    favourite = 1234  # outside the grammar
    tokens = []
    for step in range(6):
        logits = np.zeros((1, VOCAB), dtype=np.float32)
        logits[0, kit.eos] = 50.0
        logits[0, favourite] = 40.0
        if step == 3:
            logits[0, kit.end_think] = 60.0
        result = sampler.sample(
            logits, [row(first=step == 0, constraint=constraint, temperature=0.0)]
        )
        tokens.append(int(result.token_ids[0]))
        if result.constraints is not None and result.constraints.complete:
            break
    assert tokens[:4] == [favourite, favourite, favourite, kit.end_think]
    assert kit.tokenizer.decode(tokens[4:]) in ("yes", "no")


def test_the_first_token_may_open_reasoning(kit: Kit) -> None:
    gate = ReasoningGate(end_id=kit.end_think, start_id=kit.think)
    constraint = Constraint.choice(["yes", "no"], reasoning=gate)

    def first_tokens(prefer: int) -> list[int]:
        sampler = Sampler(kit.grammars)
        tokens = []
        for step in range(2):
            logits = np.zeros((1, VOCAB), dtype=np.float32)
            logits[0, prefer] = 50.0
            result = sampler.sample(
                logits, [row(first=step == 0, constraint=constraint, temperature=0.0)]
            )
            tokens.append(int(result.token_ids[0]))
        return tokens

    assert first_tokens(kit.think)[0] == kit.think  # opened: free from then on
    assert first_tokens(kit.think)[1] == kit.think
    assert first_tokens(1234)[0] != 1234  # not opened: the grammar holds at once
    guide = RowGuide.start(kit.grammars.compile(constraint).matcher(), gate, kit.grammars.eos_ids)
    assert guide.state is GuideState.OPENING


@pytest.mark.anyio
async def test_the_actor_computes_masks_ahead_and_matches_direct_sampling(
    kit: Kit, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the first step, every step finds its masks computed already:
    the actor filled them while the step was away (at the engine)."""
    due_at_sampling: list[bool] = []
    original = Sampler.sample

    def recording(self: Sampler, *args: Any, **kwargs: Any) -> Any:
        due_at_sampling.append(self.masks_due())
        return original(self, *args, **kwargs)

    rng = np.random.default_rng(8)
    steps = [rng.normal(size=(2, VOCAB)).astype(np.float32) for _ in range(10)]

    def rows(step: int) -> tuple[Row, ...]:
        return (
            row("a", first=step == 0, temperature=0.8, seed=1),
            row("b", first=step == 0, constraint=None, temperature=0.8, seed=2),
        )

    direct = Sampler(kit.grammars)
    expected = [direct.sample(logits, rows(i)).token_ids.tolist() for i, logits in enumerate(steps)]
    to_send, to_receive = anyio.create_memory_object_stream[LogitsStep](1)
    out_send, out_receive = anyio.create_memory_object_stream[SampledStep](1)
    got = []
    monkeypatch.setattr(Sampler, "sample", recording)
    async with anyio.create_task_group() as group:
        group.start_soon(
            sampler_actor.run,
            to_receive,
            out_send,
            StepSampler(SamplerConfig(grammars=kit.grammars), reduce=False),
        )
        async with to_send, out_receive:
            for i, logits in enumerate(steps):
                await to_send.send(LogitsStep(step=i, rows=rows(i), logits=logits))
                got.append(list((await out_receive.receive()).token_ids))
    assert got == expected
    assert due_at_sampling == [False] * len(steps)


@pytest.mark.anyio
async def test_a_small_constrained_step_is_sampled_on_the_loop_after_its_first(
    kit: Kit, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its mask is ready (computed ahead in a thread), so applying it is a
    few short NumPy calls; the first step, whose mask llguidance computes
    while sampling, is sampled in a thread."""
    threaded: list[str] = []
    run_sync = anyio.to_thread.run_sync

    async def recording(function: Any, *args: Any, **kwargs: Any) -> Any:
        threaded.append(getattr(function, "__name__", ""))
        return await run_sync(function, *args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", recording)
    rng = np.random.default_rng(3)
    to_send, to_receive = anyio.create_memory_object_stream[LogitsStep](1)
    out_send, out_receive = anyio.create_memory_object_stream[SampledStep](1)
    core = StepSampler(SamplerConfig(grammars=kit.grammars), reduce=False)
    async with anyio.create_task_group() as group:
        group.start_soon(sampler_actor.run, to_receive, out_send, core)
        async with to_send, out_receive:
            for i in range(4):
                logits = rng.normal(size=(1, VOCAB)).astype(np.float32)
                rows = (row("a", first=i == 0, temperature=0.0),)
                await to_send.send(LogitsStep(step=i, rows=rows, logits=logits))
                await out_receive.receive()
    assert threaded.count("sample_step") == 1
    assert threaded.count("prepare_masks") == 4


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), eos_weight=st.sampled_from([0.0, 6.0, 30.0]))
def test_the_engines_masked_argmax_picks_the_samplers_greedy_tokens(
    kit: Kit, seed: int, eos_weight: float
) -> None:
    """A greedy step whose guided rows' tokens the engine picks under the
    masks :meth:`Sampler.allowed` gives (reasoning, ``min_tokens``' suppressed
    EOS folded in) and :meth:`Sampler.take` consumes: the sampler's tokens."""
    gate = ReasoningGate(end_id=kit.end_think, inside=True)
    letters = Constraint(kind=ConstraintKind.REGEX, text="[a-z]{1,30}")

    def rows(step: int) -> list[Row]:
        eos = (kit.eos,) if step < 10 else ()
        return [
            row("json", first=step == 0, temperature=0.0, suppress=eos),
            row(
                "gate",
                first=step == 0,
                constraint=Constraint.choice(["ab", "cd"], reasoning=gate),
                temperature=0.0,
            ),
            row("letters", first=step == 0, constraint=letters, suppress=eos, temperature=0.0),
        ]

    def run(engine_picks: bool) -> list[list[int]]:
        sampler, rng = Sampler(kit.grammars), np.random.default_rng(seed)
        tokens: list[list[int]] = []
        live, done = rows(0), set()
        for step in range(16):
            logits = rng.normal(0, 3, size=(len(live), VOCAB)).astype(np.float32)
            logits[:, kit.eos] += eos_weight
            logits[:, kit.end_think] += 30.0 if step == 4 else -30.0
            if engine_picks and step > 0:
                sampler.prepare_masks()
                masks = sampler.allowed(live)
                assert masks is not None
                decoded = DecodeResult(tuple(range(len(live))), logits)
                picks = greedy_picks(decoded, dict(enumerate(masks))).tolist()
                report = sampler.take(live, picks)
            else:
                result = sampler.sample(logits, live)
                picks, report = result.token_ids.tolist(), result.constraints
            assert report is not None
            assert not report.failed
            tokens.append(picks)
            done |= {live[i].key for i in report.complete} | {
                r.key for r, t in zip(live, picks, strict=True) if t == kit.eos
            }
            live = [r for r in rows(step + 1) if r.key not in done]
            if not live:
                break
        return tokens

    assert run(engine_picks=True) == run(engine_picks=False)
