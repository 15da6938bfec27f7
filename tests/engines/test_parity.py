"""Both engines against plain transformers, and against themselves batched and alone.

The transformers engine runs twice: eagerly, and with its decode step
compiled (``transformers-compiled``: batches of up to four rows run the
compiled graphs, larger ones its eager step).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from sluiceway.engines.base import Engine
from sluiceway.engines.loader import ModelSource
from sluiceway.engines.select import make_engine
from tests.engines.conftest import ENGINES
from tests.engines.helpers import (
    LOGPROB_TOLERANCE,
    Trace,
    assert_same_trace,
    exact_dtype,
    greedy_alone,
    log_softmax,
    run_schedule,
)

STEPS = 12
#: The compiled engine's first steps compile its buckets (a minute or more
#: each on a cold Inductor cache on a 2-core host).
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(params=[*ENGINES, "transformers-compiled"])
def engine(request: pytest.FixtureRequest, tiny_model: ModelSource) -> Iterator[Engine]:
    """conftest's engines, and the session's compiled transformers engine."""
    if request.param == "transformers-compiled":
        compiled = request.getfixturevalue("compiled_transformers")
        yield compiled
        compiled.close()  # its rows and entries go; its graphs stay
        step = compiled.compiled_step
        assert step is not None
        assert step.failure is None
        return
    name = str(request.param)
    built = make_engine(name, tiny_model, device="auto", dtype=exact_dtype(name))
    yield built
    built.close()


def prompt(seed: int, length: int, vocab: int = 500) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, length)]


PROMPTS = {
    "one token": prompt(1, 1),
    "short": prompt(2, 7),
    "medium": prompt(3, 60),
    # Longer than one prefill step (512) and than one block of the time axis (256).
    "long": prompt(4, 700),
}


def generate(reference: Any, tokens: list[int], steps: int) -> list[int]:
    import torch

    with torch.inference_mode():
        out = reference.generate(
            torch.tensor([tokens]),
            attention_mask=torch.ones(1, len(tokens), dtype=torch.long),
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(tokens) :]]


def forward_logprobs(reference: Any, tokens: list[int]) -> np.ndarray:
    """Log-softmax at every position of one full forward pass (no cache)."""
    import torch

    with torch.inference_mode():
        logits = reference(torch.tensor([tokens]), use_cache=False).logits[0]
    return log_softmax(logits.float().numpy())


@pytest.mark.parametrize("name", PROMPTS)
def test_greedy_tokens_match_generate(engine: Engine, reference: Any, name: str) -> None:
    tokens = PROMPTS[name]
    assert greedy_alone(engine, tokens, STEPS).tokens == generate(reference, tokens, STEPS)


@pytest.mark.parametrize("name", PROMPTS)
def test_logprobs_match_a_full_forward(engine: Engine, reference: Any, name: str) -> None:
    tokens = PROMPTS[name]
    trace = greedy_alone(engine, tokens, STEPS)
    expected = forward_logprobs(reference, tokens + trace.tokens[:-1])[len(tokens) - 1 :]
    got = np.stack(trace.logprobs)
    assert got.shape == expected.shape
    assert float(np.max(np.abs(got - expected))) < LOGPROB_TOLERANCE


def test_rows_join_and_leave_mid_batch(engine: Engine) -> None:
    prompts = {
        10: PROMPTS["short"],
        11: PROMPTS["medium"],
        12: PROMPTS["one token"],
        13: PROMPTS["long"],
        14: prompt(5, 3),
        15: prompt(6, 33),
    }
    # A long row joins short ones (the shared axis grows to the left), the
    # longest row leaves (the common padding is dropped), a slot number is reused.
    joins = {0: [10, 11, 12], 3: [13], 4: [14], 9: [15], 12: [11]}
    leaves = {3: [12], 6: [13], 8: [10], 11: [11]}
    steps = 20
    alone = {slot: greedy_alone(engine, tokens, steps + 1) for slot, tokens in prompts.items()}
    traces = run_schedule(engine, prompts, joins, leaves, steps)
    assert sorted(slot for slot, _ in traces) == [10, 11, 11, 12, 13, 14, 15]
    for slot, trace in traces:
        assert_same_trace(trace, alone[slot], f"slot {slot}")


@pytest.mark.parametrize("survivor", [10, 11])
def test_a_batch_down_to_one_row_and_back(engine: Engine, survivor: int) -> None:
    """One row alone, a second joins, either leaves, a third joins the one
    left: the mlx engine changes the lone row's cache at each of these."""
    prompts = {10: PROMPTS["medium"], 11: PROMPTS["short"], 12: prompt(7, 20)}
    leaver = 21 - survivor
    joins = {0: [10], 3: [11], 8: [12]}
    leaves = {5: [leaver], 11: [survivor]}
    steps = 14
    alone = {slot: greedy_alone(engine, tokens, steps + 1) for slot, tokens in prompts.items()}
    traces = run_schedule(engine, prompts, joins, leaves, steps)
    assert sorted(slot for slot, _ in traces) == [10, 11, 12]
    for slot, trace in traces:
        assert_same_trace(trace, alone[slot], f"slot {slot}")


@pytest.mark.parametrize("seed", [0, 1])
def test_random_schedules_match_rows_alone(engine: Engine, seed: int) -> None:
    rng = np.random.default_rng(seed)
    steps, slots = 16, range(8)
    prompts = {s: prompt(100 * seed + s, int(rng.integers(1, 90))) for s in slots}
    starts = {s: int(rng.integers(0, steps - 1)) for s in slots}
    stops = {s: int(rng.integers(starts[s] + 1, steps + 1)) for s in slots}
    joins: dict[int, list[int]] = {}
    leaves: dict[int, list[int]] = {}
    for s in slots:
        joins.setdefault(starts[s], []).append(s)
        leaves.setdefault(stops[s], []).append(s)
    alone = {s: greedy_alone(engine, prompts[s], steps + 1) for s in slots}
    traces = run_schedule(engine, prompts, joins, leaves, steps)
    assert len(traces) == len(slots)
    for s, trace in traces:
        assert_same_trace(trace, alone[s], f"seed {seed} slot {s}")


def test_chunked_prefill_equals_one_prefill(engine: Engine) -> None:
    tokens = PROMPTS["medium"]
    whole = greedy_alone(engine, tokens, STEPS)
    chunked = Trace()
    for begin, end in [(0, 1), (1, 4), (4, 31), (31, len(tokens))]:
        logits = engine.prefill(3, tokens[begin:end])
    token = chunked.take(logits[-1])
    for _ in range(STEPS - 1):
        token = chunked.take(engine.decode({3: token}).logits[0])
    engine.free(3)
    assert_same_trace(chunked, whole, "chunked")


def test_all_logits_cover_every_prompt_position(engine: Engine, reference: Any) -> None:
    tokens = PROMPTS["long"][:600]
    expected = forward_logprobs(reference, tokens)
    pieces = [engine.prefill(0, tokens[:5], all_logits=True)]
    pieces.append(engine.prefill(0, tokens[5:], all_logits=True))
    engine.free(0)
    assert [p.shape for p in pieces] == [(5, expected.shape[1]), (595, expected.shape[1])]
    assert all(p.dtype == np.float32 for p in pieces)
    got = log_softmax(np.concatenate(pieces))
    assert float(np.max(np.abs(got - expected))) < LOGPROB_TOLERANCE


def test_fork_continues_identically_and_independently(engine: Engine) -> None:
    tokens = PROMPTS["medium"]
    alone = greedy_alone(engine, tokens, STEPS)
    first = int(np.argmax(engine.prefill(0, tokens)[-1]))
    engine.fork(0, 1)
    engine.fork(0, 2)
    traces = {slot: Trace(tokens=[first]) for slot in (0, 1, 2)}
    running = {0: first, 1: first, 2: first}
    for _ in range(STEPS - 1):
        result = engine.decode(running)
        for slot, logits in zip(result.slots, result.logits, strict=True):
            running[slot] = traces[slot].take(logits)
    for slot in (0, 1, 2):
        engine.free(slot)
        assert traces[slot].tokens == alone.tokens
        np.testing.assert_allclose(traces[slot].logprobs, alone.logprobs[1:], atol=1e-4)
    # A fork is a copy, not an alias: feeding different tokens gives each its own history.
    engine.prefill(5, tokens)
    engine.fork(5, 6)
    result = engine.decode({5: 1, 6: 2})
    by_slot = dict(zip(result.slots, result.logits, strict=True))
    for slot, token in ((5, 1), (6, 2)):
        engine.free(slot)
        expected = engine.prefill(9, [*tokens, token])
        engine.free(9)
        np.testing.assert_allclose(
            log_softmax(by_slot[slot]), log_softmax(expected[-1]), atol=LOGPROB_TOLERANCE
        )


def test_decode_logits_are_float32_rows(engine: Engine) -> None:
    engine.prefill(0, PROMPTS["short"])
    engine.prefill(1, PROMPTS["one token"])
    result = engine.decode({1: 5, 0: 7})
    assert result.logits.dtype == np.float32
    assert result.logits.shape == (2, engine.info.vocab_size)
    assert sorted(result.slots) == [0, 1]


def test_misuse_is_refused(engine: Engine) -> None:
    with pytest.raises(ValueError, match="at least one token"):
        engine.prefill(0, [])
    with pytest.raises(ValueError, match="never prefilled"):
        engine.decode({4: 1})
    engine.prefill(0, [1, 2, 3])
    engine.prefill(1, [4])
    engine.decode({0: 1, 1: 2})
    with pytest.raises(ValueError, match="every running slot"):
        engine.decode({0: 1})
    engine.free(1)
    engine.free(1)  # freeing twice, or a slot never seen, is harmless
    engine.free(77)
    assert engine.decode({0: 3}).slots == (0,)


def test_more_rows_than_the_first_allocation(engine: Engine) -> None:
    prompts = {slot: prompt(200 + slot, 1 + 7 * slot) for slot in range(11)}
    joins = {0: list(range(6)), 1: list(range(6, 11))}
    leaves = {3: [0, 5, 7]}
    steps = 6
    alone = {slot: greedy_alone(engine, tokens, steps + 1) for slot, tokens in prompts.items()}
    traces = run_schedule(engine, prompts, joins, leaves, steps)
    assert len(traces) == len(prompts)
    for slot, trace in traces:
        assert_same_trace(trace, alone[slot], f"slot {slot}")


def test_memory_given_back_while_idle_changes_no_later_step(engine: Engine) -> None:
    """Once every row has left, the engine drops the buffers it kept for
    reuse; the rows that come next decode exactly as before."""
    prompts = {10: PROMPTS["medium"], 11: PROMPTS["short"], 12: prompt(8, 40)}
    joins = {0: [10, 11], 2: [12]}
    leaves: dict[int, list[int]] = {}
    before = run_schedule(engine, prompts, joins, leaves, 10)
    for slot in prompts:
        engine.free(slot)
    engine.release_memory()
    after = run_schedule(engine, prompts, joins, leaves, 10)
    for (slot, trace), (_, again) in zip(before, after, strict=True):
        assert_same_trace(again, trace, f"slot {slot}")
