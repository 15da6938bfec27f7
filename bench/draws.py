"""What the engine's own picks cost per step: ``draw_rows`` on one step's logits.

With the engine in its child process, a sampled step's rows are drawn there
(``sampling.draw_rows``), between one forward pass and the next, so every
microsecond of it is a microsecond the engine does not compute. This times
it alone, warm, for the loads ``bench/serve.py`` runs:

* ``sampled``: temperature 1, no filter, no logprobs (the rows are drawn in
  groups, ``draw_together``);
* ``top-5``: the same with ``logprobs: 5`` (the draw, then ``reduce_rows``);
* ``top-p``: temperature 0.8, top_p 0.9;
* ``filters``: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05 (what
  llama.cpp's clients send);

at batch 1, 16 and 64, for the default model's vocabulary (1,920 ids) and a
Qwen3-sized one (151,936). Prints the median of ``--repeats`` timings of
``--steps`` calls, in µs per step. To compare two trees, run it under each:

    .venv/bin/python bench/draws.py
    PYTHONPATH=/tmp/old .venv/bin/python bench/draws.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from sluiceway.actors.sampling import Draw, draw_rows

_PLAIN = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "top": None}
LOADS: dict[str, dict[str, float | int | None]] = {
    "sampled": {**_PLAIN, "temperature": 1.0},
    "top-5": {**_PLAIN, "temperature": 1.0, "top": 5},
    "top-p": {**_PLAIN, "temperature": 0.8, "top_p": 0.9},
    "filters": {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05, "top": None},
}


def time_step(vocab: int, batch: int, load: str, steps: int, repeats: int) -> float:
    """Median µs per ``draw_rows`` call over ``repeats`` runs of ``steps``."""
    noise = np.random.default_rng(batch)
    logits = (noise.standard_normal((batch, vocab)) * 3).astype(np.float32)
    spec = LOADS[load]
    draws = [
        (
            i,
            Draw(
                temperature=float(spec["temperature"]),  # type: ignore[arg-type]
                top_p=float(spec["top_p"]),  # type: ignore[arg-type]
                top_k=int(spec["top_k"]),  # type: ignore[arg-type]
                min_p=float(spec["min_p"]),  # type: ignore[arg-type]
                uniform=float(noise.random()),
                top=spec["top"],  # type: ignore[arg-type]
            ),
        )
        for i in range(batch)
    ]
    argmax = logits.argmax(axis=-1)
    for _ in range(max(3, steps // 10)):  # warm
        draw_rows(logits, argmax.copy(), draws)
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            draw_rows(logits, argmax.copy(), draws)
        timings.append((time.perf_counter() - start) / steps * 1e6)
    return statistics.median(timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, nargs="*", default=[1920, 151_936])
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print("| vocab | batch | " + " | ".join(f"{load} µs" for load in LOADS) + " |")
    print("|--:|--:|" + "--:|" * len(LOADS))
    for vocab in args.vocab:
        for batch in args.batch:
            steps = max(5, args.steps * 1920 // vocab)
            cells = [time_step(vocab, batch, load, steps, args.repeats) for load in LOADS]
            print(f"| {vocab:,} | {batch} | " + " | ".join(f"{c:,.0f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
