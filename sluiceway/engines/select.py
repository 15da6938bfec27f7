"""Choosing and building an engine: ``--engine mlx|transformers|auto``.

``auto`` prefers mlx where it has a Metal GPU (Apple silicon), then
transformers wherever torch imports (on Linux CPUs torch is much faster than
the mlx CPU wheel, and it is the only CUDA path we ship), and falls back to mlx
on the CPU. Imports are lazy so that a host without torch, or without mlx,
can still run the other engine.
"""

from __future__ import annotations

import importlib.util
import logging

from sluiceway.engines.base import Engine
from sluiceway.engines.device import resolve_device
from sluiceway.engines.loader import ModelSource

logger = logging.getLogger(__name__)

ENGINES = ("auto", "mlx", "transformers")


def choose_engine(choice: str) -> str:
    """Resolve ``--engine`` to ``"mlx"`` or ``"transformers"`` and log why."""
    if choice not in ENGINES:
        raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, not {choice!r}")
    if choice != "auto":
        logger.info("engine: %s (asked for)", choice)
        return choice
    if _metal_available():
        logger.info("engine: mlx (auto: a Metal GPU is available)")
        return "mlx"
    if _torch_importable():
        logger.info("engine: transformers (auto: no Metal GPU; torch imports)")
        return "transformers"
    logger.info("engine: mlx (auto: no Metal GPU and no torch; mlx runs on the CPU)")
    return "mlx"


def in_child_process_by_default(name: str, device: str = "auto") -> bool:
    """Whether engine ``name`` runs in a child process unless told otherwise.

    On the CPU both engines do. In the server's process the engine thread's
    Python (mlx builds each step's graph in Python; a transformers forward
    makes hundreds of Python-level calls) contends for the GIL with the event
    loop's per-token work. In a child process, on a 2-core host: mlx on the
    large benchmark model kept 0.93-0.95 of the bare decode rate at
    concurrency 1 instead of 0.84-0.88; transformers on the tiny default
    model, with its thread count chosen by timing
    (:mod:`sluiceway.actors.thread_tuner`), streamed 1.4-2.2x the tokens/s
    at 64 streams and ~0.2 more of the bare rate at 16 (level at 1), while
    the compute-bound benchmark model lost ~0.05-0.1 at 16 in most pairings
    (docs/architecture.md, "Engine threads"). On a GPU (Metal, CUDA) the placement is unmeasured,
    and the engine keeps its thread.
    """
    if name == "mlx":
        return not _metal_available()
    # An explicit device is taken at its word; whether it exists is for the
    # engine to say when it loads.
    return (device if device != "auto" else resolve_device(device).type) == "cpu"


def process_environment(name: str, compile: str = "off") -> dict[str, str]:
    """Environment variables a child process running engine ``name`` starts with
    (each only where the server's own environment does not set it)."""
    if name == "transformers" and compile != "off":
        from sluiceway.engines.default_model import default_cache_dir

        # Inductor's own default is under /tmp, which many hosts empty at boot:
        # every bucket would then compile cold again (23-81 s each here).
        # OpenMP's wait policy is left at libgomp's default (idle threads
        # spin ~3 ms, then sleep): sleeping threads made the compiled step
        # up to 2x slower on a quiet host, and where another process takes a
        # core the child's thread tuner moves to the eager step on fewer
        # threads (docs/engines.md, "Spinning threads").
        return {"TORCHINDUCTOR_CACHE_DIR": str(default_cache_dir() / "inductor")}
    if name != "mlx":
        return {}
    from sluiceway.engines.mlx_engine import PROCESS_ENVIRONMENT

    return dict(PROCESS_ENVIRONMENT)


def make_engine(
    choice: str,
    source: ModelSource,
    *,
    device: str,
    dtype: str,
    threads: int = 0,
    compile: str = "off",
    compile_max_batch: int = 32,
    prepack: bool = True,
    frozen_weights: str = "auto",
) -> Engine:
    """Build the engine ``choice`` names for ``source`` (``auto`` is resolved
    by :func:`choose_engine`; a resolved name is not logged again).

    ``device``, ``dtype`` and ``threads`` (0: the default) apply to
    transformers; mlx picks its own device (Metal if present) and runs the
    checkpoint's dtype, ``compile``, ``compile_max_batch``, ``prepack`` and
    ``frozen_weights`` are transformers' (``--compile``, ``--prepack``,
    ``--frozen-weights``), and ``threads`` is its OpenBLAS's count where its CPU
    backend runs on OpenBLAS (:mod:`sluiceway.engines.blas`).
    """
    name = choice if choice in ("mlx", "transformers") else choose_engine(choice)
    if name == "transformers":
        from sluiceway.engines.torch_engine import TransformersEngine

        return TransformersEngine(
            source,
            device=device,
            dtype=dtype,
            threads=threads,
            compile=compile,
            compile_max_batch=compile_max_batch,
            prepack=prepack,
            frozen_weights=frozen_weights,
        )
    if device != "auto" or dtype != "auto":
        logger.warning("the mlx engine ignores --device %s and --dtype %s", device, dtype)
    if compile == "on":  # auto, the default, is no request to warn about
        logger.warning("the mlx engine ignores --compile %s", compile)
    from sluiceway.engines.mlx_engine import MlxEngine

    return MlxEngine(source, threads=threads)


def _metal_available() -> bool:
    try:
        import mlx.core as mx
    except ImportError:
        return False
    return bool(mx.metal.is_available())


def _torch_importable() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    try:
        import torch  # noqa: F401  # importing can still fail (a broken or mismatched build)
    except ImportError:
        return False
    return True
