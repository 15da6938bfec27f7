"""Constrained decoding through the scheduler and the sampler, on the
random-weight default model, on both engines, in process and in a child
process (``--engine-process``): whatever the schema, regex or choice, and
whatever the sampling, every output matches it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluiceway.actors import run_ahead, scheduler_core
from sluiceway.actors.engine_work import StepPlan
from sluiceway.actors.scheduler import SchedulerHandle
from sluiceway.protocol.constraints import Constraint, ConstraintKind
from sluiceway.protocol.messages import (
    FinishCause,
    GenerationRequest,
    Limits,
    RequestOutput,
    StepOutput,
)
from tests.engines.conftest import ENGINES
from tests.engines.constrained_rig import (
    MAX_TOKENS,
    Outcome,
    Rig,
    generation,
    open_rig,
    with_pipeline,
)
from tests.fixtures.json_schemas import assert_valid, schemas


@pytest.fixture(scope="module", params=ENGINES)
def rig(request: pytest.FixtureRequest, default_model: Path) -> Iterator[Rig]:
    yield from open_rig(default_model, str(request.param), in_child=False)


@pytest.fixture(scope="module", params=ENGINES)
def child_rig(request: pytest.FixtureRequest, default_model: Path) -> Iterator[Rig]:
    yield from open_rig(default_model, str(request.param), in_child=True)


def validate(rig: Rig, outcome: Outcome, schema: dict[str, Any]) -> None:
    assert outcome.failure is None, outcome.failure
    assert outcome.finish in (FinishCause.EOS, FinishCause.GRAMMAR), rig.text(outcome)
    assert_valid(json.loads(rig.text(outcome)), schema)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    schema=schemas,
    seed=st.integers(0, 2**16),
    backend=st.sampled_from(["asyncio", "trio"]),
)
def test_every_output_validates_against_its_schema(
    rig: Rig, schema: dict[str, Any], seed: int, backend: str
) -> None:
    """Greedy, and two seeded sampled choices, batched with a free request."""
    constraint = Constraint(kind=ConstraintKind.JSON_SCHEMA, text=json.dumps(schema))
    results = rig.run(
        [
            generation(rig, "greedy", constraint, temperature=0.0),
            generation(rig, "sampled", constraint, n=2, temperature=1.0, top_p=0.95, seed=seed),
            generation(rig, "free", None, temperature=0.0, max_tokens=20),
        ],
        backend,
    )
    for outcome in [*results["greedy"], *results["sampled"]]:
        validate(rig, outcome, schema)
    assert results["free"][0].finish is not None


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pattern=st.sampled_from(
        [
            r"[0-9]{1,4}",
            r"(yes|no|maybe)!?",
            r"[a-f]{2}-[0-9]{3}",
            r"[a-z0-9_]{1,5}@[a-z]{1,5}\.(com|org)",
        ]
    ),
    options=st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=5, unique=True),
    seed=st.integers(0, 2**16),
)
def test_regex_and_choice_outputs_match(
    rig: Rig, pattern: str, options: list[str], seed: int
) -> None:
    """The regexes keep to syntax Python's ``re`` reads as llguidance (Rust's
    regex crate) does: their ``\\w`` differ, Rust's taking combining marks."""
    regex = Constraint(kind=ConstraintKind.REGEX, text=pattern)
    choice = Constraint.choice(options)
    results = rig.run(
        [
            generation(rig, "regex-greedy", regex, temperature=0.0),
            generation(rig, "regex", regex, n=2, temperature=1.0, seed=seed),
            generation(rig, "choice-greedy", choice, temperature=0.0),
            generation(rig, "choice", choice, n=2, temperature=1.0, seed=seed),
        ]
    )
    for name in ("regex-greedy", "regex"):
        for outcome in results[name]:
            assert outcome.finish in (FinishCause.EOS, FinishCause.GRAMMAR)
            assert re.fullmatch(pattern, rig.text(outcome)), rig.text(outcome)
    for name in ("choice-greedy", "choice"):
        for outcome in results[name]:
            assert outcome.finish in (FinishCause.EOS, FinishCause.GRAMMAR)
            assert rig.text(outcome) in options


#: A schema whose documents are short whatever the model does.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 0, "maximum": 9},
        "windy": {"type": "boolean"},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


def test_free_rows_batched_with_constrained_ones_decode_as_alone(rig: Rig) -> None:
    free = [generation(rig, f"free{i}", None, temperature=0.0, max_tokens=16) for i in range(2)]
    alone = rig.run(free)
    constraint = Constraint(kind=ConstraintKind.JSON_SCHEMA, text=json.dumps(WEATHER))
    batched = rig.run([*free, generation(rig, "json", constraint, n=2, temperature=0.7, seed=3)])
    for request in free:
        assert batched[request.request_id][0].tokens == alone[request.request_id][0].tokens
    for outcome in batched["json"]:
        validate(rig, outcome, WEATHER)


def test_seeded_constrained_choices_reproduce(rig: Rig) -> None:
    constraint = Constraint(kind=ConstraintKind.REGEX, text=r"[a-z ]{5,30}\.")
    request = generation(rig, "seeded", constraint, n=2, temperature=1.0, seed=77)
    first = rig.run([request])["seeded"]
    again = rig.run([request, generation(rig, "other", None, temperature=0.9, max_tokens=9)])
    assert [o.tokens for o in again["seeded"]] == [o.tokens for o in first]
    assert first[0].tokens != first[1].tokens


def test_a_complete_grammar_ends_the_row_even_with_ignore_eos(rig: Rig) -> None:
    choice = Constraint.choice(["sunny", "rainy"])
    spec = generation(rig, "x", choice, temperature=0.0)
    spec = GenerationRequest(
        request_id="x",
        prompt_ids=spec.prompt_ids,
        sampling=spec.sampling,
        limits=Limits(max_tokens=50, ignore_eos=True, min_tokens=20),
        constraint=choice,
    )
    (outcome,) = rig.run([spec])["x"]
    assert rig.text(outcome) in ("sunny", "rainy")
    assert outcome.finish is FinishCause.GRAMMAR
    assert not set(outcome.tokens) & rig.tokenizer.eos_ids


def test_a_greedy_constrained_row_alone_is_masked_from_its_first_token(rig: Rig) -> None:
    """Alone, a greedy row would have its tokens picked by the engine (the
    greedy fast path, decoding ahead): a constrained one never does."""
    (free,) = rig.run([generation(rig, "free", None, temperature=0.0, max_tokens=4)])["free"]
    assert not re.fullmatch("[0-9]+", rig.text(free))  # else this test shows nothing
    regex = Constraint(kind=ConstraintKind.REGEX, text="[0-9]{4}")
    (outcome,) = rig.run([generation(rig, "digits", regex, temperature=0.0)])["digits"]
    assert re.fullmatch("[0-9]{4}", rig.text(outcome))
    assert outcome.finish is FinishCause.GRAMMAR


def test_max_tokens_cuts_a_constrained_row(rig: Rig) -> None:
    constraint = Constraint(kind=ConstraintKind.REGEX, text="[a-z]{20}")
    (outcome,) = rig.run([generation(rig, "x", constraint, temperature=0.0, max_tokens=3)])["x"]
    assert outcome.finish is FinishCause.MAX_TOKENS
    assert len(outcome.tokens) == 3
    assert re.fullmatch("[a-z]+", rig.text(outcome))


def test_a_constraint_that_does_not_compile_fails_only_its_request(rig: Rig) -> None:
    bad = Constraint(kind=ConstraintKind.JSON_SCHEMA, text='{"type": "string", "pattern": "(("}')
    free = generation(rig, "free", None, temperature=0.0, max_tokens=16)
    alone = rig.run([free])["free"][0].tokens
    results = rig.run([generation(rig, "bad", bad, n=2), free])
    assert all(o.failure and "unclosed group" in o.failure for o in results["bad"])
    assert results["free"][0].tokens == alone


def test_the_engine_in_a_child_process_decodes_constrained_rows(child_rig: Rig) -> None:
    schema = WEATHER
    constraint = Constraint(kind=ConstraintKind.JSON_SCHEMA, text=json.dumps(schema))
    regex = Constraint(kind=ConstraintKind.REGEX, text="[0-9]{2}:[0-9]{2}")
    results = child_rig.run(
        [
            generation(child_rig, "greedy", constraint, temperature=0.0),
            generation(child_rig, "sampled", constraint, n=2, temperature=1.0, seed=5),
            generation(child_rig, "regex", regex, temperature=0.0),
            generation(child_rig, "free", None, temperature=0.0, max_tokens=12),
        ],
        "trio",
    )
    for outcome in [*results["greedy"], *results["sampled"]]:
        validate(child_rig, outcome, schema)
    assert re.fullmatch("[0-9]{2}:[0-9]{2}", child_rig.text(results["regex"][0]))


@pytest.mark.anyio
async def test_a_choice_ended_early_leaves_the_others_constrained(rig: Rig) -> None:
    """The output actor ends a choice (a stop string) mid-document: the
    request's other choice walks on in its own grammar to a valid end."""
    constraint = Constraint(kind=ConstraintKind.JSON_SCHEMA, text=json.dumps(WEATHER))
    request = generation(rig, "two", constraint, n=2, temperature=1.0, seed=21)
    tokens: dict[int, list[int]] = {0: [], 1: []}
    finishes: dict[int, FinishCause | None] = {}

    async def body(handle: SchedulerHandle) -> None:
        send, receive = anyio.create_memory_object_stream[RequestOutput](MAX_TOKENS + 2)
        handle.submit(request, send)
        async with receive:
            async for message in receive:
                assert isinstance(message, StepOutput)
                for sample in message.samples:
                    tokens[sample.choice].append(sample.token_id)
                    finishes[sample.choice] = sample.finish
                if len(tokens[0]) == 2:
                    handle.finish_choice("two", 0)

    await with_pipeline(rig.model, body)
    assert len(tokens[0]) <= 3  # the step in flight may still bring one
    assert finishes[1] in (FinishCause.EOS, FinishCause.GRAMMAR)
    validate(rig, Outcome(tokens[1], finishes[1]), WEATHER)


def _greedy_guided_requests(rig: Rig) -> list[GenerationRequest]:
    """Greedy constrained rows (one whose ``min_tokens`` keeps EOS out where
    the grammar would allow it) beside free greedy ones."""
    weather = Constraint(kind=ConstraintKind.JSON_SCHEMA, text=json.dumps(WEATHER))
    letters = Constraint(kind=ConstraintKind.REGEX, text="[a-z]{1,30}")
    long = generation(rig, "letters", letters, temperature=0.0)
    return [
        generation(rig, "json", weather, n=2, temperature=0.0),
        GenerationRequest(
            request_id="letters",
            prompt_ids=long.prompt_ids,
            sampling=long.sampling,
            limits=Limits(max_tokens=40, min_tokens=12),
            constraint=letters,
        ),
        *(generation(rig, f"free{i}", None, temperature=0.0, max_tokens=24) for i in range(2)),
    ]


def _tokens(results: dict[str, list[Outcome]]) -> dict[str, list[list[int]]]:
    for outcomes in results.values():
        assert all(o.failure is None for o in outcomes), outcomes
    return {name: [o.tokens for o in outcomes] for name, outcomes in results.items()}


def _ahead_and_sampled(
    rig: Rig,
    requests: list[GenerationRequest],
    backend: str,
    monkeypatch: pytest.MonkeyPatch,
    predicate: str,
) -> tuple[dict[str, list[list[int]]], dict[str, list[list[int]]]]:
    """The tokens of ``requests`` run twice: as they are, where many steps
    with masked rows are decoded ahead; and with the scheduler's
    ``predicate`` switched off, where none is and the sampler masks them."""
    served_masked = 0
    serves = run_ahead._serves

    def counting(ahead: Any, plan: StepPlan) -> bool:
        nonlocal served_masked
        served = serves(ahead, plan)
        served_masked += served and bool(plan.masks)
        return served

    monkeypatch.setattr(run_ahead, "_serves", counting)
    ahead = _tokens(rig.run(requests, backend))
    assert served_masked > 10
    with monkeypatch.context() as sampled_only:
        sampled_only.setattr(scheduler_core, predicate, lambda row: False)
        served_masked = 0
        through_the_sampler = _tokens(rig.run(requests, backend))
        assert served_masked == 0
    return ahead, through_the_sampler


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_greedy_constrained_rows_decoded_ahead_pick_the_samplers_tokens(
    rig: Rig, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A greedy constrained row's token is the engine's argmax under the mask
    the plan carried, and the step after it is decoded ahead: bit for bit
    the tokens the sampler picks when every such step goes through it."""
    requests = _greedy_guided_requests(rig)
    ahead, through_the_sampler = _ahead_and_sampled(
        rig, requests, backend, monkeypatch, "_greedy_guided"
    )
    assert ahead == through_the_sampler
    assert not set(ahead["letters"][0]) & rig.tokenizer.eos_ids  # min_tokens held


def test_greedy_constrained_rows_in_a_child_process_pick_the_samplers_tokens(
    child_rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The masks cross to the engine's process with the plan."""
    requests = _greedy_guided_requests(child_rig)
    ahead = _tokens(child_rig.run(requests, "trio"))
    monkeypatch.setattr(scheduler_core, "_greedy_guided", lambda row: False)
    assert _tokens(child_rig.run(requests, "trio")) == ahead


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_free_greedy_row_before_min_tokens_is_decoded_ahead(
    rig: Rig, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A free greedy row held back from its stop token by ``min_tokens`` is
    an argmax under a mask of every other id: decoded ahead, and the same
    tokens as the sampler picks."""
    plain = rig.run([generation(rig, "plain", None, temperature=0.0, max_tokens=24)], backend)
    stop = plain["plain"][0].tokens[3]  # the model's own pick, so holding it back matters
    base = generation(rig, "held", None, temperature=0.0)
    held = GenerationRequest(
        request_id="held",
        prompt_ids=base.prompt_ids,
        n=2,
        sampling=base.sampling,
        limits=Limits(max_tokens=32, min_tokens=20, stop_token_ids=frozenset({stop})),
    )
    requests = [held, generation(rig, "free", None, temperature=0.0, max_tokens=24)]
    ahead, through_the_sampler = _ahead_and_sampled(
        rig, requests, backend, monkeypatch, "_greedy_suppressing"
    )
    assert ahead == through_the_sampler
    for choice in ahead["held"]:
        assert stop not in choice[:20]
