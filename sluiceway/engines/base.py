"""The engine interface: prefill a slot, decode one step for a batch, free.

Every method blocks (it runs the model) and is called from a worker thread,
never from the event loop. Logits come back as NumPy ``float32`` arrays: the
sampler and the logprob reducer work on NumPy, and both engines hand their
arrays over without copying where the memory allows (mlx's unified memory, a
CPU torch tensor); on a CUDA device this is one device-to-host copy per step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

Logits = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineInfo:
    """What the server reports about the engine it runs."""

    name: str
    device: str
    dtype: str
    vocab_size: int
    max_context: int
    #: Bytes of keys and values one cached token takes (every layer); 0 when
    #: the engine cannot keep prefixes (the prefix cache is then off).
    kv_bytes_per_token: int = 0
    #: Memory free on the engine's device once the model was loaded (0:
    #: unknown). A measurement, not part of what the engine is.
    free_memory_bytes: int = field(default=0, compare=False)
    #: The CPU threads the engine computes on (0: not the engine's to set,
    #: as on a GPU or with mlx).
    threads: int = 0
    #: The engine's child process runs each batch size on ``threads`` or one
    #: fewer, whichever its steps measure faster (:mod:`sluiceway.actors.thread_tuner`).
    threads_tuned: bool = False


@dataclass(frozen=True, slots=True)
class DecodeResult:
    """One decode step: ``logits[i]`` is the next-token distribution of ``slots[i]``."""

    slots: tuple[int, ...]
    logits: Logits


@dataclass(frozen=True, slots=True, kw_only=True)
class KeepKV:
    """Copy positions ``[start, end)`` of ``slot``'s cache (prefilled or
    running) into a new prefix-cache entry ``entry``."""

    entry: int
    slot: int
    start: int
    end: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SplitKV:
    """Cut entry ``entry`` after its first ``at`` positions: those become entry
    ``head`` (or are dropped when ``head`` is None), ``entry`` keeps the rest."""

    entry: int
    at: int
    head: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class DropKV:
    """Forget entry ``entry`` (an unknown entry is no error)."""

    entry: int


#: An edit of the engine's prefix-cache entries (``sluiceway.actors.prefix_cache``
#: decides them; the engine only stores and copies).
CacheOp = KeepKV | SplitKV | DropKV


class Engine(Protocol):
    """A model runner that owns a KV cache per slot and decodes slots in batches.

    A slot is created by :meth:`prefill` (which may be called several times to
    prefill a long prompt in chunks), joins the running batch the first time
    :meth:`decode` names it, and leaves it with :meth:`free`. Rows of different
    lengths decode together; adding or dropping one never recomputes the others.
    """

    @property
    def info(self) -> EngineInfo: ...

    def prefill(self, slot: int, token_ids: Sequence[int], *, all_logits: bool = False) -> Logits:
        """Append ``token_ids`` to the slot's cache (creating the slot).

        Returns the logits of the last position as a ``[1, vocab]`` array, or of
        every position (``[len(token_ids), vocab]``) when ``all_logits``.
        """
        ...

    def fork(self, source: int, target: int) -> None:
        """Copy a prefilled slot that has not decoded yet into a new slot."""
        ...

    def decode(self, tokens: Mapping[int, int]) -> DecodeResult:
        """Feed one token to each slot named and return each slot's next logits.

        ``tokens`` names every slot in the running batch plus any newly
        prefilled slots, which join the batch here.
        """
        ...

    def start_decode(self, tokens: Mapping[int, int]) -> Callable[[], DecodeResult]:
        """:meth:`decode` in two halves: this one does what needs the GIL and
        starts the computation (mlx: builds the graph and ``async_eval``s it);
        the returned call waits for it. An engine that computes eagerly
        returns a call that does the whole decode."""
        ...

    def free(self, slot: int) -> None:
        """Drop the slot and its cache, wherever it is."""
        ...

    def undo_decode(self) -> None:
        """Forget the last :meth:`decode` of every running row, as if it never ran.

        Only valid right after a decode. A slot that joined the batch in it
        stays in the batch, holding its prompt, as a prefilled slot that has
        not decoded yet; the next decode names it like every running row.
        Decoding ahead (``sluiceway.actors.run_ahead``) uses it to take back a
        step it ran before the scheduler's plan, when the plan asks for
        something else.
        """
        ...

    def restore(self, slot: int, entries: Sequence[int], length: int) -> None:
        """Create ``slot`` holding a cached prefix: the first ``length``
        positions of ``entries``' keys and values laid end to end. The slot
        then takes :meth:`prefill` calls for the rest of its prompt."""
        ...

    def cache_op(self, op: CacheOp) -> None:
        """Apply one edit to the prefix-cache entries. A :class:`DropKV`
        never fails (the index has forgotten the entry already)."""
        ...

    def release_memory(self) -> None:
        """Give back what the engine keeps only to go faster, not to be
        correct: an idle batch's buffers kept for reuse, the device
        allocator's cache. Called while no slot is in use (the prefix-cache
        entries stay)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class ChainingEngine(Protocol):
    """An engine that can queue the step after a decode before that decode is
    read (mlx: the device computes while Python builds the next graph)."""

    @property
    def chains(self) -> bool:
        """Whether :meth:`start_decode_chained` queues the step after (else
        it is :meth:`Engine.start_decode`)."""
        ...

    def start_decode_chained(self, tokens: Mapping[int, int]) -> Callable[[], DecodeResult]:
        """:meth:`Engine.start_decode`, and the step after it queued at once,
        every row fed its argmax. A later :meth:`Engine.start_decode` (or
        this) that names the same rows with those tokens takes that step over;
        any other call behaves as if it had never been queued."""
        ...


@runtime_checkable
class PackingEngine(Protocol):
    """An engine that can prefill prompt chunks inside a decode step's forward pass."""

    @property
    def packs_prefills(self) -> bool:
        """Whether :meth:`decode_prefilling` works for this model."""
        ...

    def decode_prefilling(
        self, tokens: Mapping[int, int], chunks: Sequence[tuple[int, Sequence[int]]]
    ) -> tuple[DecodeResult, list[Logits]]:
        """:meth:`Engine.decode` with each ``(slot, token_ids)`` chunk
        prefilled in the same pass (as :meth:`Engine.prefill` would; the
        slots join the batch at a later decode); returns the decode's result
        and each chunk's last logits, ``[1, vocab]``. Taking the step back
        (:meth:`Engine.undo_decode`) takes back its decode only."""
        ...

    def prefills_apart(self, chunks: Sequence[tuple[int, int]]) -> bool:
        """Whether new prompts' chunks, given as ``(slot, length)``, are
        cheaper prefilled in passes of their own, with the decode run on its
        own after them, than packed into the decode's pass: true where those
        passes run a faster prefill than a decode step can carry."""
        ...


def config_max_context(config: Mapping[str, Any]) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return 4096
