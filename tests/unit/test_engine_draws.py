"""Rows the engine draws itself (``StepPlan.draws``) get the sampler's tokens.

A step whose rows are all unadjusted (sampled or with logprobs, but no
grammar, bias, penalty or suppressed id) is picked where its logits are, by
one random number per sampled row that the scheduler takes from the
sampler's generator for the row. Everything a client sees must be as if the
sampler had picked: the same tokens for a seed, the same logprobs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import anyio
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluiceway.actors import sampling
from sluiceway.actors.engine_work import StepOutcome, StepPlan, execute
from sluiceway.actors.logprobs import reduce_rows
from sluiceway.actors.sampler import SamplerConfig, StepSampler
from sluiceway.actors.sampling import Draw, Sampler, draw_rows
from sluiceway.actors.scheduler import SchedulerConfig, SchedulerHandle
from sluiceway.engines.base import Logits
from sluiceway.protocol.messages import LogprobParams, Row, SamplingParams, StepOutput
from tests.unit.test_scheduler import EOS, VOCAB, FakeEngine, collect, request, run_with, submit

_PARAMS = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]),
    top_p=st.sampled_from([1.0, 0.9, 0.3]),
    top_k=st.sampled_from([0, 1, 5]),
    min_p=st.sampled_from([0.0, 0.1]),
    seed=st.integers(0, 3),
)
_LOGPROBS = st.sampled_from(
    [LogprobParams(), LogprobParams(top=0), LogprobParams(top=5), LogprobParams(token_ids=(3, 7))]
)


def _row(index: int, params: SamplingParams, logprobs: LogprobParams, *, first: bool) -> Row:
    return Row(
        request_id=f"r{index}",
        choice=0,
        sampling=params,
        logprobs=logprobs,
        prompt_ids=(1, 2),
        first=first,
    )


@settings(max_examples=60, deadline=None)
@given(
    specs=st.lists(st.tuples(_PARAMS, _LOGPROBS), min_size=1, max_size=5),
    processed=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_drawn_rows_get_the_samplers_tokens_and_logprobs(
    specs: list[tuple[SamplingParams, LogprobParams]], processed: bool, seed: int
) -> None:
    """Over several steps, a sampler picking every row and a sampler only
    lending its draws to ``draw_rows`` agree on every token and logprob."""
    picking, lending = Sampler(), Sampler()
    noise = np.random.default_rng(seed)
    for step in range(4):
        rows = [_row(i, p, lp, first=step == 0) for i, (p, lp) in enumerate(specs)]
        logits = (noise.standard_normal((len(rows), 40)) * 3).astype(np.float32)
        keep = processed and any(r.logprobs.per_token for r in rows)
        sampled = picking.sample(logits, rows, keep_processed=keep)
        source = sampled.processed if keep else logits
        expected = reduce_rows(source, sampled.token_ids.tolist(), [r.logprobs for r in rows])

        drawn = [i for i, r in enumerate(rows) if not r.plain]
        uniforms = lending.uniforms({r.key for r in rows}, [rows[i] for i in drawn])
        draws = [
            (
                i,
                Draw.of(
                    rows[i].sampling,
                    u,
                    rows[i].logprobs if rows[i].logprobs.per_token else None,
                    processed,
                ),
            )
            for i, u in zip(drawn, uniforms, strict=True)
        ]
        picks = logits.argmax(axis=-1)
        reduced = draw_rows(logits.copy(), picks, draws)
        assert picks.tolist() == sampled.token_ids.tolist()
        if any(r.logprobs.per_token for r in rows):
            assert reduced == expected
        else:
            assert reduced is None


_FILTERS = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.3, 1.0, 1.7, 25.0]),
    top_p=st.sampled_from([1.0, 1.0, 0.95, 0.5, 0.0]),
    top_k=st.sampled_from([0, 0, 1, 5, 1921]),
    min_p=st.sampled_from([0.0, 0.0, 0.05]),
)


@settings(max_examples=120, deadline=None)
@given(
    vocab=st.sampled_from([1, 2, 17, 40, 1921]),
    params=st.lists(_FILTERS, min_size=1, max_size=18),
    uniforms=st.data(),
    masked=st.sampled_from([0.0, 0.5, 1.0]),
    tied=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_rows_drawn_together_pick_what_each_alone_picks(
    vocab: int,
    params: list[SamplingParams],
    uniforms: st.DataObject,
    masked: float,
    tied: bool,
    seed: int,
) -> None:
    """``draw_together`` takes a step's sampled rows in one go, each with its
    own filters: the same id as :func:`sampling.draw` row by row, for any
    vocabulary width (NumPy's vector loops and their tails), draws at the
    ends of [0, 1), logits with many equal values (``tied``: where ``top_k``
    and ``top_p`` cut among ties), and rows that constraints or a model left
    at -inf (a whole row: ``masked`` 1.0)."""
    noise = np.random.default_rng(seed)
    logits = (noise.standard_normal((len(params), vocab)) * 4).astype(np.float32)
    if tied:
        logits = np.round(logits)
    logits[noise.random(logits.shape) < masked] = -np.inf
    draws = [
        Draw.of(
            p,
            uniforms.draw(
                st.sampled_from([0.0, 0.5, 1 - 2**-53]) | st.floats(0, 1, exclude_max=True)
            ),
        )
        for p in params
    ]
    rows = list(range(len(draws)))
    before = logits.copy()
    with np.errstate(invalid="ignore"):  # a row all -inf
        together = sampling.draw_together(logits, rows, draws)
        alone = [
            sampling.draw(logits[i].copy(), d, d.uniform, keep=False) for i, d in enumerate(draws)
        ]
    assert together == alone
    assert np.array_equal(logits, before)  # the step's logits are not touched


@pytest.mark.parametrize("vocab", [40, 20_000, sampling.GROUP_LOGITS])
def test_draw_rows_groups_what_fits_and_draws_the_rest_alone(vocab: int) -> None:
    """Sampled rows go in groups of at most ``GROUP_LOGITS`` logits (none
    when two rows do not fit), with or without filters: each row's pick is
    :func:`sampling.draw`'s."""
    noise = np.random.default_rng(vocab)
    logits = (noise.standard_normal((8, vocab)) * 4).astype(np.float32)
    params = [SamplingParams(temperature=1.3)] * 7 + [SamplingParams(temperature=0.8, top_p=0.5)]
    draws = [(i, Draw.of(p, float(noise.random()))) for i, p in enumerate(params)]
    picks = logits.argmax(axis=-1)
    assert draw_rows(logits, picks, draws) is None
    alone = [sampling.draw(logits[i].copy(), d, d.uniform, keep=False) for i, d in draws]
    assert picks.tolist() == alone


@settings(max_examples=60, deadline=None)
@given(
    params=st.lists(
        st.builds(
            SamplingParams,
            temperature=st.sampled_from([1.0, 1.0, 0.7]),
            top_p=st.sampled_from([1.0, 1.0, 0.5]),
            top_k=st.sampled_from([0, 0, 3]),
        ),
        min_size=1,
        max_size=9,
    ),
    vocab=st.sampled_from([3, 40, 1921]),
    masked=st.sampled_from([0.0, 0.5, 1.0]),
    seed=st.integers(0, 1000),
)
def test_logprobs_of_drawn_rows_reuse_the_draws_normaliser_exactly(
    params: list[SamplingParams], vocab: int, masked: float, seed: int
) -> None:
    """Rows at temperature 1 whose draw already exponentiated their logits
    (and no filter zeroed some of them) hand that sum to the logprobs: the
    entries are bit for bit what :func:`reduce_rows` makes from the logits,
    with filtered rows and rows at another temperature beside them, and
    rows that are partly or wholly -inf."""
    noise = np.random.default_rng(seed)
    logits = (noise.standard_normal((len(params), vocab)) * 4).astype(np.float32)
    logits[noise.random(logits.shape) < masked * 0.9] = -np.inf
    if masked == 1.0:
        logits[0] = -np.inf
    asked = LogprobParams(top=5, token_ids=(0, vocab - 1))
    draws = [(i, Draw.of(p, float(noise.random()), asked)) for i, p in enumerate(params)]
    picks = logits.argmax(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):  # a row all -inf
        reduced = draw_rows(logits, picks, draws)
        expected = reduce_rows(logits, picks.tolist(), [asked] * len(draws))
    assert reduced == expected


def test_a_greedy_row_with_logprobs_is_drawn_without_a_draw() -> None:
    logits = np.array([[0.0, 2.0, 1.0]], dtype=np.float32)
    picks = logits.argmax(axis=-1)
    greedy = Draw.of(SamplingParams(temperature=0.0), 0.0, LogprobParams(top=2))
    scores = draw_rows(logits, picks, [(0, greedy)])
    assert picks.tolist() == [1]
    assert scores is not None
    entry = scores[0]
    assert entry is not None
    assert [t for t, _ in entry.top] == [1, 2]


def test_execute_draws_the_planned_rows_and_leaves_the_others_their_argmax() -> None:
    class Flat(FakeEngine):
        def _logits(self, tokens: Any) -> Logits:
            return np.zeros((len(tokens), VOCAB), dtype=np.float32)

    engine = Flat()
    engine.running = [0, 1]
    uniform = 0.99  # the last id of a flat row
    plan = StepPlan(
        decode={0: 3, 1: 4},
        greedy=True,
        draws={1: Draw.of(SamplingParams(temperature=1.0), uniform, LogprobParams(top=1))},
    )
    outcome: StepOutcome = execute(engine, plan)
    assert outcome.decode_greedy is not None
    assert outcome.decode_greedy.tolist() == [0, VOCAB - 1]
    assert outcome.decode_logprobs is not None
    assert outcome.decode_logprobs[0] is None
    drawn = outcome.decode_logprobs[1]
    assert drawn is not None
    assert drawn.logprob == pytest.approx(-np.log(VOCAB))


class _Spread(FakeEngine):
    """Logits that leave a sampled row a real choice among many ids."""

    def _logits(self, tokens: Any) -> Logits:
        out = np.empty((len(tokens), VOCAB), dtype=np.float32)
        for row, token in enumerate(tokens):
            out[row] = np.random.default_rng(token).standard_normal(VOCAB)
            out[row, EOS] = -50.0
        return out


async def _seeded_run(
    *, penalised_companion: bool, counted: list[int]
) -> dict[tuple[str, int], list[Any]]:
    """Two seeded sampled requests with top-3 logprobs, the second with two
    choices (and maybe a third request, penalised, which makes every step go
    through the sampler); each choice's tokens and logprobs."""
    engine = _Spread()
    config = SchedulerConfig(eos_ids=frozenset({EOS}))
    names = ["a", "b"] + (["p"] if penalised_companion else [])
    results: dict[tuple[str, int], list[Any]] = {}

    async def body(handle: SchedulerHandle) -> None:
        streams = {}
        for name in names:
            params = SamplingParams(
                temperature=1.0, seed=ord(name), presence_penalty=0.5 if name == "p" else 0.0
            )
            spec = replace(
                request(name, [1, 2, 3], max_tokens=12, n=2 if name == "b" else 1),
                sampling=params,
                logprobs=LogprobParams(top=3),
            )
            streams[name] = submit(handle, spec)
        for name, stream in streams.items():
            messages = await collect(stream)
            for m in messages:
                if isinstance(m, StepOutput):
                    for s in m.samples:
                        results.setdefault((name, s.choice), []).append((s.token_id, s.logprob))

    sample = Sampler.sample

    def counting(self: Sampler, logits: Any, rows: Any, **kwargs: Any) -> Any:
        counted.append(len(rows))
        return sample(self, logits, rows, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sampling.Sampler, "sample", counting)
        await run_with(engine, config, body)
    return results


@pytest.mark.anyio
async def test_seeded_requests_read_the_same_whether_the_engine_or_the_sampler_picks() -> None:
    drawn_steps: list[int] = []
    alone = await _seeded_run(penalised_companion=False, counted=drawn_steps)
    sampler_steps: list[int] = []
    beside = await _seeded_run(penalised_companion=True, counted=sampler_steps)
    choices = [("a", 0), ("b", 0), ("b", 1)]
    for key in choices:
        assert alone[key] == beside[key]
        assert len(alone[key]) == 12
        assert all(logprob is not None and len(logprob.top) == 3 for _, logprob in alone[key])
    # Each choice its own stream, the two forks of one prompt included.
    assert alone[("b", 0)] != alone[("b", 1)]
    # Alone, the engine drew every token, the first ones included.
    assert drawn_steps == []
    assert sum(sampler_steps) >= 4 * 12


def test_the_step_sampler_lends_draws_only_with_the_logprobs_it_would_reduce() -> None:
    rows = [_row(0, SamplingParams(temperature=1.0, seed=1), LogprobParams(top=2), first=False)]
    reducing = StepSampler(SamplerConfig(processed_logprobs=True), reduce=True)
    bare = StepSampler(SamplerConfig(forward_logits=False), reduce=False)

    async def both() -> tuple[list[Draw], list[Draw]]:
        keys = {row.key for row in rows}
        return await reducing.draws(keys, rows), await bare.draws(keys, rows)

    with_logprobs, without = anyio.run(both)
    assert with_logprobs[0].logprobs == LogprobParams(top=2)
    assert with_logprobs[0].processed
    assert without[0].logprobs is None
    # A fresh generator seeded alike draws the same first number.
    assert with_logprobs[0].uniform == without[0].uniform


def test_a_processed_row_keeps_float32_beside_narrower_logits() -> None:
    """With ``--logprobs-mode processed`` a row's logprobs come from its
    sampled distribution, in float32, even where the step's logits are
    narrower: the rows that asked are gathered and promoted, not cast down."""
    noise = np.random.default_rng(3)
    logits = (noise.standard_normal((2, 40)) * 3).astype(np.float16)
    asked = LogprobParams(top=3)
    filtered = Draw.of(SamplingParams(temperature=1.3, top_p=0.95), 0.4, asked, processed=True)
    plain = Draw.of(SamplingParams(temperature=1.0), 0.6, asked)
    picks = logits.argmax(axis=-1)
    reduced = draw_rows(logits, picks, [(0, filtered), (1, plain)])
    x = np.array(logits[0], dtype=np.float32)
    first = sampling.draw(x, filtered, filtered.uniform, keep=True)
    with np.errstate(divide="ignore"):
        expected = reduce_rows(np.stack([x, logits[1]]), [first, int(picks[1])], [asked, asked])
    assert picks[0] == first
    assert reduced == expected


def test_a_plan_crosses_the_pipe_whole_with_its_draws_as_draws() -> None:
    """``StepPlan`` pickles its draws as plain tuples (cheaper to read in the
    engine's child); every field comes back, and each draw is a ``Draw``."""
    import pickle

    from sluiceway.actors.engine_work import PrefillWork
    from sluiceway.engines.base import DropKV

    draws = {
        3: Draw.of(SamplingParams(temperature=0.8, top_p=0.9, top_k=4, min_p=0.1), 0.25),
        5: Draw.of(
            SamplingParams(temperature=0.0), 0.0, LogprobParams(top=2, token_ids=(1,)), True
        ),
    }
    plan = StepPlan(
        cache_ops=(DropKV(entry=1),),
        frees=(2,),
        prefills=(
            PrefillWork(request_id="r", slot=0, tokens=(1, 2), final=True, draws=(draws[3],)),
        ),
        decode={3: 11, 5: 12},
        masks={5: np.array([1, 2], dtype=np.int32)},
        draws=draws,
    )
    received = pickle.loads(pickle.dumps(plan))
    assert received.draws == draws
    assert all(type(d) is Draw for d in received.draws.values())
    assert received.draws[5].logprobs == LogprobParams(top=2, token_ids=(1,))
    assert (received.cache_ops, received.frees, received.prefills) == (
        plan.cache_ops,
        plan.frees,
        plan.prefills,
    )
    assert (received.decode, received.greedy) == (plan.decode, plan.greedy)
    assert received.masks[5].tolist() == [1, 2]
