"""The transformers engine's decode step, compiled with ``torch.compile``.

Theory of operation. On a small model an eager decode step is mostly Python:
a call per module, a dispatch per op (1.56 ms a step on the tiny default
model, a quarter of it in transformers' wrappers). ``torch.compile`` traces
the step once into one graph and Inductor writes it as C++ loops, so a step
costs one Python call. A graph has fixed shapes, and a decode step's shapes
change in two ways:

* the number of rows: the batch is padded up to a *bucket* (1, 2, 4, 8, ...),
  as vLLM pads to its CUDA-graph sizes; each bucket is its own graph,
  compiled the first time a batch of that size decodes. A padding row feeds
  token 0, attends only to the position it writes, and writes it in a row
  of the buffer that no running row owns (finite values, as the buffer's
  layout requires); its logits are dropped.
* the past: it grows by one position a step, and the buffers holding it
  are reallocated longer now and then (new strides). The graph takes the
  whole :class:`~sluiceway.engines.torch_engine.KVRows` buffers and attends
  over their first ``T`` positions, ``T`` being the step's end rounded up
  to the buffer's time step; the buffer's length and ``T`` are symbolic
  sizes (``mark_dynamic``, without duck shapes, since the two are often
  equal when a graph is traced), so a longer past or buffer reuses the
  graph. The buffer keeps a spare time step past ``T``: a graph traced with
  ``T`` shorter than the buffer takes the two being equal for another case
  (a second graph). Positions outside a row's ``[first, end]`` are masked
  exactly as in the eager step (the mask is ready-made and additive; a
  masked score contributes nothing).

The new keys and values are written with ``index_copy_`` at a position held
in a tensor (transformers' ``StaticCache`` does the same for its compiled
path), so the position is data, not a constant of the graph.

Frozen weights (``frozen=True``, bfloat16 on the CPU). A decode step's
matrix products have a few rows each, and oneDNN's product costs 20-45 µs
a call whatever its size (a step of the 42M benchmark model makes 57 of
them). With Inductor's ``freezing`` the graph takes the weights for
constants, and with its C++ GEMM template (``max_autotune``, backend
``CPP``) it writes each product as a loop of its own over a copy of the
matrix it packed for it, fused with the step's elementwise work: measured
1.40-1.56x faster than the prepacked oneDNN step at 1-16 rows on the 42M
model (docs/engines.md). Each graph holds its own copy of every linear
layer's matrix, so the buckets from 2 up share one graph whose batch size is
symbolic (the one-row graph is its own: torch specialises a size of one):
two copies in all. Inductor never takes such a graph from its on-disk
cache (the weights it packs are oneDNN tensors, which it cannot store), so
it compiles at every start. Where it fails to compile, the step falls back
to the graphs without frozen weights.

Anything else that fails while compiling or running a graph turns the
compiled step off for good and the engine decodes eagerly from then on,
with a warning saying why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx.experimental import _config as shapes_config
from transformers.cache_utils import Cache

from sluiceway.engines.torch_packed import ReadyLayer
from sluiceway.engines.torch_prepack import frozen_graph

logger = logging.getLogger(__name__)

#: ``--compile``'s choices (auto: :mod:`~sluiceway.engines.compile_choice`).
MODES = ("off", "on", "auto")
#: Row counts of the compiled graphs: a batch is padded up to the next one.
BUCKETS = (1, 2, 4, 8, 16, 32, 64)

#: Inductor's options for a step with frozen weights: its own C++ matrix
#: products (``freezing`` itself is set around each call, by
#: :func:`~sluiceway.engines.torch_prepack.frozen_graph`).
FROZEN_OPTIONS: dict[str, str | int | bool | Callable[..., Any]] = {
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP",
}

#: One step's graph: ids ``[B, 1]``, positions ``[B, 1]``, additive mask
#: ``[B, 1, 1, T]``, the write position ``[1]``, keys and values per layer
#: ``[B, heads, T, dim]`` -> logits ``[B, vocab]``.
StepFunction = Callable[..., torch.Tensor]


def bucket_for(rows: int, buckets: Sequence[int] = BUCKETS) -> int | None:
    """The smallest bucket that holds ``rows`` rows; None past the largest."""
    return next((bucket for bucket in buckets if bucket >= rows), None)


class _IndexLayer(ReadyLayer):  # type: ignore[no-untyped-call]
    """One layer's window, written at a position given as a tensor."""

    is_compileable = True

    def __init__(
        self, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor, time: int
    ) -> None:
        super().__init__()
        self.keys, self.values, self.index = keys, values, index
        self._keys, self._values = keys, values  # typed: never None
        self._time = time

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._keys.index_copy_(2, self.index, key_states)
        self._values.index_copy_(2, self.index, value_states)
        return self._keys[:, :, : self._time], self._values[:, :, : self._time]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._time, 0

    def get_seq_length(self) -> int:
        return self._time

    def get_max_length(self) -> int:
        return -1


class _IndexCache(Cache):
    def __init__(
        self,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        index: torch.Tensor,
        time: int,
    ) -> None:
        super().__init__(
            layers=[_IndexLayer(k, v, index, time) for k, v in zip(keys, values, strict=True)]
        )


def step_function(model: Any, cache_keyword: str) -> StepFunction:
    """The eager decode step that :func:`torch.compile` traces."""

    def step(
        ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        index: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
    ) -> torch.Tensor:
        output = model(
            input_ids=ids,
            position_ids=positions,
            # A mapping by layer type: transformers then builds no mask of its own.
            attention_mask={"full_attention": mask},
            use_cache=True,
            logits_to_keep=1,
            **{cache_keyword: _IndexCache(keys, values, index, mask.shape[-1])},
        )
        logits: torch.Tensor = output.logits[:, -1, :]
        return logits

    return step


def failure_summary(error: BaseException) -> str:
    """Why a graph was given up, in a line: the error's type and the first two
    non-blank lines of its message (Inductor's run to dozens)."""
    lines = [line for line in str(error).splitlines() if line.strip()][:2]
    return " ".join([type(error).__name__ + ":", *lines])


class CompiledStep:
    """The compiled decode step of one model, one graph per bucket, with the
    eager step as the fallback (``failure`` says why it was taken)."""

    def __init__(
        self,
        model: Any,
        cache_keyword: str,
        *,
        buckets: Sequence[int] = BUCKETS,
        backend: str | Callable[..., Any] = "inductor",
        frozen: bool = False,
    ) -> None:
        self.buckets = tuple(buckets)
        #: Why the compiled step was given up, once it has been.
        self.failure: str | None = None
        #: Compiled steps run, by bucket.
        self.steps: dict[int, int] = dict.fromkeys(self.buckets, 0)
        # Every bucket is a recompile of the same function (and so is every
        # engine's model in one process, as in the tests): room for them all.
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, 4 * len(BUCKETS))

        def compiled(options: dict[str, Any] | None = None) -> StepFunction:
            step = step_function(model, cache_keyword)
            return torch.compile(
                step, backend=backend, fullgraph=True, dynamic=False, options=options
            )

        self._compiled = compiled()
        #: The graphs with frozen weights, until they fail (None: not asked, or failed).
        self._frozen = compiled(FROZEN_OPTIONS) if frozen else None

    def limit(self, buckets: Sequence[int]) -> None:
        """Compile and run only ``buckets`` (a prefix of :attr:`buckets`);
        larger batches decode eagerly."""
        if tuple(buckets) != self.buckets[: len(buckets)]:
            raise ValueError(f"{tuple(buckets)} is not a prefix of the buckets {self.buckets}")
        self.buckets = tuple(buckets)

    @property
    def frozen(self) -> bool:
        """Whether the graphs freeze the weights (Inductor's own matrix products)."""
        return self._frozen is not None

    @property
    def active(self) -> bool:
        return self.failure is None

    def bucket(self, rows: int) -> int | None:
        """The bucket a batch of ``rows`` runs in; None: decode it eagerly."""
        return bucket_for(rows, self.buckets) if self.active else None

    def __call__(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        index: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
    ) -> torch.Tensor | None:
        """The step's logits, or None once compiling or running has failed."""
        for tensor in (*keys, *values):
            torch._dynamo.mark_dynamic(tensor, 2)
        torch._dynamo.mark_dynamic(mask, 3)
        inputs = (ids, positions, mask, index, keys, values)
        logits = self._run_frozen(inputs) if self._frozen is not None else None
        if logits is None:
            try:
                logits = self._run(self._compiled, inputs)
            except Exception as error:  # any failure: the eager step still works
                self.failure = failure_summary(error)
                logger.warning("compiled decode step failed, decoding eagerly: %s", self.failure)
                logger.debug("the compiled decode step's failure", exc_info=True)
                return None
        self.steps[ids.shape[0]] += 1
        return logits

    def _run_frozen(self, inputs: tuple[Any, ...]) -> torch.Tensor | None:
        """The step through the graphs with frozen weights; None, and those
        graphs given up for good, where they fail."""
        assert self._frozen is not None
        rows = inputs[0].shape[0]
        if rows > 1:  # one graph for every bucket from 2 up: one copy of the weights
            ids, positions, mask, _, keys, values = inputs
            for tensor in (ids, positions, mask, *keys, *values):
                torch._dynamo.mark_dynamic(tensor, 0)
        try:
            with frozen_graph():
                return self._run(self._frozen, inputs)
        except Exception as error:
            self._frozen = None
            logger.warning(
                "compiled decode step with frozen weights failed, compiling it without: %s",
                failure_summary(error),
            )
            logger.debug("the frozen decode step's failure", exc_info=True)
            return None

    @staticmethod
    def _run(compiled: StepFunction, inputs: tuple[Any, ...]) -> torch.Tensor:
        # Without duck shapes: the window and the capacity are often equal
        # when a graph is traced, and must not be taken to be always.
        with shapes_config.patch(use_duck_shape=False):  # type: ignore[attr-defined]
            logits: torch.Tensor = compiled(*inputs)
        return logits
