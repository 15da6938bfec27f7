"""The sampler: greedy, filters, penalties, and seeded reproducibility per row."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluiceway.actors import sampling
from sluiceway.actors.cdf import CDF_BLOCK, invert
from sluiceway.actors.sampling import Sampler
from sluiceway.protocol.messages import LogprobParams, Row, SamplingParams


def row(request_id: str = "r", choice: int = 0, *, first: bool = True, **params: object) -> Row:
    return Row(
        request_id=request_id,
        choice=choice,
        sampling=SamplingParams(**params),  # type: ignore[arg-type]
        logprobs=LogprobParams(),
        prompt_ids=(1, 2, 3),
        first=first,
    )


def logits_for(rows: int, vocab: int = 50, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(rows, vocab)).astype(np.float32)


def draw_sequence(params: dict[str, object], steps: int, *, companions: int = 0) -> list[int]:
    """Sample ``steps`` tokens for one row, batched with ``companions`` other rows."""
    sampler = Sampler()
    tokens = []
    for step in range(steps):
        logits = logits_for(1 + companions, seed=step)
        rows = [row("me", first=step == 0, **params)]
        rows += [
            row(f"other{i}", first=step == 0, temperature=1.0, seed=100 + i)
            for i in range(companions)
        ]
        order = list(range(len(rows)))
        if companions:
            order = order[1:] + order[:1]  # our row is last in the batch
        result = sampler.sample(logits[order], [rows[i] for i in order])
        tokens.append(int(result.token_ids[order.index(0)]))
    return tokens


def test_greedy_is_argmax() -> None:
    logits = logits_for(3)
    result = Sampler().sample(logits, [row(f"r{i}", temperature=0.0) for i in range(3)])
    assert result.token_ids.tolist() == logits.argmax(axis=1).tolist()


def test_seeded_rows_reproduce_and_ignore_their_batch() -> None:
    params: dict[str, object] = {"temperature": 1.0, "seed": 42, "top_p": 0.9}
    alone = draw_sequence(params, 20)
    assert draw_sequence(params, 20) == alone
    assert draw_sequence(params, 20, companions=3) == alone
    assert draw_sequence({**params, "seed": 43}, 20) != alone


@pytest.mark.parametrize("side", ["sampler", "engine"])
def test_a_running_choice_missing_from_a_step_keeps_its_stream(side: str) -> None:
    """Choice "b" draws its first token, sits out a step (its first token
    still in flight) while "a" goes on, then comes back: named in ``live``,
    it goes on with its stream where it was, as if it had been alone."""
    logits = logits_for(1, vocab=1000)
    params: dict[str, object] = {"temperature": 1.0, "seed": 3}

    def step(sampler: Sampler, rows: list[Row], live: set[tuple[str, int]]) -> list[int]:
        if side == "sampler":
            picked = sampler.sample(np.repeat(logits, len(rows), axis=0), rows, live=live)
            return [int(t) for t in picked.token_ids]
        draws = sampler.uniforms(live | {r.key for r in rows}, rows)
        return [
            sampling.draw(logits[0].copy(), r.sampling, u, keep=False)
            for r, u in zip(rows, draws, strict=True)
        ]

    alone = Sampler()
    expected = [step(alone, [row("b", first=i == 0, **params)], set())[0] for i in range(2)]
    together = Sampler()
    first = step(together, [row("a", **params), row("b", **params)], set())[1]
    step(together, [row("a", first=False, **params)], {("b", 0)})
    second = step(
        together, [row("a", first=False, **params), row("b", first=False, **params)], set()
    )[1]
    assert [first, second] == expected


def test_choices_of_one_seeded_request_differ() -> None:
    sampler = Sampler()
    logits = np.zeros((2, 1000), dtype=np.float32)
    rows = [row("r", 0, temperature=1.0, seed=1), row("r", 1, temperature=1.0, seed=1)]
    first, second = sampler.sample(logits, rows).token_ids.tolist()
    assert first != second


@pytest.mark.parametrize("params", [{"top_k": 1}, {"top_p": 0.0}, {"min_p": 1.0}])
def test_narrowest_filters_are_greedy(params: dict[str, object]) -> None:
    logits = logits_for(1, vocab=200, seed=3)
    result = Sampler().sample(logits, [row(temperature=1.5, seed=9, **params)])
    assert result.token_ids[0] == logits[0].argmax()


@settings(max_examples=30, deadline=None)
@given(
    top_k=st.integers(1, 20),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 0.5),
    seed=st.integers(0, 2**31),
)
def test_filters_only_allow_permitted_tokens(
    top_k: int, top_p: float, min_p: float, seed: int
) -> None:
    logits = logits_for(1, vocab=60, seed=seed % 1000)
    x = logits[0].astype(np.float64)
    allowed = set(np.argsort(-x, kind="stable")[:top_k].tolist())
    sampler = Sampler()
    for step in range(5):
        result = sampler.sample(
            logits,
            [
                row(
                    first=step == 0,
                    temperature=1.0,
                    top_k=top_k,
                    top_p=top_p,
                    min_p=min_p,
                    seed=seed,
                )
            ],
            keep_processed=True,
        )
        token = int(result.token_ids[0])
        assert token in allowed
        probs = np.exp(x - x.max())
        assert probs[token] >= min_p - 1e-6
        assert result.processed is not None
        assert np.isfinite(result.processed[0, token])


def test_sampling_follows_the_distribution() -> None:
    logits = np.log(np.array([[0.5, 0.3, 0.2]], dtype=np.float32))
    sampler = Sampler()
    counts = np.zeros(3)
    for step in range(3000):
        result = sampler.sample(logits, [row(first=step == 0, temperature=1.0, seed=5)])
        counts[int(result.token_ids[0])] += 1
    assert np.allclose(counts / counts.sum(), [0.5, 0.3, 0.2], atol=0.03)


@settings(max_examples=150, deadline=None)
@given(
    vocab=st.sampled_from([1, 2, 5, CDF_BLOCK - 1, CDF_BLOCK, CDF_BLOCK + 1, 3 * CDF_BLOCK + 7]),
    rows=st.integers(1, 5),
    zeroed=st.sampled_from([0.0, 0.5, 0.97]),
    seed=st.integers(0, 10_000),
    uniforms=st.data(),
)
def test_the_drawn_id_is_where_the_draw_falls_in_the_exact_cumulative_sums(
    vocab: int, rows: int, zeroed: float, seed: int, uniforms: st.DataObject
) -> None:
    """The two-level sums of :func:`invert` pick, for every row, an id of
    positive weight whose span of the exact (rational) cumulative sums holds
    ``uniform * total``, to within float64 rounding; and a row picks the same
    id alone as beside other rows."""
    noise = np.random.default_rng(seed)
    probs = np.exp(noise.standard_normal((rows, vocab)) * 3).astype(np.float32)
    probs[noise.random(probs.shape) < zeroed] = 0.0
    probs[:, noise.integers(vocab)] = 1.0  # a positive total
    draws = np.array(
        [
            uniforms.draw(
                st.sampled_from([0.0, 0.5, 1 - 2**-53]) | st.floats(0, 1, exclude_max=True)
            )
            for _ in range(rows)
        ]
    )
    picked, totals = invert(probs, draws)
    for row_probs, uniform, id_, total in zip(probs, draws, picked.tolist(), totals, strict=True):
        weights = [Fraction(float(w)) for w in row_probs]
        exact = sum(weights, Fraction(0))
        assert abs(Fraction(float(total)) - exact) <= exact * Fraction(1, 10**12)
        target = Fraction(float(uniform)) * exact
        below = sum(weights[:id_], Fraction(0))
        slack = exact * Fraction(1, 10**12)
        assert row_probs[id_] > 0
        assert below - slack <= target <= below + weights[id_] + slack
        alone, _ = invert(row_probs[None, :], np.array([uniform]))
        assert int(alone[0]) == id_


def test_logit_bias_and_suppression() -> None:
    logits = np.zeros((1, 10), dtype=np.float32)
    logits[0, 3] = 5.0
    biased = Sampler().sample(logits, [row(temperature=0.0, logit_bias=((7, 100.0),))])
    assert biased.token_ids[0] == 7
    suppressed_row = Row(
        request_id="r",
        choice=0,
        sampling=SamplingParams(temperature=0.0),
        logprobs=LogprobParams(),
        prompt_ids=(),
        first=True,
        suppress=(3,),
    )
    assert Sampler().sample(logits, [suppressed_row]).token_ids[0] != 3


def test_penalties_discourage_repeats() -> None:
    logits = np.zeros((1, 5), dtype=np.float32)
    logits[0, 0] = 1.0
    sampler = Sampler()
    first = sampler.sample(logits, [row(temperature=0.0, frequency_penalty=2.0)])
    second = sampler.sample(logits, [row(first=False, temperature=0.0, frequency_penalty=2.0)])
    assert first.token_ids[0] == 0
    assert second.token_ids[0] != 0


def test_repetition_penalty_covers_the_prompt() -> None:
    logits = np.zeros((1, 6), dtype=np.float32)
    logits[0, 2] = 1.0  # token 2 is in the prompt (1, 2, 3)
    logits[0, 5] = 0.6
    result = Sampler().sample(logits, [row(temperature=0.0, repetition_penalty=2.0)])
    assert result.token_ids[0] == 5


def test_finished_rows_are_forgotten() -> None:
    sampler = Sampler()
    sampler.sample(logits_for(2), [row("a"), row("b")])
    assert len(sampler) == 2
    sampler.sample(logits_for(1), [row("a", first=False)])
    assert len(sampler) == 1


def test_the_processed_distribution_is_kept_only_when_asked() -> None:
    """``--logprobs-mode processed``: the row sampled from comes back as a
    log-distribution over what the filters left; otherwise the sampler need
    not write it, and returns none."""
    logits = logits_for(1, seed=3)
    params = {"temperature": 0.7, "top_k": 3, "seed": 5}
    kept = Sampler().sample(logits, [row(**params)], keep_processed=True)
    assert kept.processed is not None
    processed = kept.processed[0]
    assert np.isfinite(processed).sum() == 3
    assert np.logaddexp.reduce(processed) == pytest.approx(0.0, abs=1e-5)
    assert np.isfinite(processed[int(kept.token_ids[0])])
    dropped = Sampler().sample(logits, [row(**params)])
    assert dropped.processed is None
    assert dropped.token_ids.tolist() == kept.token_ids.tolist()
