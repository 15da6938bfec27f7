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

As with the compiled decode step, any failure turns it off for good: the
engine prefills eagerly from then on, with a warning saying why.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from sluiceway.engines.torch_compiled import failure_summary

logger = logging.getLogger(__name__)

#: The shortest chunk that takes the graph (a size of one is specialised).
MIN_LENGTH = 2

Prefilled = tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]


class CompiledPrefill:
    """A fresh row's chunk: its last position's logits, and every layer's keys
    and values ``[1, heads, length, dim]``."""

    def __init__(self, model: Any, cache_keyword: str, *, backend: str = "inductor") -> None:
        from transformers import DynamicCache

        config = model.config

        def prefill(ids: torch.Tensor) -> Prefilled:
            cache: Any = DynamicCache(config=config)
            output = model(
                input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_keyword: cache}
            )
            keys: list[torch.Tensor] = [layer.keys for layer in cache.layers]
            values: list[torch.Tensor] = [layer.values for layer in cache.layers]
            return output.logits, keys, values

        self._compiled = torch.compile(prefill, backend=backend, dynamic=True)
        #: Why the graph was given up, once it has been.
        self.failure: str | None = None
        #: Chunks prefilled through the graph.
        self.runs = 0

    @property
    def active(self) -> bool:
        return self.failure is None

    def __call__(self, ids: torch.Tensor) -> Prefilled | None:
        """``ids`` ``[1, length]`` through the graph; None once it has failed."""
        try:
            result: Prefilled = self._compiled(ids)
        except Exception as error:  # any failure: the eager prefill still works
            self.failure = failure_summary(error)
            logger.warning("compiled prefill failed, prefilling eagerly: %s", self.failure)
            logger.debug("the compiled prefill's failure", exc_info=True)
            return None
        self.runs += 1
        return result
