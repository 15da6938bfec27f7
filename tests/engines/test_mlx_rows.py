"""The mlx engine's own KV rows: where a step writes, what it reads back, and
what joining, leaving and taking back positions do to the buffers."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("mlx.core")

import mlx.core as mx
from mlx_lm.models import cache as typed_cache

from sluiceway.engines.mlx_engine import _attention_layers
from sluiceway.engines.mlx_rows import TIME_STEP, Rows

#: mlx-lm's caches, untyped there.
mlx_cache: Any = typed_cache

HEADS, DIM = 2, 3


def _prefilled(length: int, mark: float) -> list[Any]:
    """One layer's ``KVCache`` holding ``length`` positions, position ``p``'s
    keys all ``mark + p`` and its values their negatives."""
    cache = mlx_cache.KVCache()
    keys = mx.broadcast_to(mark + mx.arange(length)[None, None, :, None], (1, HEADS, length, DIM))
    cache.update_and_fetch(keys.astype(mx.float32), -keys.astype(mx.float32))
    return [cache]


def _positions(buffer: Any, row: int, length: int) -> list[float]:
    """Row ``row``'s first ``length`` positions (head 0, feature 0)."""
    return [float(x) for x in np.asarray(buffer[row, 0, :length, 0])]


def _step(rows: Rows, marks: list[float]) -> tuple[Any, Any]:
    """One decode step that writes ``marks[row]`` as each row's new key."""
    caches = rows.begin(1)
    new = mx.broadcast_to(mx.array(marks)[:, None, None, None], (len(marks), HEADS, 1, DIM))
    return caches[0].update_and_fetch(new, -new)


def test_each_row_is_written_at_its_own_length_and_its_tail_is_masked() -> None:
    rows = Rows(mx, 1)
    for length, mark in ((3, 0.0), (1, 10.0), (5, 20.0)):
        rows.join(_prefilled(length, mark))
    keys, values = _step(rows, [100.0, 200.0, 300.0])
    assert keys.shape == (3, HEADS, 6, DIM)
    assert _positions(keys, 0, 4) == [0, 1, 2, 100]
    assert _positions(keys, 1, 2) == [10, 200]
    assert _positions(keys, 2, 6) == [20, 21, 22, 23, 24, 300]
    assert _positions(values, 1, 2) == [-10, -200]
    layer = rows.begin(1)[0]
    assert np.asarray(layer.offset).tolist() == [4, 2, 6]
    mask = np.asarray(layer.make_mask(1))
    assert mask.shape == (3, 1, 1, 7)
    assert mask[:, 0, 0].sum(axis=1).tolist() == [5, 3, 7]


def test_rows_of_equal_length_take_a_plain_step() -> None:
    rows = Rows(mx, 1)
    rows.join(_prefilled(2, 0.0))
    rows.join(_prefilled(2, 10.0))
    keys, _ = _step(rows, [100.0, 200.0])
    layer = rows.begin(1)[0]
    assert layer.offset == 3
    assert layer.make_mask(1) is None
    assert _positions(keys, 1, 3) == [10, 11, 200]


def test_a_leaving_row_is_replaced_by_the_last_and_nothing_else_moves() -> None:
    rows = Rows(mx, 1)
    for length, mark in ((2, 0.0), (3, 10.0), (1, 20.0), (4, 30.0)):
        rows.join(_prefilled(length, mark))
    assert rows.leave(1) == [0, 3, 2]
    assert rows.lengths == [2, 4, 1]
    assert _positions(rows.keys[0], 1, 4) == [30, 31, 32, 33]
    assert _positions(rows.keys[0], 0, 2) == [0, 1]
    assert rows.leave(2) == [0, 1]
    keys, _ = _step(rows, [100.0, 200.0])
    assert _positions(keys, 1, 5) == [30, 31, 32, 33, 200]


def test_taken_back_positions_are_written_again() -> None:
    rows = Rows(mx, 1)
    rows.join(_prefilled(2, 0.0))
    rows.join(_prefilled(1, 10.0))
    _step(rows, [100.0, 200.0])
    rows.trim(1)
    keys, _ = _step(rows, [101.0, 201.0])
    assert _positions(keys, 0, 3) == [0, 1, 101]
    assert _positions(keys, 1, 2) == [10, 201]
    rows.trim(2)
    with pytest.raises(ValueError, match="cannot take back"):
        rows.trim(1)


def test_the_buffers_grow_past_their_first_rows_and_positions() -> None:
    rows = Rows(mx, 1)
    long = TIME_STEP + 10
    rows.join(_prefilled(long, 0.0))
    for mark in range(1, 12):
        rows.join(_prefilled(1, 1000.0 * mark))
    keys, _ = _step(rows, [float(-row) for row in range(12)])
    assert rows.keys[0].shape[0] >= 12
    assert rows.keys[0].shape[2] >= long + 1
    assert _positions(keys, 0, long + 1)[-2:] == [long - 1, 0]
    assert _positions(keys, 11, 2) == [11000, -11]


def test_copies_of_a_row_are_its_positions() -> None:
    rows = Rows(mx, 1)
    rows.join(_prefilled(4, 0.0))
    rows.join(_prefilled(6, 10.0))
    ((keys, values),) = rows.span(1, 2, 5)
    assert keys.shape == (1, HEADS, 3, DIM)
    assert _positions(keys, 0, 3) == [12, 13, 14]
    assert _positions(values, 0, 3) == [-12, -13, -14]
    with pytest.raises(ValueError, match="no positions"):
        rows.span(0, 2, 5)


class _WindowedModel:
    """A model whose layers keep a sliding window (as mlx-lm's Gemma 3's do)."""

    def make_cache(self) -> list[Any]:
        return [mlx_cache.KVCache(), mlx_cache.RotatingKVCache(max_size=8)]


def test_a_model_without_plain_attention_caches_is_refused() -> None:
    with pytest.raises(ValueError, match="RotatingKVCache"):
        _attention_layers(_WindowedModel(), {"model_type": "gemma3"})
