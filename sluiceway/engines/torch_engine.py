"""The transformers (PyTorch) engine: CPU or CUDA.

Theory of operation. Every attention layer's keys and values for a set of
rows live in one preallocated tensor per layer, ``[row_capacity, kv_heads,
time_capacity, head_dim]`` (:class:`KVRows`). All rows share one time axis and
are *right-aligned* on it: a row's real tokens occupy ``[first[row], end)``,
and whatever lies to their left (``[start, first[row])``) is padding that the
attention mask hides. The model sees the window ``[start, end)`` of the first
``rows`` rows as its past, through a transformers ``Cache`` whose layers write
the new step at ``end`` in place and return views (no ``torch.cat`` per step).
The views are strided (each row and head is its own run of the buffer), which
costs the attention kernel some prefetching, ~20% at short windows measured
cold; far less than a ``DynamicCache``, which copies the whole cache each step.

Three facts make rows of different lengths decode together exactly as they
would alone:

* RoPE is applied to keys before they are cached, so a cached key keeps the
  rotation of its real position wherever it sits on the shared axis; the engine
  passes per-row ``position_ids`` (``end - first[row]``) for the new token.
* A decode step (one new position per row) gets a ready 4D additive mask,
  ``0`` where ``index >= first[row]`` and ``-inf`` before it, built in a few
  tensor ops; longer inputs get the 2D padding mask and transformers builds
  the 4D one. Causality is in index space, which is the same as real-token
  order because padding is only ever on the left.
* Padded positions hold finite values (zeros, or stale rows' keys), so a masked
  score is ``-inf`` and contributes exactly nothing.

When no row has padding the mask is left out (``None``), which is the same
fast path a plain transformers decode loop takes. With padding, on the CPU,
attention runs through :func:`_attention`, which keeps SDPA's grouped-query
kernel for the masked decode step (transformers' own SDPA path folds the
query heads instead, measured ~50% slower per layer at 16 rows).

Joining and leaving touch only the row concerned, never the other rows'
computation: a prefilled slot is built in its own one-row :class:`KVRows` and
copied into the next free row of the running batch, right-aligned (so it is
left-padded when it is shorter than the batch's window; when it is longer,
``start`` moves left into free space, or the buffers are reallocated once). A
freed row is overwritten by the last row, and ``start`` moves right past the
padding that every remaining row shares, so attention stops paying for it.
The time axis grows geometrically and the rows double, so the amortised cost
of a decode step is one in-place write per layer.

With ``--compile on`` (or ``auto``, where it measured faster: see
:mod:`sluiceway.engines.compile_choice`) a decode step of up to
``--compile-max-batch`` rows runs a graph that ``torch.compile`` made of the
model's forward, over the same buffers (:meth:`KVRows.padded_inputs`,
:mod:`sluiceway.engines.torch_compiled`); everything else stays eager.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

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
from sluiceway.engines.compile_choice import (
    Verdict,
    VerdictStore,
    decide,
    kept_buckets,
    scratch_prompts,
    time_rounds,
    verdict_key,
)
from sluiceway.engines.default_model import default_cache_dir
from sluiceway.engines.device import resolve_device
from sluiceway.engines.loader import ModelSource
from sluiceway.engines.memory import give_back_heap, host_available_bytes
from sluiceway.engines.torch_compiled import BUCKETS, CompiledStep
from sluiceway.engines.torch_compiled import MODES as COMPILE_MODES
from sluiceway.engines.torch_compiled_prefill import MIN_LENGTH as PREFILL_MIN_LENGTH
from sluiceway.engines.torch_compiled_prefill import CompiledPrefill
from sluiceway.engines.torch_compiled_prefill import fits_rows as fits_prefill_rows
from sluiceway.engines.torch_packed import KEYWORD, Packed, StoreCache, attend
from sluiceway.engines.torch_prepack import linear_bytes, prepack_linears, unsupported

logger = logging.getLogger(__name__)

#: The mask argument of a packed pass; see :meth:`TransformersEngine._packed_forward`.
_NO_MASK = torch.zeros(1, 1, 1, 1)

#: Prompt positions per forward pass while prefilling, to bound peak memory.
PREFILL_STEP = 512
#: The scratch prompt ``--compile auto`` times the compiled prefill on, and its slot.
PREFILL_SCRATCH = 64
_SCRATCH_SLOT = 0
#: The time axis grows in multiples of this many positions.
TIME_STEP = 256
#: The running batch starts with room for this many rows, doubling as needed.
ROW_STEP = 8
#: An emptied batch keeps its buffers up to this size, for the next request:
#: allocating (zeroing, page-faulting) them again doubled the first decode
#: step of every request that found the engine idle (33 against 16 ms on the
#: 42M-parameter bench model). Larger ones, left by long or many rows, are
#: given back.
KEEP_IDLE_BATCH_BYTES = 256 * 2**20
#: The fewest new prompt tokens that the compiled prefill takes apart from a
#: decode (:meth:`TransformersEngine.prefills_apart`). The compiled pass saves
#: a share of their arithmetic, the decode's own pass costs a step's fixed
#: part, so few tokens stay packed. Measured on the 42M bench model (engine
#: alone, 64-token prompts, a busy 2-core host): with 1-64 rows decoding,
#: one prompt apart took 1.46-1.92x as long as packed, three 0.97-1.19x,
#: seven 0.83-0.95x, fifteen 0.73-0.94x; an earlier session found six with
#: 16 rows no faster. As built, 8-31 prompts took 0.75-0.90x (docs/engines.md).
APART_MIN_TOKENS = 512
#: The same where the decode runs a graph with frozen weights
#: (``--frozen-weights``): its own pass then costs ~two thirds of an
#: oneDNN step's, and fewer tokens pay for it. Measured on the 42M bench
#: model (engine alone, seven or five pairs in turns, 1-16 rows decoding):
#: apart took 0.81-0.88x the packed time for 2-4 prompts of 64 tokens, 0.87
#: and 0.98x for four of 32, 0.88-0.93x for eight of 16; one prompt of 64
#: 0.93-0.98x; but one of 16 or 32 tokens 1.10-1.17x, and two of 16
#: 1.21x. Without frozen weights two or three prompts of 64 were level
#: (1.00 and 0.99x), four 0.88x.
APART_MIN_TOKENS_FROZEN = 128

DTYPES: Mapping[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_dtype(choice: str, config: Mapping[str, Any], device: torch.device) -> torch.dtype:
    """Pick the compute dtype.

    ``auto`` is what vLLM picks: bfloat16 where the hardware computes it
    natively, else float32. On CUDA that is the checkpoint's dtype, a float32
    checkpoint downcast to bfloat16 (float16 on GPUs without bfloat16). On
    the CPU it is bfloat16 where the CPU has AVX512-BF16 or AMX (whatever the
    checkpoint says), else float32: float16 matmuls are slow on CPUs, and
    bfloat16 ones are slow without those instructions. bfloat16 halves
    memory and moves logprobs by up to ~0.1 (``docs/engines.md``);
    ``--dtype float32`` keeps them exact.
    """
    if choice != "auto":
        if choice not in DTYPES:
            raise ValueError(f"--dtype must be auto or one of {', '.join(DTYPES)}, not {choice!r}")
        return DTYPES[choice]
    if device.type == "cpu":
        return torch.bfloat16 if cpu_has_bfloat16() else torch.float32
    dtype = DTYPES.get(_config_dtype(config) or "float32", torch.float32)
    if dtype == torch.float32:
        dtype = torch.bfloat16
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        return torch.float16
    return dtype


#: /proc/cpuinfo flags of native bfloat16 matmuls (vLLM's CPU backend asks the same).
BFLOAT16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_has_bfloat16(cpuinfo: str | None = None) -> bool:
    """Whether the CPU computes bfloat16 natively (AVX512-BF16 or AMX), by
    ``/proc/cpuinfo``'s flags (``cpuinfo``: its text; elsewhere: False)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return not BFLOAT16_FLAGS.isdisjoint(line.partition(":")[2].split())
    return False


def _config_dtype(config: Mapping[str, Any]) -> str | None:
    for scope in (config, config.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            value = scope.get(key)
            if isinstance(value, str):
                return value
    return None


def requested_threads(wanted: int = 0) -> int:
    """The thread count asked for: ``wanted`` (``--engine-threads``), else
    ``OMP_NUM_THREADS``; 0 when neither says one."""
    configured = os.environ.get("OMP_NUM_THREADS", "")
    if wanted > 0:
        return wanted
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    return 0


def _usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def set_threads(device: torch.device, wanted: int = 0) -> int:
    """Set torch's intra-op thread count for a CPU device; return the count in use.

    The count asked for (:func:`requested_threads`) wins; otherwise every
    CPU in this process's affinity mask (not the host's count, which
    containers and ``taskset`` restrict). On a host whose cores are busy
    with other work, fewer threads can be much faster, since every parallel
    region waits for its slowest thread: measured 4x on a contended 2-vCPU
    VM. The server's own work is such other work: see docs/architecture.md,
    "Engine threads".
    """
    threads = requested_threads(wanted) or _usable_cpus()
    if device.type == "cpu":
        torch.set_num_threads(threads)
    return int(torch.get_num_threads())


@dataclass(frozen=True, slots=True)
class LayerLayout:
    """One attention layer's cached tensors: ``(heads, head_dim)`` of keys and of values."""

    keys: tuple[int, int]
    values: tuple[int, int]
    dtype: torch.dtype


#: One prefix-cache entry: per layer, keys and values ``[heads, length, head_dim]``.
Segment = list[tuple[torch.Tensor, torch.Tensor]]


class KVRows:
    """Keys and values of several rows on one shared, left-padded time axis.

    Row ``r``'s real tokens are at ``[first[r], end)``; ``[start, end)`` is the
    window the model attends over. Buffers are allocated on first use and
    zero-initialised, so that masked positions always hold finite values.
    """

    def __init__(
        self, layouts: Sequence[LayerLayout], device: torch.device, *, ready_masks: bool = False
    ):
        self.layouts = tuple(layouts)
        self.device = device
        #: Build decode masks in 4D here; only for models whose every layer
        #: attends over the whole window (a ready mask would also be used as
        #: the sliding-window layers' mask).
        self.ready_masks = ready_masks
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.rows = 0
        self.start = 0
        self.end = 0
        self.first: list[int] = []
        self.cache = StoreCache(self, len(self.layouts))

    @property
    def window(self) -> int:
        return self.end - self.start

    @property
    def nbytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.keys + self.values)

    @property
    def row_capacity(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def time_capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    # -- one forward pass ------------------------------------------------------------------

    def inputs(self, length: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Reserve ``length`` positions; return ``position_ids`` and the mask:
        ``None`` without padding, else 4D additive for one position, 2D for more."""
        self.reserve(right=length)
        device = self.device
        seen = torch.tensor([self.end - f for f in self.first], device=device)
        positions = seen[:, None] + torch.arange(length, device=device)
        if all(f == self.start for f in self.first):
            return positions, None
        first = torch.tensor(self.first, device=device)
        index = torch.arange(self.start, self.end + length, device=device)
        allowed = index[None, :] >= first[:, None]
        if length > 1 or not self.ready_masks:
            return positions, allowed
        # Ready-made, so that transformers skips building it (Python, every step).
        return positions, self._additive(allowed)

    def padded_inputs(
        self, bucket: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """A compiled decode step's inputs for ``bucket`` rows (the running
        rows, then padding rows): positions ``[bucket, 1]``, the additive
        mask ``[bucket, 1, 1, T]``, the write position ``[1]``, and every
        layer's keys and values ``[bucket, heads, time_capacity, dim]``
        (views; the graph attends over their first ``T`` positions), where
        ``T`` is ``end + 1`` rounded up to :data:`TIME_STEP`. A padding row
        sees only the position it writes (:mod:`~sluiceway.engines.torch_compiled`)."""
        # A spare time step past T: the buffer is never exactly the window,
        # which a graph traced otherwise takes for a case of its own (a
        # second graph per bucket, and a recompile the first time it comes).
        self.reserve(right=TIME_STEP + 1, rows=bucket)
        device, end = self.device, self.end
        time = _round_up(end + 1, TIME_STEP)
        pad = bucket - self.rows
        first = torch.tensor(self.first + [end] * pad, device=device)
        seen = torch.tensor([end - f for f in self.first] + [0] * pad, device=device)
        index = torch.arange(time, device=device)
        allowed = (index[None, :] >= first[:, None]) & (index[None, :] <= end)
        keys = [tensor[:bucket] for tensor in self.keys]
        values = [tensor[:bucket] for tensor in self.values]
        at = torch.tensor([end], device=device)
        return seen[:, None], self._additive(allowed), at, keys, values

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """The 4D additive mask ``[rows, 1, 1, T]`` of a boolean ``[rows, T]``:
        0 where allowed, -inf elsewhere, in the buffers' dtype."""
        mask = torch.zeros(allowed.shape, dtype=self.layouts[0].dtype, device=allowed.device)
        mask.masked_fill_(~allowed, float("-inf"))
        return mask[:, None, None, :]

    def write(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one layer's new keys and values at ``end``; return the whole window (views)."""
        stop = self.end + keys.shape[2]
        self.keys[layer][: self.rows, :, self.end : stop] = keys
        self.values[layer][: self.rows, :, self.end : stop] = values
        return (
            self.keys[layer][: self.rows, :, self.start : stop],
            self.values[layer][: self.rows, :, self.start : stop],
        )

    def advance(self, length: int) -> None:
        """Every layer has written ``length`` positions: move ``end`` past them."""
        self.end += length

    def retreat(self, length: int) -> None:
        """Take back the last ``length`` positions of every row (they are
        overwritten by the next write). No row may have started inside them."""
        if self.window < length or any(f > self.end - length for f in self.first):
            raise ValueError(f"cannot take back {length} positions")
        self.end -= length

    # -- rows joining and leaving ------------------------------------------------------------

    def open_row(self) -> None:
        """Add an empty row (a slot about to be prefilled)."""
        self.reserve(rows=self.rows + 1)
        self.first.append(self.end)
        self.rows += 1

    def add_rows(self, others: Sequence[KVRows], *, min_rows: int = 1) -> None:
        """Append each of ``others``' single row, right-aligned with the running rows."""
        longest = max(other.window for other in others)
        if self.rows == 0:
            # Empty (perhaps emptied and kept for reuse): the window starts
            # afresh where the longest newcomer just fits. Stale positions
            # hold finite values, as zeroed buffers do, and are masked.
            self.start = self.end = longest
        self.reserve(
            left=max(0, longest - self.window), rows=max(min_rows, self.rows + len(others))
        )
        for other in others:
            if other.rows != 1:
                raise ValueError("only a one-row cache can join another")
            length = other.window
            self.start = min(self.start, self.end - length)
            row, begin = self.rows, self.end - length
            for mine, theirs in zip(
                self.keys + self.values, other.keys + other.values, strict=True
            ):
                mine[row, :, begin : self.end] = theirs[0, :, other.start : other.end]
            self.first.append(begin)
            self.rows += 1

    def remove_row(self, row: int) -> int | None:
        """Drop ``row``; the last row moves into its place. Returns the row that moved, if any."""
        last = self.rows - 1
        moved = None
        if row != last:
            for tensor in self.keys + self.values:
                tensor[row, :, self.start : self.end] = tensor[last, :, self.start : self.end]
            self.first[row] = self.first[last]
            moved = last
        self.first.pop()
        self.rows -= 1
        # Padding that every remaining row shares is no longer attended to.
        self.start = min(self.first) if self.first else self.end
        return moved

    def clone(self) -> KVRows:
        copy = KVRows(self.layouts, self.device, ready_masks=self.ready_masks)
        copy.add_rows([self])
        return copy

    # -- prefix-cache segments ---------------------------------------------------------------

    def segment(self, row: int, start: int, end: int) -> Segment:
        """Copies of ``row``'s keys and values at its real positions ``[start, end)``."""
        if not 0 <= start < end <= self.end - self.first[row]:
            raise ValueError(f"row {row} holds no positions {start}..{end}")
        begin, stop = self.first[row] + start, self.first[row] + end
        return [
            (keys[row, :, begin:stop].clone(), values[row, :, begin:stop].clone())
            for keys, values in zip(self.keys, self.values, strict=True)
        ]

    def extend_row(self, segments: Sequence[Segment], length: int) -> None:
        """Append the first ``length`` positions of ``segments``, laid end to
        end, to the one row (a cached prefix; RoPE is already in the keys)."""
        if self.rows != 1:
            raise ValueError("only a lone row takes cached segments")
        self.reserve(right=length)
        position = self.end
        for segment in segments:
            take = min(length - (position - self.end), segment[0][0].shape[1])
            if take <= 0:
                break
            for layer, (keys, values) in enumerate(segment):
                self.keys[layer][0, :, position : position + take] = keys[:, :take]
                self.values[layer][0, :, position : position + take] = values[:, :take]
            position += take
        if position - self.end != length:
            raise ValueError(
                f"the cached segments hold {position - self.end} of {length} positions"
            )
        self.advance(length)

    # -- capacity ----------------------------------------------------------------------------

    def reserve(self, *, left: int = 0, right: int = 0, rows: int = 0) -> None:
        """Room for ``left`` positions before ``start``, ``right`` after ``end``, and ``rows`` rows."""
        if (
            left <= self.start
            and self.end + right <= self.time_capacity
            and rows <= self.row_capacity
        ):
            return
        row_capacity = max(1, self.row_capacity)
        while row_capacity < rows:
            row_capacity *= 2
        # Geometric growth to the right keeps the amortised cost of a step at one write.
        time = _round_up(left + self.window + right + max(TIME_STEP, self.window // 2), TIME_STEP)
        self._reallocate(rows=row_capacity, time=time, new_start=left)

    def _reallocate(self, *, rows: int, time: int, new_start: int) -> None:
        old_keys, old_values = self.keys, self.values
        old_start, old_end = self.start, self.end
        self.keys = [self._buffer(rows, time, kv.keys, kv.dtype) for kv in self.layouts]
        self.values = [self._buffer(rows, time, kv.values, kv.dtype) for kv in self.layouts]
        shift = new_start - old_start
        self.start, self.end = new_start, old_end + shift
        self.first = [f + shift for f in self.first]
        if not old_keys:
            return
        for new, old in zip(self.keys + self.values, old_keys + old_values, strict=True):
            new[: self.rows, :, self.start : self.end] = old[: self.rows, :, old_start:old_end]

    def _buffer(
        self, rows: int, time: int, shape: tuple[int, int], dtype: torch.dtype
    ) -> torch.Tensor:
        heads, dim = shape
        return torch.zeros(rows, heads, time, dim, dtype=dtype, device=self.device)


def _round_up(value: int, step: int) -> int:
    return (value + step - 1) // step * step


class TransformersEngine:
    """An :class:`~sluiceway.engines.base.Engine` over a transformers causal LM."""

    def __init__(
        self,
        source: ModelSource,
        *,
        device: str = "auto",
        dtype: str = "auto",
        threads: int = 0,
        compile: str = "off",
        compile_max_batch: int = 32,
        compile_verdicts: VerdictStore | None = None,
        prepack: bool = True,
        frozen_weights: str = "auto",
    ) -> None:
        self._device = resolve_device(device)
        self._dtype = resolve_dtype(dtype, source.config, self._device)
        self._threads = set_threads(self._device, threads)
        #: No count was asked for and there is one to choose: the child
        #: process may pick it by timing (``tunable``).
        self._tunable = (
            self._device.type == "cpu" and not requested_threads(threads) and self._threads >= 2
        )
        self._model = _load_model(source, self._device, self._dtype)
        self._frozen = self._freezes(frozen_weights, compile)
        self._prepacked = self._prepack(prepack)
        self._cache_keyword = cache_keyword(self._model)
        self._layouts = _probe_layouts(self._model, self._device)
        self._ready_masks = _full_attention_only(self._model.config)
        self._packable = self._ready_masks and self._model.config._attn_implementation == _ATTENTION
        self._pending: dict[int, KVRows] = {}
        self._batch: KVRows | None = None
        self._order: list[int] = []
        #: Prefix-cache entries, by the ids the scheduler's index gives them.
        self._entries: dict[int, Segment] = {}
        self._compiled = self._compiled_step(compile, compile_max_batch)
        self._info = EngineInfo(
            name="transformers",
            device=str(self._device),
            dtype=str(self._dtype).removeprefix("torch."),
            vocab_size=int(source.vocab_size or self._model.config.vocab_size),
            max_context=config_max_context(source.config),
            kv_bytes_per_token=_bytes_per_token(self._layouts),
            free_memory_bytes=_free_memory(self._device),
            threads=self._threads if self._device.type == "cpu" else 0,
        )
        #: A new prompt's first chunk through one graph (with a compiled step).
        self._compiled_prefill: CompiledPrefill | None = None
        if compile == "auto" and self._compiled is not None:
            store = compile_verdicts or VerdictStore(default_cache_dir() / "compile")
            key = verdict_key(
                source.path,
                dtype=self._info.dtype,
                threads=self._threads,
                torch_version=torch.__version__,
                buckets=self._compiled.buckets,
                prepacked=self._prepacked > 0,
                frozen=self._frozen,
            )
            self._compiled = self._choose_compiled(self._compiled, key, store)
            if self._compiled is not None and self._compiled.bucket(1) == 1:
                self._compiled_prefill = self._choose_prefill(f"{key}-prefill", store)
        elif self._compiled is not None:  # on: compiled on the first prefill
            self._compiled_prefill = CompiledPrefill(self._model, self._cache_keyword)
        logger.info(
            "transformers engine: %s on %s, %s, %d threads, %s",
            source.name,
            self._device,
            self._info.dtype,
            self._threads,
            f"{self._prepacked} linear layers prepacked" if self._prepacked else "as loaded",
        )

    def _freezes(self, asked: str, compile: str) -> bool:
        """Whether the compiled decode step freezes its weights
        (``--frozen-weights``; :mod:`~sluiceway.engines.torch_compiled`)."""
        if asked not in FROZEN_MODES:
            raise ValueError(
                f"--frozen-weights must be one of {', '.join(FROZEN_MODES)}, not {asked!r}"
            )
        if asked == "off" or compile == "off":
            return False
        why_not = unsupported(self._device, self._dtype)
        if why_not is None and asked == "auto":
            why_not = _frozen_memory(linear_bytes(self._model))
        if why_not is not None:
            (logger.warning if asked == "on" else logger.debug)(
                "--frozen-weights %s: the compiled step keeps oneDNN's products, %s",
                asked,
                why_not,
            )
            return False
        return True

    def _prepack(self, asked: bool) -> int:
        """Reorder the linear layers' weights for oneDNN where that applies
        (:mod:`sluiceway.engines.torch_prepack`); how many were."""
        if not asked:
            return 0
        why_not = unsupported(self._device, self._dtype)
        if why_not is not None:
            logger.debug("weights not prepacked: %s", why_not)
            return 0
        packed = prepack_linears(self._model, keep_plain=self._frozen)
        # The matrices as loaded are free now; glibc would keep their pages.
        give_back_heap()
        return packed

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def tunable(self) -> bool:
        """Whether the thread count is the engine's to choose: a CPU device,
        no ``--engine-threads`` or ``OMP_NUM_THREADS``, 2 threads or more."""
        return self._tunable

    def set_threads(self, count: int) -> None:
        """Compute the next steps on ``count`` threads (a CPU device only;
        :mod:`sluiceway.actors.thread_tuner` picks the count)."""
        if self._device.type == "cpu":
            torch.set_num_threads(count)

    def prefill(self, slot: int, token_ids: Sequence[int], *, all_logits: bool = False) -> Logits:
        if not token_ids:
            raise ValueError("prefill needs at least one token")
        if slot in self._order:
            raise ValueError(f"slot {slot} is already decoding; free it before prefilling again")
        with torch.inference_mode():
            rows = self._pending_rows(slot)
            pieces = []
            for begin in range(0, len(token_ids), PREFILL_STEP):
                chunk = list(token_ids[begin : begin + PREFILL_STEP])
                ids = torch.tensor([chunk], dtype=torch.long, device=self._device)
                logits = None if all_logits else self._graph_prefill(rows, ids)
                if logits is None:
                    logits = self._forward(rows, ids, keep=0 if all_logits else 1)
                if all_logits or begin + PREFILL_STEP >= len(token_ids):
                    pieces.append(logits[0])
            return _to_numpy(pieces[0] if len(pieces) == 1 else torch.cat(pieces))

    def fork(self, source: int, target: int) -> None:
        if source not in self._pending:
            raise ValueError(f"slot {source} is not a prefilled slot waiting to decode")
        if target in self._order or target in self._pending:
            raise ValueError(f"slot {target} is in use; free it before forking into it")
        with torch.inference_mode():
            self._pending[target] = self._pending[source].clone()

    def decode(self, tokens: Mapping[int, int]) -> DecodeResult:
        if not tokens:
            raise ValueError("decode needs at least one slot")
        missing = set(self._order) - tokens.keys()
        if missing:
            raise ValueError(f"decode must name every running slot; missing {sorted(missing)}")
        with torch.inference_mode():
            self._join_new(tokens)
            assert self._batch is not None
            batch, rows = self._batch, len(self._order)
            bucket = self._graph_bucket(rows)
            if bucket is not None:
                padded = [tokens[slot] for slot in self._order] + [0] * (bucket - rows)
                ids = torch.tensor(padded, device=self._device)[:, None]
                assert self._compiled is not None
                compiled = self._compiled(ids, *batch.padded_inputs(bucket))
                if compiled is not None:
                    batch.advance(1)
                    return DecodeResult(tuple(self._order), _to_numpy(compiled[:rows]))
            ids = torch.tensor([[tokens[slot]] for slot in self._order], device=self._device)
            logits = self._forward(batch, ids, keep=1)
            return DecodeResult(tuple(self._order), _to_numpy(logits[:, -1, :]))

    def start_decode(self, tokens: Mapping[int, int]) -> Callable[[], DecodeResult]:
        return functools.partial(self.decode, dict(tokens))

    @property
    def packs_prefills(self) -> bool:
        """Whether :meth:`decode_prefilling` may be called: the CPU attention
        path of ours, on a model whose every layer sees the whole past."""
        return self._packable

    def prefills_apart(self, chunks: Sequence[tuple[int, int]]) -> bool:
        """Whether new prompts' chunks ``(slot, length)`` take the compiled
        prefill in a pass of their own rather than the eager pass of a decode
        they would be packed into: where the graph applies to them all (fresh
        rows, on every thread) and they hold :data:`APART_MIN_TOKENS` or more
        (:data:`APART_MIN_TOKENS_FROZEN` where the running rows' decode
        takes a graph with frozen weights)."""
        lengths = [length for _, length in chunks]
        if sum(lengths) < self._apart_min_tokens() or any(
            slot in self._order for slot, _ in chunks
        ):
            return False
        return self._graph_takes([self._pending_window(slot) for slot, _ in chunks], lengths)

    def _apart_min_tokens(self) -> int:
        step = self._compiled
        frozen_decode = (
            step is not None and step.frozen and self._graph_bucket(len(self._order)) is not None
        )
        return APART_MIN_TOKENS_FROZEN if frozen_decode else APART_MIN_TOKENS

    def _pending_window(self, slot: int) -> int:
        """Positions a prefilled slot waiting to decode holds already."""
        rows = self._pending.get(slot)
        return 0 if rows is None else rows.window

    def _graph_takes(self, windows: Sequence[int], lengths: Sequence[int]) -> bool:
        """Whether the compiled prefill takes chunks of ``lengths`` into rows
        holding ``windows`` positions already: fresh rows only, on every
        thread; one chunk through the one-row graph, several through the
        batch graph."""
        graph = self._compiled_prefill
        if graph is None or any(windows) or not self._on_every_thread():
            return False
        if len(lengths) == 1:
            return graph.active and lengths[0] >= PREFILL_MIN_LENGTH
        return graph.rows_active and fits_prefill_rows(lengths)

    def decode_prefilling(
        self, tokens: Mapping[int, int], chunks: Sequence[tuple[int, Sequence[int]]]
    ) -> tuple[DecodeResult, list[Logits]]:
        """:meth:`decode`, with prompt chunks prefilled in the same forward
        pass (:mod:`sluiceway.engines.torch_packed`); returns the decode's
        result and each chunk's last logits, ``[1, vocab]``. The slots of
        the chunks are prefilled slots (or new ones), as for :meth:`prefill`;
        they join the batch at a later decode. Without ``tokens`` the pass
        only prefills the chunks, and the running rows wait."""
        if not self._packable:
            raise ValueError("this model cannot pack prefills into a decode step")
        if not chunks:
            raise ValueError("a packed step needs chunks to prefill")
        missing = set(self._order) - tokens.keys()
        if tokens and missing:
            raise ValueError(f"decode must name every running slot; missing {sorted(missing)}")
        slots = [slot for slot, _ in chunks]
        for slot, ids in chunks:
            if not ids or slot in self._order or slot in tokens or slots.count(slot) > 1:
                raise ValueError(f"slot {slot} cannot be prefilled in this step")
        with torch.inference_mode():
            self._join_new(tokens)
            order = self._order if tokens else []
            parts = [self._pending_rows(slot) for slot, _ in chunks]
            logits = None if tokens else self._graph_prefill_rows(parts, [i for _, i in chunks])
            if logits is None:
                logits = self._packed_forward(
                    [tokens[slot] for slot in order], parts, [ids for _, ids in chunks]
                )
            rows = len(order)
            decoded = DecodeResult(tuple(order), _to_numpy(logits[:rows]))
            return decoded, [_to_numpy(logits[rows + i : rows + i + 1]) for i in range(len(chunks))]

    def undo_decode(self) -> None:
        if self._batch is None:
            raise ValueError("no decode to undo")
        self._batch.retreat(1)

    def free(self, slot: int) -> None:
        if self._pending.pop(slot, None) is not None or slot not in self._order:
            return
        assert self._batch is not None
        row = self._order.index(slot)
        with torch.inference_mode():
            moved = self._batch.remove_row(row)
        if moved is not None:
            self._order[row] = self._order[moved]
        self._order.pop()
        if not self._order and self._batch.nbytes > KEEP_IDLE_BATCH_BYTES:
            self._batch = None  # release the memory the longest rows needed

    def restore(self, slot: int, entries: Sequence[int], length: int) -> None:
        if slot in self._order or slot in self._pending:
            raise ValueError(f"slot {slot} is in use; free it before restoring into it")
        segments = [self._entry(entry) for entry in entries]
        with torch.inference_mode():
            rows = self._new_rows()
            rows.open_row()
            rows.extend_row(segments, length)
        self._pending[slot] = rows

    def cache_op(self, op: CacheOp) -> None:
        with torch.inference_mode():
            if isinstance(op, KeepKV):
                rows, row = self._row_of(op.slot)
                self._entries[op.entry] = rows.segment(row, op.start, op.end)
            elif isinstance(op, SplitKV):
                whole = self._entry(op.entry)
                # Copies, not views: each half's memory goes when that half is dropped.
                if op.head is not None:
                    self._entries[op.head] = [
                        (k[:, : op.at].clone(), v[:, : op.at].clone()) for k, v in whole
                    ]
                self._entries[op.entry] = [
                    (k[:, op.at :].clone(), v[:, op.at :].clone()) for k, v in whole
                ]
            elif isinstance(op, DropKV):
                self._entries.pop(op.entry, None)

    def release_memory(self) -> None:
        if not self._order:
            self._batch = None  # kept while idle for the next rows; zeroed pages all
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    def close(self) -> None:
        self._pending.clear()
        self._batch = None
        self._order.clear()
        self._entries.clear()

    def _entry(self, entry: int) -> Segment:
        segment = self._entries.get(entry)
        if segment is None:
            raise ValueError(f"no prefix-cache entry {entry}")
        return segment

    def _row_of(self, slot: int) -> tuple[KVRows, int]:
        if slot in self._pending:
            return self._pending[slot], 0
        if slot in self._order:
            assert self._batch is not None
            return self._batch, self._order.index(slot)
        raise ValueError(f"slot {slot} is not in use")

    def _new_rows(self) -> KVRows:
        return KVRows(self._layouts, self._device, ready_masks=self._ready_masks)

    def _pending_rows(self, slot: int) -> KVRows:
        """The one-row cache a slot is prefilled in, opened on its first chunk."""
        rows = self._pending.get(slot)
        if rows is None:
            rows = self._pending[slot] = self._new_rows()
            rows.open_row()
        return rows

    def _packed_forward(
        self, decoded: Sequence[int], chunks: Sequence[KVRows], ids: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """The batch's next tokens (if any) and the chunks in one pass; the
        logits of every decoded row, then of each chunk's last position."""
        batch, places, mask = None, [], None
        if decoded:
            batch = self._batch
            assert batch is not None
            positions, mask = batch.inputs(1)
            places.append(positions.view(1, -1))
        packed = Packed(batch, mask, chunks, [len(chunk) for chunk in ids])
        for rows, length in zip(chunks, packed.lengths, strict=True):
            places.append(rows.inputs(length)[0])
        flat = [*decoded, *(token for chunk in ids for token in chunk)]
        ends = torch.tensor(packed.lengths, device=self._device).cumsum(0) + len(decoded) - 1
        keep = torch.cat([torch.arange(len(decoded), device=self._device), ends])
        output = self._model(
            input_ids=torch.tensor([flat], dtype=torch.long, device=self._device),
            position_ids=torch.cat(places, dim=1),
            # Any 4D mask: transformers then builds none (attend() has its own).
            attention_mask=_NO_MASK,
            use_cache=True,
            logits_to_keep=keep,
            **{self._cache_keyword: StoreCache(packed, len(self._layouts)), KEYWORD: packed},
        )
        if packed.attended != len(self._layouts):
            raise RuntimeError("the packed split did not reach every attention layer")
        packed.advance()
        logits: torch.Tensor = output.logits[0]
        return logits

    def _graph_bucket(self, rows: int) -> int | None:
        """The compiled decode graph's bucket for ``rows`` rows, or None to
        decode eagerly (see :meth:`_on_every_thread`)."""
        if self._compiled is None or not self._on_every_thread():
            return None
        return self._compiled.bucket(rows)

    def _on_every_thread(self) -> bool:
        """Whether the step about to run has the engine's whole thread count,
        which a compiled graph needs. On fewer (the child's tuner chose them
        for this batch size) the step is eager, so that the tuner's choice of
        fewer threads is a choice of the eager step on them. Where another
        process keeps a core busy, a compiled step's parallel loops wait for
        a thread that has no core, and the eager step on one thread is
        faster; the tuner times both and keeps that one. A graph never runs
        on another count: Dynamo guards it on the count and would compile it
        again, on a request (measured: a 4.9 s first token)."""
        return self._device.type != "cpu" or torch.get_num_threads() == self._threads

    def _graph_prefill(self, rows: KVRows, ids: torch.Tensor) -> torch.Tensor | None:
        """A fresh row's chunk through the compiled prefill, its keys and
        values copied into ``rows``; None where the graph does not apply."""
        graph, length = self._compiled_prefill, ids.shape[1]
        if graph is None or not self._graph_takes([rows.window], [length]):
            return None
        prefilled = graph(ids)
        if prefilled is None:
            return None
        logits, keys, values = prefilled
        _take_prefilled(rows, keys, values, 0, length)
        return logits

    def _graph_prefill_rows(
        self, parts: Sequence[KVRows], ids: Sequence[Sequence[int]]
    ) -> torch.Tensor | None:
        """Fresh rows' chunks through the compiled prefill as one batch, each
        row's keys and values copied into its own cache; their last logits
        ``[rows, vocab]``, or None where the graph does not apply."""
        graph, lengths = self._compiled_prefill, [len(chunk) for chunk in ids]
        # One chunk alone is the one-row graph's, not this one's.
        if graph is None or len(lengths) < 2:
            return None
        if not self._graph_takes([rows.window for rows in parts], lengths):
            return None
        prefilled = graph.rows(ids, self._device)
        if prefilled is None:
            return None
        logits, keys, values = prefilled
        for row, (rows, length) in enumerate(zip(parts, lengths, strict=True)):
            _take_prefilled(rows, keys, values, row, length)
        return logits

    def _choose_prefill(self, key: str, store: VerdictStore) -> CompiledPrefill | None:
        """``--compile auto``, with the one-row decode step compiled: the
        compiled prefill, kept where a scratch prompt's prefill measures at
        least :data:`MIN_SPEEDUP` times faster, and then compiled now; the
        verdict is stored under ``key`` as the decode step's are."""
        graph = CompiledPrefill(self._model, self._cache_keyword)
        prompt = next(iter(scratch_prompts(1, self._info.vocab_size, length=PREFILL_SCRATCH)))

        def through(candidate: CompiledPrefill | None) -> Callable[[], None]:
            def one() -> None:
                self._compiled_prefill = candidate
                self.prefill(_SCRATCH_SLOT, prompt)
                self.free(_SCRATCH_SLOT)

            return one

        stored, how = store.load(key), "stored"
        if stored:
            verdict = stored[0]
            if verdict.keep:  # compile it now, not on a request
                through(graph)()
        else:
            how = "measured"
            eager, compiled = time_rounds(
                through(None), through(graph), time.perf_counter, rounds=1, steps=8
            )
            verdict = decide(PREFILL_SCRATCH, eager, compiled)
            if graph.active:  # not stored: a missing compiler may be installed later
                store.save(key, [verdict])
        self._compiled_prefill = None
        kept = graph.active and verdict.keep
        if kept:
            self._warm_prefill_rows(graph)
        logger.info(
            "--compile auto: %s (compiled ÷ eager %.2fx for %d tokens, %s)",
            "compiled prefill of new prompts" if kept else "eager prefill",
            verdict.speedup,
            PREFILL_SCRATCH,
            how,
        )
        return graph if kept else None

    def _warm_prefill_rows(self, graph: CompiledPrefill) -> None:
        """Compile the batch graph now, not on a burst of requests: its two
        forms, rows of one length and of several (a count of one distinct
        length is a size torch specialises). Three rows, two lengths: sizes
        that differ, so that Dynamo ties no two of them together."""
        prompts = list(scratch_prompts(3, self._info.vocab_size, length=PREFILL_SCRATCH))
        with torch.inference_mode():
            graph.rows(prompts, self._device)
            graph.rows([prompts[0][:-4], *prompts[1:]], self._device)

    def _choose_compiled(
        self, step: CompiledStep, key: str, store: VerdictStore
    ) -> CompiledStep | None:
        """``--compile auto``: ``step`` limited to the buckets where it decodes
        faster than the eager step, each compiled now, so that no request
        waits for it; None where it is faster in none
        (:mod:`~sluiceway.engines.compile_choice`)."""
        verdicts, how = store.load(key), "stored"
        if verdicts is None:
            verdicts, how = self._time_buckets(step), "measured"
            if not step.active:  # not stored: a missing compiler may be installed later
                return None
            store.save(key, verdicts)
        measured = ", ".join(f"{v.bucket}: {v.speedup:.2f}x" for v in verdicts)
        kept = kept_buckets(verdicts)
        if not kept:
            logger.info("--compile auto: decoding eagerly (compiled ÷ eager %s, %s)", measured, how)
            return None
        step.limit(kept)
        if how == "stored":  # measured buckets compiled while they were timed
            for bucket in kept:
                with self._scratch_rows(bucket) as tokens:
                    self._through(step, tokens)()
        logger.info(
            "--compile auto: compiled decode step for batches up to %d (compiled ÷ eager %s, %s)",
            kept[-1],
            measured,
            how,
        )
        return step if step.active else None

    def _time_buckets(self, step: CompiledStep) -> list[Verdict]:
        """Each bucket's verdict, smallest first, up to the first loss (the
        compiled step's gain shrinks as the matrix products grow)."""
        verdicts: list[Verdict] = []
        for bucket in step.buckets:
            with self._scratch_rows(bucket) as tokens:
                eager, compiled = time_rounds(
                    self._through(None, tokens), self._through(step, tokens), time.perf_counter
                )
            verdicts.append(decide(bucket, eager, compiled))
            if not verdicts[-1].keep or not step.active:
                break
        return verdicts

    @contextlib.contextmanager
    def _scratch_rows(self, rows: int) -> Iterator[dict[int, int]]:
        """``rows`` prefilled scratch slots and a token for each; afterwards
        nothing is left of them and no compiled step is set."""
        prompts = list(scratch_prompts(rows, self._info.vocab_size))
        for slot, prompt in enumerate(prompts):
            self.prefill(slot, prompt)
        try:
            yield {slot: prompt[0] for slot, prompt in enumerate(prompts)}
        finally:
            self._compiled = None
            for slot in range(rows):
                self.free(slot)

    def _through(self, step: CompiledStep | None, tokens: dict[int, int]) -> Callable[[], None]:
        """A decode step of ``tokens`` through ``step`` (None: eagerly)."""

        def one() -> None:
            self._compiled = step
            self.decode(tokens)

        return one

    @property
    def compiled_step(self) -> CompiledStep | None:
        """The compiled decode step (``--compile``), if one was built."""
        return self._compiled

    def _compiled_step(self, mode: str, max_batch: int) -> CompiledStep | None:
        """The compiled decode step ``--compile`` asks for, or None (eager),
        logging why an unsupported model or device decodes eagerly."""
        if mode not in COMPILE_MODES:
            raise ValueError(f"--compile must be one of {', '.join(COMPILE_MODES)}, not {mode!r}")
        if max_batch < 1:
            raise ValueError(f"--compile-max-batch must be at least 1, not {max_batch}")
        if mode == "off":
            return None
        if self._device.type != "cpu":
            why = f"the compiled step is built for the CPU only, not {self._device.type}"
        elif not self._packable:
            why = "the model has sliding-window or non-SDPA attention layers"
        else:
            buckets = [bucket for bucket in BUCKETS if bucket <= max_batch]
            logger.info(
                "decode step: torch.compile, batch buckets %s (larger batches: eager)",
                ", ".join(map(str, buckets)),
            )
            return CompiledStep(
                self._model, self._cache_keyword, buckets=buckets, frozen=self._frozen
            )
        # auto is the default: a model it does not suit is no cause for a warning
        log = logger.info if mode == "auto" else logger.warning
        log("--compile %s: decoding eagerly, %s", mode, why)
        return None

    def _forward(self, rows: KVRows, ids: torch.Tensor, *, keep: int) -> torch.Tensor:
        length = ids.shape[1]
        positions, mask = rows.inputs(length)
        output = self._model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=mask,
            use_cache=True,
            logits_to_keep=keep,
            **{self._cache_keyword: rows.cache},
        )
        rows.advance(length)
        logits: torch.Tensor = output.logits
        return logits

    def _join_new(self, tokens: Mapping[int, int]) -> None:
        joining = [slot for slot in tokens if slot not in self._order]
        if not joining:
            return
        for slot in joining:
            if slot not in self._pending:
                raise ValueError(f"slot {slot} was never prefilled")
        if self._batch is None:
            self._batch = self._new_rows()
        self._batch.add_rows([self._pending.pop(slot) for slot in joining], min_rows=ROW_STEP)
        self._order.extend(joining)


def _bytes_per_token(layouts: Sequence[LayerLayout]) -> int:
    return sum(
        (kv.keys[0] * kv.keys[1] + kv.values[0] * kv.values[1]) * kv.dtype.itemsize
        for kv in layouts
    )


def _free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return host_available_bytes()


def _to_numpy(logits: torch.Tensor) -> Logits:
    """float32 NumPy; on the CPU this shares the tensor's memory (no copy for float32)."""
    array: Logits = logits.float().cpu().numpy()
    return array


def cache_keyword(model: Any) -> str:
    """The keyword under which ``model.forward`` takes its KV cache.

    transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name
    warns, and goes in 5.40). This is the one place that knows: every forward
    call of the engine and of the benchmarks passes its cache under this name.
    """
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _full_attention_only(config: Any) -> bool:
    """Whether every attention layer sees the whole past (no sliding or chunked window)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(text, "layer_types", None)
    if types is not None:
        return all(kind == "full_attention" for kind in types)
    return not getattr(text, "sliding_window", None) and not getattr(
        text, "attention_chunk_size", None
    )


def _probe_layouts(model: Any, device: torch.device) -> tuple[LayerLayout, ...]:
    """Every layer's key and value shapes, read off one token through a ``DynamicCache``.

    A real forward pass rather than the config: it also covers models whose
    head counts or sizes differ by layer, or between keys and values.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    with torch.inference_mode():
        model(input_ids=ids, **{cache_keyword(model): cache})
    layouts = []
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
            raise ValueError(
                f"the transformers engine needs an attention KV cache in every layer; "
                f"{type(model).__name__} has a {type(layer).__name__}"
            )
        layouts.append(
            LayerLayout(
                keys=(keys.shape[1], keys.shape[3]),
                values=(values.shape[1], values.shape[3]),
                dtype=keys.dtype,
            )
        )
    return tuple(layouts)


#: ``--frozen-weights``' choices.
FROZEN_MODES = ("auto", "on", "off")
#: Copies of the linear layers' matrices that frozen weights add: the one
#: kept as loaded beside oneDNN's, and one in each of the two graphs.
FROZEN_COPIES = 3
#: ``--frozen-weights auto``: the copies may take this share of the memory
#: the host has free at start-up, no more.
FROZEN_MEMORY_SHARE = 0.125


def _frozen_memory(weights: int, available: int | None = None) -> str | None:
    """Why ``auto`` does not freeze weights of ``weights`` bytes; None: it does."""
    free = host_available_bytes() if available is None else available
    needed = FROZEN_COPIES * weights
    if needed > FROZEN_MEMORY_SHARE * free:
        return (
            f"its {needed / 2**20:.0f} MiB of weight copies would take more than "
            f"{FROZEN_MEMORY_SHARE:.0%} of the {free / 2**20:.0f} MiB free"
        )
    return None


def _load_model(source: ModelSource, device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    def load(attention: str) -> Any:
        return AutoModelForCausalLM.from_pretrained(
            str(source.path), local_files_only=True, dtype=dtype, attn_implementation=attention
        )

    try:
        model = load("sdpa")
    except ValueError:  # an architecture without an SDPA path
        logger.info("%s has no SDPA attention; using eager attention", source.name)
        model = load("eager")
    else:
        if device.type == "cpu":
            model.set_attn_implementation(_register_attention())
    return model.to(device).eval()


_ATTENTION = "sluiceway_sdpa"


def _register_attention() -> str:
    """Register :func:`_attention` (and SDPA's mask builder) with transformers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(_ATTENTION, _attention)
    AttentionMaskInterface.register(_ATTENTION, sdpa_mask)
    return _ATTENTION


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except for a decode step (one position
    per row): there SDPA's ``enable_gqa`` kernel takes the padding mask as it
    is, where transformers would fold grouped query heads into the query axis
    and take a slower kernel. Unmasked, it is the call transformers makes.
    A packed pass (decode rows and prompt chunks) splits it again."""
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    packed = kwargs.get(KEYWORD)
    if packed is not None:
        layer: int = module.layer_idx  # type: ignore[assignment]
        return attend(packed, layer, query, scaling, grouped), None
    if query.shape[2] != 1 or dropout or kwargs.get("position_bias") is not None:
        output: tuple[torch.Tensor, None] = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        return output
    attended = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=grouped
    )
    return attended.transpose(1, 2).contiguous(), None


def _take_prefilled(
    rows: KVRows, keys: list[torch.Tensor], values: list[torch.Tensor], row: int, length: int
) -> None:
    """Copy row ``row``'s first ``length`` positions of a compiled prefill's
    keys and values (per layer ``[rows, heads, positions, dim]``) into ``rows``."""
    rows.reserve(right=length)
    mine = slice(row, row + 1)
    for layer, (layer_keys, layer_values) in enumerate(zip(keys, values, strict=True)):
        rows.write(layer, layer_keys[mine, :, :length], layer_values[mine, :, :length])
    rows.advance(length)
