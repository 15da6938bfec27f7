"""The mlx engine's running rows: per layer, one keys buffer and one values
buffer ``[rows, kv_heads, capacity, head_dim]`` that the engine owns, and the
cache objects mlx-lm's attention layers call during a step over them. How
rows of different lengths share the buffers, and why, is the theory of
operation of :mod:`sluiceway.engines.mlx_engine`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: The running rows' time axis grows in multiples of this many positions.
TIME_STEP = 256
#: The running rows' buffers start with room for this many rows, doubling as needed.
ROW_STEP = 8
#: Emptied rows keep their buffers up to this size for the next rows (as the
#: transformers engine's idle batch does); larger ones, left by long or many
#: rows, are given back at once rather than at the next release_memory.
KEEP_IDLE_BYTES = 256 * 2**20


@dataclass(frozen=True, slots=True)
class RowStep:
    """Where the step being built writes its keys and values, and what its
    attention reads back."""

    #: Every row's first new position when the rows hold as many positions,
    #: else the scatter's indices (rows, heads, positions), which broadcast
    #: to ``[rows, kv_heads, width]``.
    at: int | tuple[Any, Any, Any]
    #: Positions read back: the longest row's, the new ones included.
    window: int
    #: RoPE's offset: one for every row, or an array of one a row.
    offset: Any
    #: None (every row reads its whole window), or booleans
    #: ``[rows or 1, 1, width, window]``.
    mask: Any


class Rows:
    """The running rows' keys and values, in buffers the engine owns (see the
    module's docstring). Row ``i`` is the ``i``-th running slot."""

    def __init__(self, mx: Any, layers: int) -> None:
        self._mx = mx
        #: Per layer, ``[row_capacity, kv_heads, capacity, head_dim]``.
        self.keys: list[Any] = []
        self.values: list[Any] = []
        #: The positions each row holds, on the host.
        self.lengths: list[int] = []
        self._step: RowStep | None = None
        self._caches = [RowsLayer(self, layer) for layer in range(layers)]

    @property
    def step(self) -> RowStep:
        if self._step is None:
            raise RuntimeError("the rows are read and written only by a step's forward pass")
        return self._step

    def begin(self, width: int) -> list[RowsLayer]:
        """The model's caches for a step that adds ``width`` positions to every row."""
        starts = self.lengths
        window = max(starts) + width
        self._reserve(len(starts), window)
        if min(starts) == max(starts):
            self._step = self._equal_step(starts[0], width, window)
        else:
            self._step = self._ragged_step(starts, width, window)
        self.lengths = [length + width for length in starts]
        return self._caches

    def _equal_step(self, start: int, width: int, window: int) -> RowStep:
        # A plain KVCache's step: a decode step reads every row's whole
        # window, so it needs no mask; a longer one needs the causal mask.
        mx = self._mx
        mask = None
        if width > 1:
            mask = (mx.arange(window) <= start + mx.arange(width)[:, None])[None, None]
        return RowStep(start, window, start, mask)

    def _ragged_step(self, starts: list[int], width: int, window: int) -> RowStep:
        mx = self._mx
        first = mx.array(starts)[:, None]
        positions = first + mx.arange(width)  # [rows, width]
        heads = mx.arange(self.keys[0].shape[1])[None, :, None]
        at = (mx.arange(len(starts))[:, None, None], heads, positions[:, None, :])
        # Each row's tail past its own length is stale: masked, so a finite
        # stale key scores -inf and its value counts for exactly nothing.
        mask = (mx.arange(window) <= positions[..., None])[:, None]
        return RowStep(at, window, first[:, 0], mask)

    def write(self, layer: int, keys: Any, values: Any) -> tuple[Any, Any]:
        """Write one layer's new keys and values ``[rows, kv_heads, width,
        head_dim]``; return that layer's window of every row."""
        step = self.step
        rows, width = keys.shape[0], keys.shape[2]
        for buffer, new in ((self.keys[layer], keys), (self.values[layer], values)):
            if isinstance(step.at, int):
                buffer[:rows, :, step.at : step.at + width, :] = new
            else:
                buffer[step.at] = new
        window = step.window
        return self.keys[layer][:rows, :, :window], self.values[layer][:rows, :, :window]

    def join(self, caches: Sequence[Any]) -> None:
        """Copy a prefilled slot's ``KVCache`` list into a new last row."""
        held = int(caches[0].offset)
        if not self.keys:
            self._allocate(caches)
        row = len(self.lengths)
        self._reserve(row + 1, held)
        if held:
            for layer, cache in enumerate(caches):
                self.keys[layer][row : row + 1, :, :held] = cache.keys[..., :held, :]
                self.values[layer][row : row + 1, :, :held] = cache.values[..., :held, :]
        self.lengths.append(held)

    def leave(self, row: int) -> list[int]:
        """Drop ``row``, the last row moving into its place; return the rows
        kept (their former indices) in their new order."""
        last = len(self.lengths) - 1
        kept = list(range(last))
        if row != last:
            kept[row] = last
            self._move(last, row)
            self.lengths[row] = self.lengths[last]
        self.lengths.pop()
        return kept

    def _move(self, source: int, target: int) -> None:
        mx = self._mx
        index = mx.array([source])
        moved = [mx.take(buffer, index, axis=0) for buffer in (*self.keys, *self.values)]
        # Evaluated before it is written: while a lazy copy of a row still
        # reads its buffer, writing it into that buffer copies the whole
        # buffer (64 of 65 MB at 64 rows, measured), not one row. This
        # waits for a step under way, whose work the next decode takes over.
        mx.eval(moved)
        for buffer, row in zip((*self.keys, *self.values), moved, strict=True):
            buffer[target : target + 1] = row

    def trim(self, positions: int) -> None:
        """Take back each row's last ``positions`` positions."""
        if any(length < positions for length in self.lengths):
            raise ValueError("the cache cannot take back a position")
        self.lengths = [length - positions for length in self.lengths]

    def span(self, row: int, start: int, end: int) -> list[tuple[Any, Any]]:
        """Copies of ``row``'s keys and values at positions ``[start, end)``."""
        if not 0 <= start < end <= self.lengths[row]:
            raise ValueError(f"the row holds no positions {start}..{end}")
        layers = [
            (k[row : row + 1], v[row : row + 1])
            for k, v in zip(self.keys, self.values, strict=True)
        ]
        return copies(self._mx, layers, start, end)

    @property
    def nbytes(self) -> int:
        return sum(int(buffer.nbytes) for buffer in (*self.keys, *self.values))

    def idle(self) -> None:
        """Keep the buffers of rows all gone for the next rows, when small
        enough, with nothing left to compute: a graph still pending is bound
        to the stream of the thread that built it, and the next rows may be
        decoded on another thread (an engine that outlives its server)."""
        if self.nbytes > KEEP_IDLE_BYTES:
            self.release()
        else:
            self._mx.eval(self.keys, self.values)

    def release(self) -> None:
        """Give the buffers back, dropping any rows."""
        self.keys, self.values, self.lengths = [], [], []

    def _allocate(self, caches: Sequence[Any]) -> None:
        mx = self._mx
        for cache in caches:
            _, heads, _, key_dim = cache.keys.shape
            value_dim = cache.values.shape[3]
            self.keys.append(mx.zeros((ROW_STEP, heads, TIME_STEP, key_dim), cache.keys.dtype))
            self.values.append(
                mx.zeros((ROW_STEP, heads, TIME_STEP, value_dim), cache.values.dtype)
            )

    def _reserve(self, rows: int, positions: int) -> None:
        """Grow the buffers to hold at least ``rows`` rows of ``positions``."""
        mx = self._mx
        have_rows, _, have_positions, _ = self.keys[0].shape
        more_rows = max(rows, 2 * have_rows) - have_rows if rows > have_rows else 0
        more_positions = 0
        if positions > have_positions:
            more_positions = -(-positions // TIME_STEP) * TIME_STEP - have_positions
        if not (more_rows or more_positions):
            return
        for buffers in (self.keys, self.values):
            for layer, buffer in enumerate(buffers):
                grown = buffer
                if more_rows:
                    room = mx.zeros((more_rows, *grown.shape[1:]), grown.dtype)
                    grown = mx.concatenate([grown, room])
                if more_positions:
                    size, heads, _, dim = grown.shape
                    room = mx.zeros((size, heads, more_positions, dim), grown.dtype)
                    grown = mx.concatenate([grown, room], axis=2)
                buffers[layer] = grown


class RowsLayer:
    """One layer's cache in a step over :class:`Rows`: what mlx-lm's
    attention layers call (``offset``, ``make_mask``, ``update_and_fetch``)."""

    def __init__(self, rows: Rows, layer: int) -> None:
        self._rows = rows
        self._layer = layer

    @property
    def offset(self) -> Any:
        return self._rows.step.offset

    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> Any:
        if window_size is not None:
            raise ValueError("the engine's KV rows hold no attention window")
        return self._rows.step.mask

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        return self._rows.write(self._layer, keys, values)


def copies(mx: Any, layers: list[tuple[Any, Any]], start: int, end: int) -> list[tuple[Any, Any]]:
    """Positions ``[start, end)`` of each layer's keys and values, copied
    (``mx.array`` of a slice copies it)."""
    return [(mx.array(k[:, :, start:end]), mx.array(v[:, :, start:end])) for k, v in layers]
