"""What overlapping graph building with compute would give the mlx engine.

Two greedy decode loops over the same mlx-lm model take turns, a few steps at
a time, in one process:

* ``sync``: build a step, evaluate it, read the token, build the next (the
  bare loop's way, and the engine's, until 28 Nov);
* ``overlapped``: ``mlx_lm``'s generator's way, and ``bench/bare.py``'s
  since: the argmax stays on the device, the next step is built from it and
  queued (``async_eval``) before the host reads the current token, so the
  Python that builds a step runs while the previous one computes.

Prints ms per step and the ratio at each batch size.

``--engine`` compares the same two ways through sluiceway's mlx engine
instead, as the server's decoding ahead drives it (each step's whole logits
read on the host, each row's argmax taken there):
``MlxEngine(queue_ahead=False)`` against the default, which queues the step
after each one as mlx-lm's generator does.

    LD_PRELOAD=.../libopenblas.so.0 OPENBLAS_THREAD_TIMEOUT=8 \\
        .venv/bin/python bench/mlx_overlap.py --model DIR [--batches 1 4 16] [--rounds 20]
        [--engine]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bare import rows

STEPS_PER_TURN = 8
WARM_UP_TURNS = 3


Step = Callable[[], list[list[int]]]


def loops(model: Any, vocab: int, batch: int, prompt: int) -> dict[str, Step]:
    """The two loops over one set of prompts; each step returns the tokens
    the host read (the sync loop: the step's own; the overlapped one: the
    previous step's, so its sequence starts one token earlier)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    def first(cache: list[Any]) -> Any:
        logits = model(mx.array(rows(batch, prompt, vocab)), cache=cache)
        return mx.argmax(logits[:, -1, :], axis=-1)[:, None]

    sync_cache = make_prompt_cache(model)
    sync_state = {"next": first(sync_cache)}
    mx.eval(sync_state["next"])

    def sync_step() -> list[list[int]]:
        logits = model(sync_state["next"], cache=sync_cache)
        sync_state["next"] = mx.argmax(logits[:, -1, :], axis=-1)[:, None]
        mx.eval(sync_state["next"])
        tokens: list[list[int]] = sync_state["next"].tolist()
        return tokens

    overlap_cache = make_prompt_cache(model)
    overlap_state = {"next": first(overlap_cache)}
    mx.async_eval(overlap_state["next"])

    def overlapped_step() -> list[list[int]]:
        logits = model(overlap_state["next"], cache=overlap_cache)
        following = mx.argmax(logits[:, -1, :], axis=-1)[:, None]
        mx.async_eval(following)
        tokens: list[list[int]] = overlap_state["next"].tolist()  # read while `following` computes
        overlap_state["next"] = following
        return tokens

    return {"sync": sync_step, "overlapped": overlapped_step}


def engine_loops(model_dir: Path, batch: int, prompt: int) -> dict[str, Step]:
    """The two ways through the engine; each step returns the tokens fed to
    the next one (each row's argmax, read on the host)."""
    import numpy as np

    from sluiceway.engines.loader import resolve_model
    from sluiceway.engines.mlx_engine import MlxEngine

    source = resolve_model(str(model_dir))
    vocab = int(source.vocab_size)
    steps: dict[str, Step] = {}
    for name, queue_ahead in (("engine", False), ("engine, queued ahead", True)):
        engine = MlxEngine(source, queue_ahead=queue_ahead)
        prompts = rows(batch, prompt, vocab)
        tokens = {
            slot: int(np.argmax(engine.prefill(slot, ids)[-1])) for slot, ids in enumerate(prompts)
        }
        steps[name] = _engine_step(engine, tokens)
    return steps


def _engine_step(engine: Any, tokens: dict[int, int]) -> Step:
    state = {"tokens": tokens}

    def step() -> list[list[int]]:
        result = engine.start_decode_chained(state["tokens"])()
        picks = result.logits.argmax(axis=-1).tolist()
        state["tokens"] = dict(zip(result.slots, picks, strict=True))
        return [[int(pick)] for pick in picks]

    return step


def measure(steps: dict[str, Step], rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(WARM_UP_TURNS + rounds):
        for name, step in steps.items():
            started = time.perf_counter()
            for _ in range(STEPS_PER_TURN):
                step()
            times[name].append((time.perf_counter() - started) / STEPS_PER_TURN)
    return {name: statistics.median(t[WARM_UP_TURNS:]) for name, t in times.items()}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=20, help="turns per loop and batch")
    parser.add_argument(
        "--engine",
        action="store_true",
        help="through sluiceway's mlx engine, without and with queue_ahead",
    )
    args = parser.parse_args(argv)
    first, second = ("engine", "engine, queued ahead") if args.engine else ("sync", "overlapped")
    if args.engine:
        make = functools.partial(engine_loops, args.model)
    else:  # the engine loads the model itself
        from mlx_lm.utils import load_model

        model, config = load_model(args.model)
        make = functools.partial(loops, model, int(config["vocab_size"]))
    print(f"batch | {first} ms/step | {second} ms/step | {second} speed ÷ {first}")
    for batch in args.batches:
        step_time = measure(make(batch, args.prompt), args.rounds)
        before, after = step_time[first], step_time[second]
        print(f"{batch:5d} | {before * 1e3:12.2f} | {after * 1e3:18.2f} | {before / after:.3f}")


if __name__ == "__main__":
    main()
