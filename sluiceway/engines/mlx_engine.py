"""The mlx-lm engine: Apple silicon (Metal), or Linux through ``mlx[cpu]``.

Theory of operation. A slot prefills into mlx-lm's own per-layer ``KVCache``
list. The first decode that names it copies its keys and values into the next
free row of the running batch (:class:`~sluiceway.engines.mlx_rows.Rows`): per layer, one keys buffer and
one values buffer ``[rows, kv_heads, capacity, head_dim]`` that the engine
owns. Every row's positions start at 0, so rows of different lengths sit side
by side, each with a tail past its length that is never read.

A decode step hands the model one :class:`~sluiceway.engines.mlx_rows.RowsLayer` per layer, the cache
object mlx-lm's attention calls: ``offset`` for RoPE, ``make_mask`` for the
attention mask, ``update_and_fetch`` to write the step's keys and values and
read the window back. When every row holds as many positions (a lone row,
rows that joined together), that is a plain ``KVCache``'s step: one slice
written in place, one RoPE offset, no mask. Otherwise each row's new position
is written at its own length (a scatter, in place), RoPE takes an array of
per-row offsets, and a boolean mask hides each row's tail; the window read is
the longest row's. (mlx-lm's ``BatchKVCache``, which this replaces, builds
its padding mask and advances a per-row offset array in every layer at every
step, even for rows of equal length, and copies the whole batch when a row
joins or leaves: docs/engines.md.)

A freed row is overwritten by the last row (a copy of that one row, see
:meth:`~sluiceway.engines.mlx_rows.Rows._move`), so the running rows stay the first rows of the buffers
and nothing else moves. The
buffers grow by doubling their rows and by 256 positions at a time (copies of
the whole, amortised, as ``KVCache`` grows), and are kept while the engine
idles (up to 256 MiB), until :meth:`MlxEngine.release_memory`.

A greedy step is queued ahead (:meth:`MlxEngine.start_decode_chained`, as
mlx-lm's own generator does): with a step's graph built and queued, the
engine builds the next one at once, each row fed the argmax of the step
before, still on the device, and queues it too. The device then computes that
step while the host reads this one's logits, the server plans, and the next
graph is built, instead of idling through all of that. The next
:meth:`~MlxEngine.start_decode` takes the queued step over when it names the
same rows with those tokens; otherwise it is trimmed off the rows first, as
if it had never been built (docs/architecture.md, "Decoding ahead").

Prefix-cache entries are plain arrays ``[1, kv_heads, length, head_dim]`` per
layer, copied out of a slot's cache (never views of it: a view would keep the
slot's whole buffer alive and stop mlx from updating it in place). A restored
slot starts as a ``KVCache`` holding their concatenation; its first update
reallocates, so the entries themselves are never written to.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sluiceway.engines.base import (
    CacheOp,
    DecodeResult,
    DropKV,
    EngineInfo,
    KeepKV,
    Logits,
    SplitKV,
    config_max_context,
)
from sluiceway.engines.blas import OpenBlasThreads, find_openblas
from sluiceway.engines.loader import ModelSource
from sluiceway.engines.memory import host_available_bytes
from sluiceway.engines.mlx_rows import Rows, copies

logger = logging.getLogger(__name__)

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


#: Said at start-up where mlx computes on a Linux CPU without OpenBLAS. The
#: figures: the large benchmark model (Qwen3 512x8), 2 cores, 29 Nov; decode
#: steps at batch 1 took 46.8 ms against 31.7.
REFERENCE_BLAS_WARNING = (
    "mlx computes its matrix products with the reference BLAS bundled with mlx[cpu] "
    "(no OpenBLAS in this process): a 1,024-token prefill of a 42M-parameter model took "
    "44 s on 2 cores, against 2.3 s with OpenBLAS. Start the server with "
    "LD_PRELOAD=/path/to/libopenblas.so.0 (Debian: apt-get install libopenblas0-pthread, "
    "then /usr/lib/<arch>/openblas-pthread/libopenblas.so.0), or use --engine transformers"
)


@dataclass(frozen=True, slots=True)
class _Queued:
    """A decode step built and queued ahead of its call."""

    #: The running rows it decodes, in the batch's order.
    order: tuple[int, ...]
    #: Each row's input: its argmax in the step before (``[rows]``, lazy).
    tokens: Any
    #: Its logits, ``[rows, vocab]``, float32 (lazy).
    logits: Any

    def rows(self, mx: Any, keep: list[int]) -> _Queued:
        """The same step, with only the rows at ``keep``, in that order."""
        indices = mx.array(keep)
        order = tuple(self.order[i] for i in keep)
        return _Queued(order, self.tokens[indices], self.logits[indices])


def unhonoured_window(config: Mapping[str, Any], model_args: Any) -> int | None:
    """The attention window ``config`` asks for when mlx-lm's model class
    would not apply it: Qwen2 and Qwen3 (no window in mlx-lm, one in Hugging
    Face's classes), or mlx-lm's Llama reading a Mistral window with no
    ``layer_types``. Such a model attends over everything; up to the window
    that is the same attention, past it the answers differ."""
    window = config.get("sliding_window")
    if not isinstance(window, int) or window <= 0:
        return None
    # Qwen2/3 carry a window that is off unless asked for; Mistral's is on
    # when given; layer_types, where present, say which layers use it.
    if not config.get("use_sliding_window", True):
        return None
    types = config.get("layer_types")
    if isinstance(types, list) and all(kind == "full_attention" for kind in types):
        return None
    names = (
        {field.name for field in dataclasses.fields(model_args)}
        if dataclasses.is_dataclass(model_args)
        else set()
    )
    if "sliding_window_pattern" in names:  # Gemma's: windows by their own pattern
        return None
    if "layer_types" in names:  # mlx-lm's Llama: windows only where layer_types say
        return None if isinstance(types, list) else window
    return None if "sliding_window" in names else window


def _max_context(config: Mapping[str, Any], model: Any) -> int:
    """The longest sequence served: the config's, or a window mlx-lm would
    ignore (a longer prompt is then refused as too long, not answered wrong)."""
    longest = config_max_context(config)
    window = unhonoured_window(config, getattr(model, "args", None))
    if window is None or window >= longest:
        return longest
    logger.warning(
        "mlx-lm's %s attends over the whole sequence where this model attends over a "
        "%d-token window: the context is held to %d tokens (--engine transformers "
        "honours the window)",
        config.get("model_type", "model"),
        window,
        window,
    )
    return window


class MlxEngine:
    def __init__(
        self,
        source: ModelSource,
        *,
        queue_ahead: bool = True,
        threads: int = 0,
        blas: OpenBlasThreads | None = None,
    ) -> None:
        """``queue_ahead=False``: :meth:`start_decode_chained` queues nothing
        (what ``bench/mlx_overlap.py --engine`` (removed; ``git show deea191:bench/mlx_overlap.py``) compares against).

        ``threads`` (``--engine-threads``; 0: OpenBLAS's own count) applies
        where the CPU backend runs on OpenBLAS (:mod:`sluiceway.engines.blas`);
        ``blas`` stands in for the OpenBLAS found in the process."""
        import mlx.core as mx
        from mlx_lm.utils import load_model

        self._mx = mx
        self._model, config = load_model(source.path)
        self._pending: dict[int, list[Any]] = {}
        #: The running rows' keys and values; ``_order[i]`` is row ``i``'s slot.
        self._rows = Rows(mx, _attention_layers(self._model, config))
        self._order: list[int] = []
        #: The step queued ahead, if any; its position is in the rows.
        self._queued: _Queued | None = None
        #: Queued steps taken over by the call they foresaw, and trimmed off.
        self.queued_taken = 0
        self.queued_dropped = 0
        #: Prefix-cache entries, by the ids the scheduler's index gives them:
        #: per layer, keys and values.
        self._entries: dict[int, list[tuple[Any, Any]]] = {}
        on_gpu = mx.default_device() == mx.gpu
        self._queue_ahead = queue_ahead
        self._info = EngineInfo(
            name="mlx",
            device="gpu" if on_gpu else "cpu",
            dtype=str(config.get("torch_dtype") or config.get("dtype") or "auto"),
            vocab_size=int(source.vocab_size),
            max_context=_max_context(config, self._model),
            kv_bytes_per_token=self._bytes_per_token(),
            free_memory_bytes=_free_memory(mx, on_gpu),
            threads=self._blas_count(on_gpu, threads, blas),
        )

    @staticmethod
    def _blas_count(on_gpu: bool, threads: int, blas: OpenBlasThreads | None) -> int:
        """OpenBLAS's thread count when the CPU backend runs on it (0: no
        OpenBLAS), with the count asked for applied.

        The count is not tuned by timing, as torch's is: on 2 cores, in
        turns with OpenBLAS's own count, a tuning build read +0.04 of the
        bare loop at concurrency 16 on the tiny model and -0.08 on the large
        one, its checks' steps on the slower count costing the large model
        about what one thread gains the tiny one (bench/pertoken-results.md as of deea191,
        "Twentieth part")."""
        found = None if on_gpu else blas or find_openblas()
        if found is None:
            if not on_gpu and sys.platform == "linux":
                logger.warning(REFERENCE_BLAS_WARNING)
            if threads:
                logger.warning(
                    "the mlx engine ignores --engine-threads %d: no OpenBLAS in this process",
                    threads,
                )
            return 0
        # Without --engine-threads, OpenBLAS has read its own variables as it
        # loaded; nothing is tuned, so there is nothing to set.
        if threads:
            found.set_count(threads)
        count = found.count()
        logger.info("mlx engine: OpenBLAS on %d threads", count)
        return count

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def chains(self) -> bool:
        return self._queue_ahead

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
        return self._start(tokens, chain=False)

    def start_decode_chained(self, tokens: Mapping[int, int]) -> Callable[[], DecodeResult]:
        """:meth:`start_decode`, then the step after it queued at once, each
        row fed its argmax (see the module's docstring), when :attr:`chains`."""
        return self._start(tokens, chain=self._queue_ahead)

    def _start(self, tokens: Mapping[int, int], *, chain: bool) -> Callable[[], DecodeResult]:
        mx = self._mx
        # Checked before anything changes, so a bad call leaves the batch intact.
        missing = set(self._order) - tokens.keys()
        if missing:
            raise ValueError(f"decode must name every running slot; missing {sorted(missing)}")
        unknown = [s for s in tokens if s not in self._order and s not in self._pending]
        if unknown:
            raise ValueError(f"slots {unknown} were never prefilled")
        logits = self._take_queued(tokens)
        if logits is None:
            self._join_new(tokens)
            logits = self._queue_step(mx.array([tokens[slot] for slot in self._order])[:, None])
        order = tuple(self._order)
        if chain:
            picks = mx.argmax(logits, axis=-1)
            # Its own target, so that reading it waits for it alone, not for
            # the step queued on it.
            mx.async_eval(picks)
            self._queued = _Queued(order, picks, self._queue_step(picks[:, None]))

        def finish() -> DecodeResult:
            mx.eval(logits)  # waits with the GIL released
            return DecodeResult(order, np.asarray(logits))

        return finish

    def _queue_step(self, inputs: Any) -> Any:
        """Build one decode step of the running batch and start computing it."""
        mx = self._mx
        caches = self._rows.begin(inputs.shape[1])
        logits = self._model(inputs, cache=caches)[:, -1, :].astype(mx.float32)
        mx.async_eval(logits)
        return logits

    def _take_queued(self, tokens: Mapping[int, int]) -> Any:
        """The queued step's logits when ``tokens`` is that step (the same rows,
        each with its argmax); otherwise its position leaves the caches."""
        queued, self._queued = self._queued, None
        if queued is None:
            return None
        if len(tokens) == len(queued.order):
            fed = np.asarray(queued.tokens).tolist()
            if all(
                tokens.get(slot) == token for slot, token in zip(queued.order, fed, strict=True)
            ):
                self.queued_taken += 1
                return queued.logits
        self.queued_dropped += 1
        self._trim(1)
        return None

    def _trim(self, positions: int) -> None:
        self._rows.trim(positions)

    def undo_decode(self) -> None:
        if not self._order:
            raise ValueError("no decode to undo")
        # The queued step's position goes too: it followed the one undone.
        self._trim(2 if self._queued is not None else 1)
        self._queued = None

    def free(self, slot: int) -> None:
        if self._pending.pop(slot, None) is not None or slot not in self._order:
            return
        kept = self._rows.leave(self._order.index(slot))
        self._order = [self._order[row] for row in kept]
        if not kept:
            self._queued = None
            self._rows.idle()
        elif self._queued is not None:  # the other rows' queued step stays under way
            self._queued = self._queued.rows(self._mx, kept)

    def restore(self, slot: int, entries: Sequence[int], length: int) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        mx = self._mx
        if slot in self._order or slot in self._pending:
            raise ValueError(f"slot {slot} is in use; free it before restoring into it")
        parts = [self._entry(entry) for entry in entries]
        if sum(part[0][0].shape[2] for part in parts) < length:
            raise ValueError(f"the cached entries hold fewer than {length} positions")
        cache = make_prompt_cache(self._model)
        for layer, layer_cache in enumerate(cache):
            keys = mx.concatenate([part[layer][0] for part in parts], axis=2)
            values = mx.concatenate([part[layer][1] for part in parts], axis=2)
            layer_cache.state = (keys[..., :length, :], values[..., :length, :], length)
        self._pending[slot] = cache

    def cache_op(self, op: CacheOp) -> None:
        mx = self._mx
        if isinstance(op, KeepKV):
            pieces = self._positions(op.slot, op.start, op.end)
        elif isinstance(op, SplitKV):
            whole = self._entry(op.entry)
            if op.head is not None:
                self._entries[op.head] = copies(mx, whole, 0, op.at)
            pieces = copies(mx, whole, op.at, whole[0][0].shape[2])
        elif isinstance(op, DropKV):
            self._entries.pop(op.entry, None)
            return
        mx.eval(pieces)
        self._entries[op.entry] = pieces

    def release_memory(self) -> None:
        if not self._order:
            self._rows.release()
        # mlx keeps freed buffers in a cache of its own for reuse.
        self._mx.clear_cache()

    def close(self) -> None:
        self._pending.clear()
        self._order.clear()
        self._queued = None
        self._rows.release()
        self._entries.clear()

    def _entry(self, entry: int) -> list[tuple[Any, Any]]:
        found = self._entries.get(entry)
        if found is None:
            raise ValueError(f"no prefix-cache entry {entry}")
        return found

    def _positions(self, slot: int, start: int, end: int) -> list[tuple[Any, Any]]:
        """Copies of ``slot``'s keys and values at its positions ``[start, end)``."""
        if slot in self._order:
            return self._rows.span(self._order.index(slot), start, end)
        if slot not in self._pending:
            raise ValueError(f"slot {slot} is not in use")
        caches = self._pending[slot]
        if not 0 <= start < end <= caches[0].size():
            raise ValueError(f"the slot holds no positions {start}..{end}")
        return copies(self._mx, [(c.keys, c.values) for c in caches], start, end)

    def _bytes_per_token(self) -> int:
        """Per token, the bytes every layer's keys and values take."""
        from mlx_lm.models.cache import make_prompt_cache

        mx = self._mx
        cache = make_prompt_cache(self._model)
        self._model(mx.array([[0]]), cache=cache)
        mx.eval([c.state for c in cache])
        return sum(
            c.keys.nbytes // c.keys.shape[2] + c.values.nbytes // c.values.shape[2] for c in cache
        )

    def _join_new(self, tokens: Mapping[int, int]) -> None:
        joining = [slot for slot in tokens if slot not in self._order]
        for slot in joining:
            self._rows.join(self._pending.pop(slot))
        self._order.extend(joining)


def _attention_layers(model: Any, config: Mapping[str, Any]) -> int:
    """How many layers the model caches keys and values in, when every one
    keeps a plain ``KVCache`` (one entry per position), which is what the
    engine's rows replace; otherwise the model is refused."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    caches = make_prompt_cache(model)
    others = sorted({type(cache).__name__ for cache in caches if type(cache) is not KVCache})
    if others:
        raise ValueError(
            f"the mlx engine batches rows of plain attention layers only; this "
            f"{config.get('model_type', 'model')} keeps {', '.join(others)} "
            "(sliding windows or state-space layers): use --engine transformers"
        )
    return len(caches)


def _free_memory(mx: Any, on_gpu: bool) -> int:
    if on_gpu:
        info = mx.device_info()
        limit = int(info.get("max_recommended_working_set_size") or info.get("memory_size") or 0)
        return max(0, limit - int(mx.get_active_memory()))
    return host_available_bytes()
