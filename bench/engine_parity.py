"""Decode throughput: a bare transformers loop against both engines.

Builds (once, then reuses) a ~40M-parameter random Qwen3-shaped model and
prints decode tokens/s at several batch sizes for

* ``bare``: the model called directly with a ``DynamicCache``, argmax in torch,
  every row the same length (no padding, no mask): what a plain transformers
  decode loop does, with no engine around it;
* ``engine``: ``TransformersEngine`` on the same rows (argmax in NumPy on the
  returned logits, as the sampler sees them);
* ``ragged``: the engine on rows of different lengths (the padding-mask path);
* ``staggered``: the engine on rows one token apart (every other row one token
  shorter), as a wave of requests admitted over two steps decodes;
* ``mlx``: ``MlxEngine`` (on Linux, the mlx CPU backend).

Only decode steps are timed (prefill is excluded). The loops take turns step
by step, so that other load on the host hits every loop alike, and tokens/s is
the batch size over the lower-quartile step time (other load only adds time). With ``--threads 1`` a last
column gives engine/bare in thread CPU time, the steadiest overhead measure.

    .venv/bin/python bench/engine_parity.py [--threads N] [--batches 1 4 16 32] [--steps 48]
        [--prompt 64] [--skip-mlx]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from models import VOCAB, parameter_count, parity_model

from sluiceway.engines.base import Engine
from sluiceway.engines.loader import ModelSource, resolve_model

PROMPT = 64  # tokens per row; ragged rows are PROMPT/4 .. 2*PROMPT-1
WARMUP = 2


#: Row lengths: all ``length``; random in ``length/4 .. 2*length-1``; or
#: every other row one token shorter.
Shape = Literal["equal", "ragged", "staggered"]


def prompts(batch: int, shape: Shape = "equal", length: int = PROMPT) -> list[list[int]]:
    rng = np.random.default_rng(batch)
    if shape == "ragged":
        lengths = [int(n) for n in rng.integers(length // 4, length * 2, batch)]
    elif shape == "staggered":
        lengths = [length - row % 2 for row in range(batch)]
    else:
        lengths = [length] * batch
    return [[int(t) for t in rng.integers(0, 500, n)] for n in lengths]


Step = Callable[[], None]


def bare_loop(model: Any, batch: int, prompt: int) -> tuple[Step, Callable[[], None]]:
    """The model called directly: ``DynamicCache``, no mask, argmax in torch."""
    import torch
    from transformers import DynamicCache

    from sluiceway.engines.torch_engine import cache_keyword

    keyword = cache_keyword(model)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        rows = prompts(batch, length=prompt)
        out = model(input_ids=torch.tensor(rows), **{keyword: cache})
    state = {"next": out.logits[:, -1].argmax(-1, keepdim=True)}

    def step() -> None:
        with torch.inference_mode():
            logits = model(input_ids=state["next"], use_cache=True, **{keyword: cache}).logits
            state["next"] = logits[:, -1].argmax(-1, keepdim=True)

    return step, cache.reset


def engine_loop(
    engine: Engine, batch: int, prompt: int, shape: Shape = "equal"
) -> tuple[Step, Callable[[], None]]:
    """An engine decoding ``batch`` rows, argmax in NumPy (what the sampler sees)."""
    rows = prompts(batch, shape, length=prompt)
    tokens = {slot: int(np.argmax(engine.prefill(slot, row)[-1])) for slot, row in enumerate(rows)}

    def step() -> None:
        result = engine.decode(tokens)
        for slot, next_token in zip(result.slots, result.logits.argmax(axis=-1), strict=True):
            tokens[slot] = int(next_token)

    def done() -> None:
        for slot in list(tokens):
            engine.free(slot)

    return step, done


@dataclass(frozen=True, slots=True)
class Timing:
    wall: float  # seconds per step, lower quartile
    cpu: float  # CPU seconds of the calling thread per step, lower quartile


def lower_quartile(samples: list[float]) -> float:
    """Other load on the host only ever adds time, so the fast steps are the signal."""
    return statistics.quantiles(samples, n=4)[0]


def measure(steps: dict[str, Step], rounds: int) -> dict[str, Timing]:
    """Wall and thread-CPU seconds per step of each loop, one step each in turn.

    Taking turns step by step gives every loop the same share of whatever
    else the host is doing. With one torch thread all of torch's work runs on
    the calling thread, and its CPU time is the steadiest measure of overhead.
    """
    wall: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        for _ in range(WARMUP):
            step()
    for _ in range(rounds):
        for name, step in steps.items():
            started, started_cpu = time.perf_counter(), time.thread_time()
            step()
            cpu[name].append(time.thread_time() - started_cpu)
            wall[name].append(time.perf_counter() - started)
    return {name: Timing(lower_quartile(wall[name]), lower_quartile(cpu[name])) for name in steps}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--steps", type=int, default=48, help="timed steps per loop and batch")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens per row")
    parser.add_argument("--threads", type=int, help="torch threads (sets OMP_NUM_THREADS)")
    parser.add_argument("--skip-mlx", action="store_true")
    args = parser.parse_args(argv)
    if args.threads:  # before torch is imported, so that OpenMP reads it too
        os.environ["OMP_NUM_THREADS"] = str(args.threads)

    import torch
    from transformers import AutoModelForCausalLM

    from sluiceway.engines.mlx_engine import MlxEngine
    from sluiceway.engines.torch_engine import TransformersEngine

    source: ModelSource = resolve_model(str(parity_model(args.vocab)))
    # The engine sets torch's thread count for the process, so the bare loop
    # below runs with the same threads.
    engine = TransformersEngine(source, device="cpu", dtype="float32")
    # More engines: an engine decodes all its running rows in every step.
    ragged = TransformersEngine(source, device="cpu", dtype="float32")
    staggered = TransformersEngine(source, device="cpu", dtype="float32")
    bare: Any = AutoModelForCausalLM.from_pretrained(
        str(source.path), local_files_only=True, dtype=torch.float32
    )
    bare.eval()
    mlx = None if args.skip_mlx else MlxEngine(source)
    threads = torch.get_num_threads()
    print(
        f"model: {parameter_count(args.vocab) / 1e6:.1f}M parameters, prompt {args.prompt} tokens "
        f"(ragged: {args.prompt // 4}-{args.prompt * 2 - 1}), {args.steps} interleaved steps per loop, "
        f"torch threads {threads}"
    )
    header = ["batch", "bare", "engine", "engine/bare", "ragged", "ragged/bare"]
    header += ["staggered", "stag./bare", "mlx"]
    if threads == 1:
        header.append("cpu e/b")  # the same ratio in thread CPU time
    print("tokens/s (batch over the lower-quartile step time)")
    print(" | ".join(f"{h:>11}" for h in header))
    for batch in args.batches:
        loops = {
            "bare": bare_loop(bare, batch, args.prompt),
            "engine": engine_loop(engine, batch, args.prompt),
            "ragged": engine_loop(ragged, batch, args.prompt, "ragged"),
            "staggered": engine_loop(staggered, batch, args.prompt, "staggered"),
        }
        if mlx is not None:
            loops["mlx"] = engine_loop(mlx, batch, args.prompt)
        timings = measure({name: step for name, (step, _) in loops.items()}, args.steps)
        for _, done in loops.values():
            done()
        rate = {name: batch / timing.wall for name, timing in timings.items()}
        cells = [
            f"{batch}",
            f"{rate['bare']:.1f}",
            f"{rate['engine']:.1f}",
            f"{rate['engine'] / rate['bare']:.3f}",
            f"{rate['ragged']:.1f}",
            f"{rate['ragged'] / rate['bare']:.3f}",
            f"{rate['staggered']:.1f}",
            f"{rate['staggered'] / rate['bare']:.3f}",
            f"{rate['mlx']:.1f}" if "mlx" in rate else "-",
        ]
        if threads == 1:
            cells.append(f"{timings['bare'].cpu / timings['engine'].cpu:.3f}")
        print(" | ".join(f"{c:>11}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
