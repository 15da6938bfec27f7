"""How much memory is still free, for sizing the prefix cache by default;
and giving the heap's free memory back to the system once a burst is over."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
from collections.abc import Callable
from pathlib import Path

MEMINFO = Path("/proc/meminfo")


def host_available_bytes() -> int:
    """Memory the host can still give without swapping: Linux's
    ``MemAvailable`` (free pages plus reclaimable caches), else the free
    pages ``sysconf`` reports; 0 when neither is known."""
    with contextlib.suppress(OSError, ValueError):
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    return 0


#: glibc's ``malloc_trim``, where the C library has one (None elsewhere:
#: musl, macOS; their allocators hand memory back on their own terms).
_malloc_trim: Callable[[int], int] | None = None
with contextlib.suppress(OSError, AttributeError):
    _malloc_trim = ctypes.CDLL(None).malloc_trim


def give_back_heap() -> bool:
    """Hand the heap's free pages back to the system, in every malloc arena.

    glibc keeps what a burst freed: each thread that allocated (the engine's,
    the tokenizer's, the worker pool's) has an arena of its own, and after a
    large block is freed glibc raises its mmap threshold, so that the next
    ones -- a batch's logits, a step's tensors -- come from the arenas and go
    back to them, not to the system. ``malloc_trim(0)`` releases every whole
    free page of every arena (the blocks still in use stay where they are).
    Cyclic garbage is collected first, so that what it holds is free too.
    Returns whether any memory went back. Blocks the calling thread for a
    few milliseconds: call it from a worker thread while idle."""
    gc.collect()
    if _malloc_trim is None:
        return False
    return bool(_malloc_trim(0))
