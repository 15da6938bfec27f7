"""OpenBLAS's thread count, where the mlx engine's CPU backend runs on it.

mlx's CPU backend hands its matrix products to whatever BLAS the process
resolved ``cblas_sgemm`` to: the reference BLAS bundled with ``mlx[cpu]``
(one thread), or OpenBLAS where it is preloaded (``LD_PRELOAD``, as
``bench/serve.py`` does). OpenBLAS computes on every core by default. On a
small host that is the trade the transformers engine's thread count makes
(docs/architecture.md, "Engine threads"): on the tiny default model a
second OpenBLAS thread does not speed the bare loop (2.2-2.9 ms a step at
batch 1 and 4.4-5.9 at 16, on one thread or two, 29 Nov) and in the server
it takes the core the event loop needs; on the large benchmark model it
makes the bare loop's steps 20-25% shorter. ``--engine-threads`` sets the
count, through OpenBLAS's own ``openblas_set_num_threads``.

OpenBLAS is found by its exported symbols in the process's global scope,
so nothing is loaded here: without OpenBLAS (the bundled reference BLAS,
Accelerate on macOS, or Metal) there is no count to set.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class OpenBlasThreads:
    """OpenBLAS's thread-count calls, bound in this process."""

    _get: Any
    _set: Any

    def count(self) -> int:
        return int(self._get())

    def set_count(self, count: int) -> None:
        self._set(ctypes.c_int(count))


def find_openblas(scope: Any = None) -> OpenBlasThreads | None:
    """OpenBLAS's thread controls, if OpenBLAS is loaded into ``scope``
    (default: the process's global symbols)."""
    library = ctypes.CDLL(None) if scope is None else scope
    getter = getattr(library, "openblas_get_num_threads", None)
    setter = getattr(library, "openblas_set_num_threads", None)
    if getter is None or setter is None:
        return None
    getter.restype = ctypes.c_int
    getter.argtypes = []
    setter.restype = None
    setter.argtypes = [ctypes.c_int]
    return OpenBlasThreads(getter, setter)
