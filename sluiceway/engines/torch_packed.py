"""One forward pass that decodes the running rows and prefills prompt chunks.

On a small model most of a forward pass is fixed cost: a Python call per
module, a kernel launch per op, a thread-pool wake-up per matmul. A 64-token
prefill of the tiny default model took 4.7 ms alone, against 2.9 ms for a
1-token one, beside a 3.8 ms decode step of 16 rows. Run inside the decode
step, the chunk costs only its own arithmetic; this is what continuous
batching calls mixing prefills into decode steps.

The running rows and the chunks have different query lengths, so they are
packed along the sequence axis of one batch-of-one input: ``[rows..., chunk
1..., chunk 2...]``, with each token's own position id (RoPE is applied per
token). Everything but attention works token by token and cannot tell the
difference. Attention is the exception, and :func:`attend` splits it again:

* the decode queries attend over the running batch's window, with its
  padding mask, as a decode step does;
* each chunk's queries attend over their own one-row cache, causally.

The split travels to the attention function as a keyword argument of the
model call (transformers hands unknown keywords down to the attention
interface); the cache's layers write each part's keys where that part's
rows live. Only models whose every layer attends over the whole past take
this path: a sliding window would need its own masks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

#: The keyword of the model call that carries the split.
KEYWORD = "sluiceway_packed"


class Store(Protocol):
    """Where a cache layer's writes go: the engine's ``KVRows``, or a packed pass."""

    @property
    def window(self) -> int: ...

    def write(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class Rows(Store, Protocol):
    """What a packed pass needs of the engine's ``KVRows`` (named by shape, so
    that this module does not import the engine that imports it)."""

    rows: int

    def advance(self, length: int) -> None: ...


@dataclass(slots=True)
class Packed:
    """The layout of one packed forward pass, and each layer's keys and values
    (set by :meth:`write`, read by :func:`attend`)."""

    #: The running batch, when the pass decodes it.
    batch: Rows | None
    #: The running batch's additive decode mask ``[rows, 1, 1, window]``, or None.
    decode_mask: torch.Tensor | None
    chunks: Sequence[Rows]
    lengths: Sequence[int]
    #: By layer: the batch's window (if it decodes), then each chunk's, as
    #: ``(keys, values)``.
    views: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    #: Layers whose attention went through :func:`attend` (a check that the
    #: keyword reached every one).
    attended: int = 0

    @property
    def rows(self) -> int:
        return self.batch.rows if self.batch is not None else 0

    @property
    def window(self) -> int:
        """No past of its own: each part's is in its cache (see :func:`attend`)."""
        return 0

    def write(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one layer's new keys and values, ``[1, heads, tokens, dim]``, in place."""
        rows = self.rows
        views = []
        if self.batch is not None:  # the decode part: token i is row i's next position
            views.append(
                self.batch.write(
                    layer,
                    keys[0, :, :rows, None].transpose(0, 1),
                    values[0, :, :rows, None].transpose(0, 1),
                )
            )
        offset = rows
        for chunk, length in zip(self.chunks, self.lengths, strict=True):
            stop = offset + length
            views.append(chunk.write(layer, keys[:, :, offset:stop], values[:, :, offset:stop]))
            offset = stop
        self.views[layer] = views
        return keys, values

    def advance(self) -> None:
        if self.batch is not None:
            self.batch.advance(1)
        for chunk, length in zip(self.chunks, self.lengths, strict=True):
            chunk.advance(length)


def attend(
    packed: Packed, layer: int, query: torch.Tensor, scaling: float | None, grouped: bool
) -> torch.Tensor:
    """Attention of a packed pass, ``[1, tokens, heads, dim]`` as transformers expects."""
    views = packed.views[layer]
    rows = packed.rows
    sdpa = torch.nn.functional.scaled_dot_product_attention
    parts = []
    if packed.batch is not None:
        keys, values = views[0]
        views = views[1:]
        decode_query = query[0, :, :rows, None].transpose(0, 1)
        attended = sdpa(
            decode_query,
            keys,
            values,
            attn_mask=packed.decode_mask,
            scale=scaling,
            enable_gqa=grouped,
        )
        parts.append(attended.reshape(1, rows, query.shape[1], query.shape[3]))
    offset = rows
    for (keys, values), length in zip(views, packed.lengths, strict=True):
        stop = offset + length
        past = keys.shape[2] - length
        mask = None
        if past:  # a cached or earlier-chunk prefix: causal with an offset
            mask = torch.ones(length, keys.shape[2], dtype=torch.bool, device=keys.device).tril(
                diagonal=past
            )
        attended = sdpa(
            query[:, :, offset:stop],
            keys,
            values,
            attn_mask=mask,
            is_causal=not past and length > 1,
            scale=scaling,
            enable_gqa=grouped,
        )
        parts.append(attended.transpose(1, 2))
        offset = stop
    packed.attended += 1
    return torch.cat(parts, dim=1).contiguous()


class ReadyLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]
    """A full-attention cache layer whose buffers exist before the forward:
    transformers' lazy initialisation is a no-op for it."""

    is_sliding = False

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None


class _StoreLayer(ReadyLayer):  # type: ignore[no-untyped-call]
    """One layer of a :class:`Store` seen through transformers' cache-layer API."""

    def __init__(self, store: Store, layer: int) -> None:
        super().__init__()
        self._store = store
        self._layer = layer

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._store.write(self._layer, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._store.window + query_length, 0

    def get_seq_length(self) -> int:
        return self._store.window

    def get_max_length(self) -> int:
        return -1


class StoreCache(Cache):
    """The transformers ``Cache`` a model writes through, over a :class:`Store`."""

    def __init__(self, store: Store, layers: int) -> None:
        super().__init__(layers=[_StoreLayer(store, i) for i in range(layers)])
