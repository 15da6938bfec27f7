"""The mlx-lm engine: Apple silicon (Metal), or Linux through ``mlx[cpu]``.

Continuous batching uses mlx-lm's left-padded ``BatchKVCache``: a prefilled
slot keeps its own per-layer ``KVCache`` until its first decode, when it is
merged into the running batch (``extend``); a freed slot is filtered out of
the batch without touching the other rows.

A row that runs alone decodes on its own ``KVCache`` instead: the batched
cache builds a padding mask and keeps per-row offsets every step, which cost
~2% of a decode step at batch 1 on a 42M-parameter model. The lone row is
merged into a ``BatchKVCache`` when a second row joins, and taken back out
when the batch is down to one row again.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from sluiceway.engines.base import DecodeResult, EngineInfo, Logits, config_max_context
from sluiceway.engines.loader import ModelSource

#: Prompt positions per forward pass while prefilling, to bound peak memory.
PREFILL_STEP = 512

#: Environment for a process that runs this engine, where not already set.
#: When mlx's CPU backend runs on OpenBLAS (preloaded), OpenBLAS keeps its
#: idle threads spinning for 2**28 cycles after each call; with 2 cores, the
#: spinning takes the CPU that mlx's graph building and the server need between
#: matrix products. Sleeping after 2**8 cycles measured +14% decode at batch 1
#: on the benchmark model (the bare loop; unchanged at 4, 16 and 64). Only read
#: when OpenBLAS loads, so it must be in place before the process starts.
PROCESS_ENVIRONMENT = {"OPENBLAS_THREAD_TIMEOUT": "8"}


class MlxEngine:
    def __init__(self, source: ModelSource) -> None:
        import mlx.core as mx
        from mlx_lm.utils import load_model

        self._mx = mx
        self._model, config = load_model(source.path)
        self._pending: dict[int, list[Any]] = {}
        #: The running rows' per-layer caches: one ``KVCache`` per layer while
        #: a single row runs, a ``BatchKVCache`` per layer otherwise.
        self._batch: list[Any] | None = None
        self._order: list[int] = []
        device = mx.default_device()
        self._info = EngineInfo(
            name="mlx",
            device="gpu" if device == mx.gpu else "cpu",
            dtype=str(config.get("torch_dtype") or config.get("dtype") or "auto"),
            vocab_size=int(source.vocab_size),
            max_context=config_max_context(config),
        )

    @property
    def info(self) -> EngineInfo:
        return self._info

    def prefill(self, slot: int, token_ids: Sequence[int], *, all_logits: bool = False) -> Logits:
        from mlx_lm.models.cache import make_prompt_cache

        mx = self._mx
        if not token_ids:
            raise ValueError("prefill needs at least one token")
        cache = self._pending.get(slot)
        if cache is None:
            cache = self._pending[slot] = make_prompt_cache(self._model)
        pieces = []
        for start in range(0, len(token_ids), PREFILL_STEP):
            chunk = mx.array(token_ids[start : start + PREFILL_STEP])[None]
            logits = self._model(chunk, cache=cache)[0]
            if all_logits:
                pieces.append(logits.astype(mx.float32))
            else:
                mx.eval([c.state for c in cache])
        out = mx.concatenate(pieces) if all_logits else logits[-1:].astype(mx.float32)
        mx.eval(out)
        return np.asarray(out)

    def fork(self, source: int, target: int) -> None:
        self._pending[target] = [copy.deepcopy(layer) for layer in self._pending[source]]

    def decode(self, tokens: Mapping[int, int]) -> DecodeResult:
        return self.start_decode(tokens)()

    def start_decode(self, tokens: Mapping[int, int]) -> Callable[[], DecodeResult]:
        mx = self._mx
        # Checked before anything changes, so a bad call leaves the batch intact.
        missing = set(self._order) - tokens.keys()
        if missing:
            raise ValueError(f"decode must name every running slot; missing {sorted(missing)}")
        unknown = [s for s in tokens if s not in self._order and s not in self._pending]
        if unknown:
            raise ValueError(f"slots {unknown} were never prefilled")
        self._join_new(tokens)
        inputs = mx.array([tokens[slot] for slot in self._order])[:, None]
        logits = self._model(inputs, cache=self._batch)[:, -1, :].astype(mx.float32)
        mx.async_eval(logits)
        order = tuple(self._order)

        def finish() -> DecodeResult:
            mx.eval(logits)  # waits with the GIL released
            return DecodeResult(order, np.asarray(logits))

        return finish

    def undo_decode(self) -> None:
        if self._batch is None:
            raise ValueError("no decode to undo")
        for layer in self._batch:
            if layer.trim(1) != 1:
                raise ValueError("the cache cannot take back a position")

    def free(self, slot: int) -> None:
        if self._pending.pop(slot, None) is not None or slot not in self._order:
            return
        keep = [row for row, other in enumerate(self._order) if other != slot]
        self._order.pop(self._order.index(slot))
        if not keep:
            self._batch = None
            return
        assert self._batch is not None
        if len(keep) == 1:
            self._batch = [layer.extract(keep[0]) for layer in self._batch]
            return
        indices = self._mx.array(keep)
        for layer in self._batch:
            layer.filter(indices)

    def close(self) -> None:
        self._pending.clear()
        self._batch = None
        self._order.clear()

    def _join_new(self, tokens: Mapping[int, int]) -> None:
        from mlx_lm.models.cache import BatchKVCache

        joining = [slot for slot in tokens if slot not in self._order]
        if not joining:
            return
        caches = [self._pending.pop(slot) for slot in joining]
        if self._batch is None and len(caches) == 1:
            (self._batch,) = caches
        elif self._batch is None or len(self._order) == 1:
            # A lone row's plain caches are merged together with the new ones.
            if self._batch is not None:
                caches.insert(0, self._batch)
            self._batch = [
                BatchKVCache.merge(list(layer_caches))  # type: ignore[no-untyped-call]
                for layer_caches in zip(*caches, strict=True)
            ]
        else:
            for running, layer_caches in zip(self._batch, zip(*caches, strict=True), strict=True):
                running.extend(BatchKVCache.merge(list(layer_caches)))  # type: ignore[no-untyped-call]
        self._order.extend(joining)
