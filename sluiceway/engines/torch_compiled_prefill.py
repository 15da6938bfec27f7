"""A new prompt's first chunk, prefilled through one compiled graph.

A request's time to first token is mostly its prefill, and an eager prefill
pays what an eager decode step pays: a Python call per module and one
kernel per elementwise op (in bfloat16 on the CPU, each a pass that converts
to float32 and back). Inductor fuses those ops. Measured on the 42M benchmark
model (bfloat16, prepacked weights, 2 threads): a 64-token prefill took 20.6
ms eager against 14.5 compiled, 115 tokens 28.7 against 21.8, 512 tokens 88.8
against 74.2.

One graph serves every length (``dynamic=True``): the chunk runs as a fresh
forward pass over a transformers ``DynamicCache``, whose keys and values
are then copied into the row's own buffers. So it applies only to a row with
no past (a new prompt's first chunk; a prefix restored from the cache, and
the chunks after the first, stay eager), and to chunks of at least two
tokens (torch specialises a size of one). Chunks packed into a decode step
(:mod:`~sluiceway.engines.torch_packed`) stay eager too.

Several new prompts prefilled together with no decode (a burst of arrivals,
or the later passes of a step that prefills more than one pass holds) go
through a second graph as one batch (:meth:`CompiledPrefill.rows`): each row
padded on the right to the longest, which is exact, since a causal mask
keeps every real position from seeing the padding after it, and each row's
logits taken at its own last position. Measured on the 42M benchmark model
(2 threads, ``OMP_WAIT_POLICY=PASSIVE``, the engine child's setting then,
two processes): eight 64-token prompts took 80 and 138 ms packed eagerly into one
pass, against 53 and 88 ms through this graph, and 123 and 194 ms through the
one-row graph one by one.

As with the compiled decode step, any failure turns it off for good: the
engine prefills eagerly from then on, with a warning saying why.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from sluiceway.engines.torch_compiled import failure_summary

logger = logging.getLogger(__name__)

#: The shortest chunk that takes the graph (a size of one is specialised).
MIN_LENGTH = 2

Prefilled = tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]

#: Padding a batch may add, as a share of its real tokens: past it the
#: chunks are packed eagerly instead (the padding is computed and thrown away).
MAX_PADDING = 0.25


class CompiledPrefill:
    """A fresh row's chunk: its last position's logits, and every layer's keys
    and values ``[1, heads, length, dim]``."""

    def __init__(self, model: Any, cache_keyword: str, *, backend: str = "inductor") -> None:
        from transformers import DynamicCache

        config = model.config

        def forward(ids: torch.Tensor, keep: int | torch.Tensor) -> Prefilled:
            cache: Any = DynamicCache(config=config)
            output = model(
                input_ids=ids, use_cache=True, logits_to_keep=keep, **{cache_keyword: cache}
            )
            keys: list[torch.Tensor] = [layer.keys for layer in cache.layers]
            values: list[torch.Tensor] = [layer.values for layer in cache.layers]
            return output.logits, keys, values

        # Two entry points, so that each keeps its own graph and guards.
        def prefill(ids: torch.Tensor) -> Prefilled:
            return forward(ids, 1)

        def prefill_rows(ids: torch.Tensor, keep: torch.Tensor, which: torch.Tensor) -> Prefilled:
            logits, keys, values = forward(ids, keep)
            return logits[torch.arange(ids.shape[0]), which], keys, values

        self._compiled = torch.compile(prefill, backend=backend, dynamic=True)
        self._compiled_rows = torch.compile(prefill_rows, backend=backend, dynamic=True)
        #: Why the graph was given up, once it has been.
        self.failure: str | None = None
        #: Why the batch graph (:meth:`rows`) was given up: a model that takes
        #: no per-row logit positions loses it, not the one-row graph.
        self.rows_failure: str | None = None
        #: Chunks prefilled through the graph.
        self.runs = 0

    @property
    def active(self) -> bool:
        return self.failure is None

    @property
    def rows_active(self) -> bool:
        return self.failure is None and self.rows_failure is None

    def __call__(self, ids: torch.Tensor) -> Prefilled | None:
        """``ids`` ``[1, length]`` through the graph; None once it has failed."""
        try:
            result: Prefilled = self._compiled(ids)
        except Exception as error:  # any failure: the eager prefill still works
            self.failure = _give_up(error)
            return None
        self.runs += 1
        return result

    def rows(self, ids: Sequence[Sequence[int]], device: torch.device) -> Prefilled | None:
        """Several fresh chunks (at least two, each of :data:`MIN_LENGTH` or
        more) as one batch: each one's last logits ``[rows, vocab]``, and
        every layer's keys and values ``[rows, heads, longest, dim]``, of
        which row ``i``'s first ``len(ids[i])`` positions are its own. None
        once this graph has failed (the one-row graph may still work)."""
        longest = max(len(chunk) for chunk in ids)
        # Any id pads: no real position attends to the padding after it.
        padded = [[*chunk, *[0] * (longest - len(chunk))] for chunk in ids]
        # The logits of every row at each distinct last position (a few: a
        # batch is cut to a quarter of padding), of which each row takes its
        # own. One position per row would be cheaper, but transformers'
        # per-row form (a 2D position tensor) pins the batch size in the graph.
        keep = sorted({len(chunk) - 1 for chunk in ids})
        which = [keep.index(len(chunk) - 1) for chunk in ids]
        try:
            logits, keys, values = self._compiled_rows(
                torch.tensor(padded, device=device),
                torch.tensor(keep, device=device),
                torch.tensor(which, device=device),
            )
        except Exception as error:
            self.rows_failure = _give_up(error)
            return None
        self.runs += len(ids)
        return logits, keys, values


def _give_up(error: Exception) -> str:
    """Say why a graph is given up for good; the eager prefill still works."""
    summary = failure_summary(error)
    logger.warning("compiled prefill failed, prefilling eagerly: %s", summary)
    logger.debug("the compiled prefill's failure", exc_info=True)
    return summary


def fits_rows(lengths: Sequence[int]) -> bool:
    """Whether chunks of these lengths take :meth:`CompiledPrefill.rows`."""
    if len(lengths) < 2 or min(lengths) < MIN_LENGTH:
        return False
    padding = max(lengths) * len(lengths) - sum(lengths)
    return padding <= MAX_PADDING * sum(lengths)
