"""Prompt chunks packed into a decode step's forward pass (transformers engine).

A packed step must give what a prefill of each chunk followed by the decode
gives: the same logits (to float32 rounding), and the same caches, which the
next decode, with the chunks' rows joining, shows.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluiceway.engines.base import DropKV, KeepKV, PackingEngine
from sluiceway.engines.loader import ModelSource
from sluiceway.engines.select import make_engine
from sluiceway.engines.torch_engine import TransformersEngine

VOCAB = 500


@pytest.fixture(scope="module")
def engines(tiny_model: ModelSource) -> Iterator[tuple[TransformersEngine, TransformersEngine]]:
    pair = [
        make_engine("transformers", tiny_model, device="cpu", dtype="float32") for _ in range(2)
    ]
    assert all(isinstance(engine, TransformersEngine) for engine in pair)
    yield pair[0], pair[1]  # type: ignore[misc]
    for engine in pair:
        engine.close()


def _ids(count: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, VOCAB, count)]


def _reset(engine: TransformersEngine, slots: Sequence[int]) -> None:
    for slot in slots:
        engine.free(slot)


@settings(max_examples=25, deadline=None)
@given(
    running=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    chunks=st.lists(
        st.tuples(st.integers(1, 30), st.sampled_from(["fresh", "continued", "restored"])),
        min_size=1,
        max_size=3,
    ),
    seed=st.integers(0, 1000),
    decode=st.booleans(),
)
def test_a_packed_step_is_a_prefill_then_a_decode(
    engines: tuple[TransformersEngine, TransformersEngine],
    running: list[int],
    chunks: list[tuple[int, str]],
    seed: int,
    decode: bool,
) -> None:
    """Without ``decode``, the pass only prefills (the running rows wait)."""
    plain, packed = engines
    assert packed.packs_prefills
    rows = {slot: _ids(length, seed + slot) for slot, length in enumerate(running)}
    work = {100 + i: (_ids(length, seed + 50 + i), how) for i, (length, how) in enumerate(chunks)}
    slots = [*rows, *work]
    try:
        for engine in (plain, packed):
            tokens = {
                slot: int(engine.prefill(slot, ids)[-1].argmax()) for slot, ids in rows.items()
            }
            step = engine.decode(tokens)
            for i, (slot, (_, how)) in enumerate(work.items()):
                head = _ids(5 + i, seed + 80 + i)
                if how == "continued":
                    engine.prefill(slot, head)
                elif how == "restored":
                    engine.prefill(200, head)
                    engine.cache_op(KeepKV(entry=slot, slot=200, start=0, end=len(head)))
                    engine.free(200)
                    engine.restore(slot, [slot], len(head))
            following = {s: int(r.argmax()) for s, r in zip(step.slots, step.logits, strict=True)}
            if engine is plain:
                expected = [engine.prefill(slot, ids) for slot, (ids, _) in work.items()]
                decoded = engine.decode(following) if decode else step
            else:
                decoded, got = engine.decode_prefilling(
                    following if decode else {},
                    [(slot, ids) for slot, (ids, _) in work.items()],
                )
                if not decode:
                    assert decoded.slots == ()
                    decoded = step
            joined = {
                s: int(r.argmax()) for s, r in zip(decoded.slots, decoded.logits, strict=True)
            }
            last = expected if engine is plain else got
            joined |= {
                slot: int(logits[-1].argmax()) for slot, logits in zip(work, last, strict=True)
            }
            after = engine.decode(joined)
            if engine is plain:
                want = (decoded, expected, after)
        plain_decoded, plain_chunks, plain_after = want
        assert decoded.slots == plain_decoded.slots
        np.testing.assert_allclose(decoded.logits, plain_decoded.logits, atol=2e-5)
        for mine, theirs in zip(got, plain_chunks, strict=True):
            assert mine.shape == theirs.shape == (1, theirs.shape[1])
            np.testing.assert_allclose(mine, theirs, atol=2e-5)
        assert after.slots == plain_after.slots
        np.testing.assert_allclose(after.logits, plain_after.logits, atol=2e-5)
    finally:
        for engine in (plain, packed):
            _reset(engine, slots)
            for slot in work:
                engine.cache_op(DropKV(entry=slot))


def test_undo_takes_back_the_decode_and_keeps_the_chunk(
    engines: tuple[TransformersEngine, TransformersEngine],
) -> None:
    plain, packed = engines
    try:
        for engine in (plain, packed):
            first = int(engine.prefill(0, _ids(9, 1))[-1].argmax())
            engine.decode({0: first})
        _, (chunk,) = packed.decode_prefilling({0: 7}, [(1, _ids(12, 2))])
        packed.undo_decode()
        alone = plain.prefill(1, _ids(12, 2))
        np.testing.assert_allclose(chunk, alone, atol=2e-5)
        following = {0: 8, 1: int(alone[-1].argmax())}
        np.testing.assert_allclose(
            packed.decode(following).logits, plain.decode(following).logits, atol=2e-5
        )
    finally:
        for engine in (plain, packed):
            _reset(engine, [0, 1])


def test_a_packed_step_refuses_what_a_decode_or_a_prefill_would(
    engines: tuple[TransformersEngine, TransformersEngine],
) -> None:
    _, engine = engines
    try:
        engine.prefill(0, _ids(4, 3))
        engine.decode({0: 5})
        with pytest.raises(ValueError, match="missing"):
            engine.decode_prefilling({9: 1}, [(1, [2])])
        with pytest.raises(ValueError, match="cannot be prefilled"):
            engine.decode_prefilling({0: 1}, [(0, [2])])
        with pytest.raises(ValueError, match="cannot be prefilled"):
            engine.decode_prefilling({0: 1}, [(1, [])])
        with pytest.raises(ValueError, match="cannot be prefilled"):
            engine.decode_prefilling({0: 1}, [(1, [2]), (1, [3])])
        with pytest.raises(ValueError, match="needs chunks"):
            engine.decode_prefilling({0: 1}, [])
    finally:
        _reset(engine, [0, 1, 9])


def test_only_the_transformers_engine_on_the_cpu_packs(tiny_model: ModelSource) -> None:
    mlx = make_engine("mlx", tiny_model, device="auto", dtype="auto")
    try:
        assert not isinstance(mlx, PackingEngine)
    finally:
        mlx.close()
