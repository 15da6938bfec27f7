"""The mlx engine's step queued ahead: whatever calls follow, the engine
answers as if the step had never been queued, and takes it over when the
next decode is the one it foresaw."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluiceway.engines.base import ChainingEngine, DecodeResult
from sluiceway.engines.loader import ModelSource
from tests.engines.test_parity import prompt

pytest.importorskip("mlx.core")

from sluiceway.engines.mlx_engine import MlxEngine

#: What happens after each decode: the next decode with every row's argmax
#: (chained or not), with other tokens, after a row leaves, after a row
#: joins, or after the decode is taken back.
ACTIONS = ("greedy", "greedy unchained", "other tokens", "free", "join", "undo")


@dataclass
class _Pair:
    """The engine under test and a plain one, driven alike."""

    chained: Any
    plain: Any
    running: dict[int, int] = field(default_factory=dict)
    next_slot: int = 0

    def join(self) -> None:
        slot = self.next_slot
        self.next_slot += 1
        ids = prompt(100 + slot, 5 + slot % 7)
        first = self.chained.prefill(slot, ids)
        np.testing.assert_array_equal(first, self.plain.prefill(slot, ids))
        self.running[slot] = int(first[-1].argmax())

    def decode(self, tokens: dict[int, int], *, chain: bool) -> DecodeResult:
        start = self.chained.start_decode_chained if chain else self.chained.start_decode
        got: DecodeResult = start(tokens)()
        expected: DecodeResult = self.plain.decode(tokens)
        assert got.slots == expected.slots
        np.testing.assert_array_equal(got.logits, expected.logits)
        return got

    def close(self) -> None:
        for slot in list(self.running):
            self.chained.free(slot)
            self.plain.free(slot)


@pytest.fixture(scope="module")
def engines(tiny_model: ModelSource) -> Iterator[tuple[Any, Any]]:
    chained = MlxEngine(tiny_model)
    plain = MlxEngine(tiny_model, queue_ahead=False)
    yield chained, plain
    chained.close()
    plain.close()


def test_the_mlx_engine_queues_steps(engines: tuple[Any, Any]) -> None:
    assert isinstance(engines[0], ChainingEngine)
    assert engines[0].chains
    assert not engines[1].chains


def test_an_engine_that_does_not_queue_ahead_takes_nothing_over(
    engines: tuple[Any, Any],
) -> None:
    plain = engines[1]
    first = int(plain.prefill(0, prompt(7, 9))[-1].argmax())
    try:
        result = plain.start_decode_chained({0: first})()
        for _ in range(3):
            result = plain.start_decode_chained({0: int(result.logits[0].argmax())})()
        assert (plain.queued_taken, plain.queued_dropped) == (0, 0)
    finally:
        plain.free(0)


def _argmaxes(result: DecodeResult) -> dict[int, int]:
    return {slot: int(row.argmax()) for slot, row in zip(result.slots, result.logits, strict=True)}


def _play(pair: _Pair, actions: list[str]) -> None:
    pair.join()
    result = pair.decode(dict(pair.running), chain=True)
    for action in actions:
        tokens = _argmaxes(result)
        if action == "other tokens":
            tokens = {slot: (token + 1) % 100 for slot, token in tokens.items()}
        elif action == "free" and len(tokens) > 1:
            gone = sorted(tokens)[len(tokens) // 2]
            pair.chained.free(gone)
            pair.plain.free(gone)
            del tokens[gone], pair.running[gone]
        elif action == "join":
            pair.join()
            tokens[pair.next_slot - 1] = pair.running[pair.next_slot - 1]
        elif action == "undo":
            pair.chained.undo_decode()
            pair.plain.undo_decode()
            tokens = {slot: (token + 3) % 100 for slot, token in pair.running.items()}
        pair.running.update(tokens)
        result = pair.decode(tokens, chain=action != "greedy unchained")
        pair.running = {slot: pair.running[slot] for slot in result.slots}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=st.lists(st.sampled_from(ACTIONS), max_size=10))
def test_a_queued_step_changes_no_result(engines: tuple[Any, Any], actions: list[str]) -> None:
    """Bit for bit, every decode equals the plain engine's, whether the step
    was taken over, trimmed off, or cut to the rows left."""
    pair = _Pair(*engines)
    try:
        _play(pair, actions)
    finally:
        pair.close()


def test_steady_greedy_steps_are_taken_over(engines: tuple[Any, Any]) -> None:
    """A steady greedy run takes over every queued step; a row leaving keeps
    the others' queued step; other tokens and a join trim it off."""
    chained = engines[0]
    pair = _Pair(*engines)
    taken, dropped = chained.queued_taken, chained.queued_dropped
    try:
        _play(pair, ["join", "join", "greedy", "greedy", "free", "greedy", "greedy"])
        assert chained.queued_taken - taken == 5
        assert chained.queued_dropped - dropped == 2
        _play(pair, ["other tokens"])
        assert chained.queued_dropped - dropped == 4
    finally:
        pair.close()
