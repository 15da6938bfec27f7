"""The bare engine: a model in a plain decode loop -- no server, no HTTP, no engine class.

* ``transformers``: ``AutoModelForCausalLM`` called with a ``DynamicCache``,
  argmax in torch (what a hand-written transformers loop does);
* ``mlx``: the mlx-lm model with its per-layer ``KVCache`` list, argmax in mlx,
  each step built from the last one's argmax still on the device and queued
  (``async_eval``) before the host reads that argmax, as mlx-lm's generator
  does (the loop read each token before building the next step until 28 Nov,
  7-18% slower on the tiny model, ``bench/mlx_overlap.py`` (removed; ``git show deea191:bench/mlx_overlap.py``); the server's mlx
  engine overlaps the same way since then).

With ``--sample`` each step samples its next tokens at temperature 1 instead
of taking the argmax: the loop a sampled load is compared with, so that the
ratio leaves out the draw every sampling engine makes. In torch, one uniform
a row inverted on the softmax's cumulative sums (the server's method; on the
tiny model it costs the step 0-60 µs, where ``torch.multinomial`` or an
exponential race cost ~800 µs at batch 16, most of it torch's random
numbers); in mlx, ``mx.random.categorical`` (mlx-lm's sampler).

For each batch size it prefills ``batch`` random prompts of ``--prompt``
tokens (untimed), then times ``--tokens`` decode steps, so the steps cover the
same positions as a served request with that prompt and ``max_tokens``. It
repeats that ``--repeats`` times and keeps the fastest mean step. Prints one
JSON object per batch size on stdout:

    {"batch": 4, "step": 0.0231, "tokens_per_s": 173.2}

    .venv/bin/python bench/bare.py --engine transformers --model DIR [--batches 1 4 16]

With ``--compare-compile`` (transformers) it measures, in this one process,
three loops at each batch size, interleaved within each repeat: the bare
loop above (``bare``), our engine's eager decode step (``eager``:
``TransformersEngine.decode``, argmax in NumPy as the server's sampler
takes it) and its compiled step (``compiled``: ``--compile on``,
:mod:`sluiceway.engines.torch_compiled`). It prints one JSON object per loop
and batch size, then one summary with the ratios, each loop's start-up
(model load; for ``compiled`` each bucket's first step, which compiles it),
the load average before and after, and torch.compile's graph and recompile
counts (set ``TORCH_LOGS=recompiles`` to see each one's reason). Unless ``--warm-cache``, Inductor's cache is a fresh temporary
directory, so the compile times are cold ones:

    nice -n 5 .venv/bin/python bench/bare.py --engine transformers --model DIR \
        --compare-compile [--batches 1 4 16] [--dtype float32]

With ``--compare-engine`` (mlx) it measures, in this one process, the bare
mlx loop above (``bare``) and our ``MlxEngine``'s chained decode step
(``start_decode_chained``, argmax in NumPy as the server's sampler takes it)
at each batch size, interleaved within each repeat: ``engine`` on prompts of
``--prompt`` tokens as the bare loop's, ``engine-ragged`` on prompts spread
evenly over half to one and a half times that (the same mean; its rows
attend over a longer window than the bare loop's). ``--before REV`` adds
both again for the engine as of git revision ``REV``
(``before``/``before-ragged``). It prints one JSON object per loop and batch
size, then the ratios of each loop's tokens/s to the bare loop's, measured in
this run:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        OPENBLAS_THREAD_TIMEOUT=8 .venv/bin/python bench/bare.py --engine mlx \
        --model DIR --compare-engine [--before REV] [--batches 1 16 64]

With ``--stdin`` it then stays up and measures each batch size it reads from
stdin (one repeat each), so that a caller can measure the bare engine right
before and after measuring a server on the same host.

Run it in a process of its own: an mlx CPU thread pool and torch's OpenMP
threads in one process slow each other down badly on a small machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

Step = Callable[[], None]


def rows(batch: int, prompt: int, vocab: int, *, ragged: bool = False) -> list[list[int]]:
    """``batch`` random prompts of ``prompt`` tokens, or (``ragged``) of
    lengths spread evenly over ``prompt // 2 .. prompt * 3 // 2``."""
    rng = np.random.default_rng(batch)
    lengths = [prompt] * batch
    if ragged and batch > 1:
        lengths = [int(n) for n in np.linspace(prompt // 2, prompt * 3 // 2, batch).round()]
    return [[int(t) for t in rng.integers(0, min(vocab, 500), n)] for n in lengths]


def torch_loop(model_dir: str, sample: bool, dtype: str = "auto") -> Callable[[int, int], Step]:
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from sluiceway.engines.torch_engine import cache_keyword, resolve_dtype

    if "OMP_NUM_THREADS" not in os.environ:  # as the engine does
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    # The server's dtype: ``--dtype auto`` resolves as the engine resolves it.
    config = json.loads((Path(model_dir) / "config.json").read_text())
    chosen = resolve_dtype(dtype, config, torch.device("cpu"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=chosen)
    model.eval()
    vocab = int(model.config.vocab_size)
    keyword = cache_keyword(model)
    generator = torch.Generator().manual_seed(7)

    def pick(logits: torch.Tensor) -> torch.Tensor:
        if sample:  # one uniform a row, inverted on the cumulative sums (as the server draws)
            cumulative = torch.softmax(logits, -1).cumsum(-1)
            uniforms = torch.rand(logits.shape[0], 1, generator=generator) * cumulative[:, -1:]
            picks = torch.searchsorted(cumulative, uniforms, right=True)
            return picks.clamp_(max=logits.shape[-1] - 1)
        return logits.argmax(-1, keepdim=True)

    def start(batch: int, prompt: int) -> Step:
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            out = model(input_ids=torch.tensor(rows(batch, prompt, vocab)), **{keyword: cache})
        state = {"next": pick(out.logits[:, -1])}

        def step() -> None:
            with torch.inference_mode():
                logits = model(input_ids=state["next"], **{keyword: cache}).logits
                state["next"] = pick(logits[:, -1])

        return step

    return start


def engine_loop(
    model_dir: str, compile: str, dtype: str, startup: dict[str, float]
) -> Callable[[int, int], Step]:
    """Our transformers engine's decode step (``--compile`` ``compile``), greedy."""
    from sluiceway.engines.loader import resolve_model
    from sluiceway.engines.torch_engine import TransformersEngine

    started = time.perf_counter()
    engine = TransformersEngine(resolve_model(model_dir), dtype=dtype, compile=compile)
    startup["load"] = time.perf_counter() - started
    vocab = engine.info.vocab_size

    def start(batch: int, prompt: int) -> Step:
        for slot in range(batch + 64):  # whatever the last measurement left
            engine.free(slot)
        tokens = {
            slot: int(np.argmax(engine.prefill(slot, ids)[-1]))
            for slot, ids in enumerate(rows(batch, prompt, vocab))
        }

        def step() -> None:
            result = engine.decode(tokens)
            for slot, token in zip(result.slots, result.logits.argmax(axis=1), strict=True):
                tokens[slot] = int(token)

        return step

    return start


def compare_compile(args: argparse.Namespace) -> None:
    """``--compare-compile``: the bare loop, our eager step and our compiled step."""
    if not args.warm_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-cold-")
    from torch._dynamo.utils import counters

    load_before = os.getloadavg()
    startups: dict[str, dict[str, float]] = {"bare": {}, "eager": {}, "compiled": {}}
    started = time.perf_counter()
    loops = {"bare": torch_loop(args.model, args.sample, args.dtype)}
    startups["bare"]["load"] = time.perf_counter() - started
    for mode, name in (("off", "eager"), ("on", "compiled")):
        loops[name] = engine_loop(args.model, mode, args.dtype, startups[name])
    best = time_interleaved(loops, args, startups)
    ratios = {
        str(batch): {
            "compiled/eager": best["eager", batch] / best["compiled", batch],
            "compiled/bare": best["bare", batch] / best["compiled", batch],
            "eager/bare": best["bare", batch] / best["eager", batch],
        }
        for batch in args.batches
    }
    summary = {
        "ratios": ratios,
        "startup_s": startups,
        "graphs": counters["stats"]["unique_graphs"],
        # Every graph after the first is a recompile of the one step function:
        # one per bucket; a longer past (a symbolic size) adds none.
        "recompiles": counters["stats"]["unique_graphs"] - 1,
        "threads": torch_threads(),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "inductor_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR", "default"),
    }
    print(json.dumps(summary, indent=1))
    if not args.warm_cache:
        shutil.rmtree(os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)


def time_interleaved(
    loops: Mapping[str, Callable[[int, int], Step]],
    args: argparse.Namespace,
    startups: dict[str, dict[str, float]],
) -> dict[tuple[str, int], float]:
    """Each loop's fastest mean step at each batch size, the loops taking
    turns within each repeat; prints one JSON object per loop and batch size.
    ``startups[name]`` gets each loop's first step at each batch size."""
    for loop in loops.values():  # warm-up, as in main(); batch 1's graph compiles later
        loop(1, 8)
    best: dict[tuple[str, int], float] = {}
    for repeat in range(args.repeats):
        for batch in args.batches:
            for name, start in loops.items():
                step = start(batch, args.prompt)
                first = time.perf_counter()
                step()  # not timed: for ``compiled``, the bucket's graph compiles on its first step
                if repeat == 0:
                    startups.setdefault(name, {})[f"first_step_{batch}"] = (
                        time.perf_counter() - first
                    )
                began = time.perf_counter()
                for _ in range(args.tokens):
                    step()
                mean = (time.perf_counter() - began) / args.tokens
                best[name, batch] = min(best.get((name, batch), float("inf")), mean)
    for (name, batch), mean in best.items():
        print(json.dumps({"loop": name, "batch": batch, "tokens_per_s": batch / mean}))
    return best


def mlx_engine_loop(engine: Any, slots: list[int], *, ragged: bool) -> Callable[[int, int], Step]:
    """An ``MlxEngine``'s chained decode step, greedy, its argmax taken in
    NumPy. ``slots``: the engine's rows in use, whichever loop runs them."""
    vocab = engine.info.vocab_size

    def start(batch: int, prompt: int) -> Step:
        for slot in slots:  # whatever the last measurement on this engine left
            engine.free(slot)
        prompts = rows(batch, prompt, vocab, ragged=ragged)
        tokens = {
            slot: int(np.argmax(engine.prefill(slot, ids)[-1])) for slot, ids in enumerate(prompts)
        }
        slots[:] = tokens

        def step() -> None:
            result = engine.start_decode_chained(tokens)()
            for slot, token in zip(result.slots, result.logits.argmax(axis=1), strict=True):
                tokens[slot] = int(token)

        return step

    return start


def module_at(revision: str, path: str) -> ModuleType | None:
    """The module at ``path`` as it was at git ``revision`` (None where the
    file did not exist), loaded under a name of its own."""
    shown = subprocess.run(
        ["git", "show", f"{revision}:{path}"],
        cwd=Path(__file__).resolve().parent,
        capture_output=True,
        text=True,
    )
    if shown.returncode != 0:
        return None
    name = f"{Path(path).stem}_at_{revision}"
    file = Path(tempfile.mkdtemp(prefix="at-revision-")) / Path(path).name
    file.write_text(shown.stdout)
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def engine_at(revision: str) -> Any:
    """``MlxEngine`` as it was at git ``revision``, with the running rows of
    that revision too (``mlx_rows.py``, where it existed then): the engine
    imports them by name, so the current module stands aside while it loads."""
    rows_name = "sluiceway.engines.mlx_rows"
    current = sys.modules.get(rows_name)
    rows = module_at(revision, "sluiceway/engines/mlx_rows.py")
    if rows is not None:
        sys.modules[rows_name] = rows
    try:
        engine = module_at(revision, "sluiceway/engines/mlx_engine.py")
    finally:
        if current is not None:
            sys.modules[rows_name] = current
        else:
            sys.modules.pop(rows_name, None)
    if engine is None:
        raise SystemExit(f"no sluiceway/engines/mlx_engine.py at {revision}")
    return engine.MlxEngine


def compare_engine(args: argparse.Namespace) -> None:
    """``--compare-engine``: the bare mlx loop and our engine, interleaved."""
    from sluiceway.engines.loader import resolve_model
    from sluiceway.engines.mlx_engine import MlxEngine

    source = resolve_model(args.model)
    engines = {"engine": MlxEngine(source)}
    if args.before:
        engines["before"] = engine_at(args.before)(source)
    loops = {"bare": mlx_loop(args.model, sample=False)}
    for name, engine in engines.items():
        slots: list[int] = []
        loops[name] = mlx_engine_loop(engine, slots, ragged=False)
        loops[f"{name}-ragged"] = mlx_engine_loop(engine, slots, ragged=True)
    load_before = os.getloadavg()
    best = time_interleaved(loops, args, {})
    ratios = {
        str(batch): {
            f"{name}/bare": round(best["bare", batch] / best[name, batch], 4)
            for name in loops
            if name != "bare"
        }
        for batch in args.batches
    }
    summary = {"ratios": ratios, "load_before": load_before, "load_after": os.getloadavg()}
    print(json.dumps(summary, indent=1))


def torch_threads() -> int:
    import torch

    return int(torch.get_num_threads())


def mlx_loop(model_dir: str, sample: bool) -> Callable[[int, int], Step]:
    from pathlib import Path

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    model, config = load_model(Path(model_dir))
    vocab = int(config["vocab_size"])
    mx.random.seed(7)

    def pick(logits: mx.array) -> mx.array:
        if sample:
            return mx.random.categorical(logits)[:, None]
        return mx.argmax(logits, axis=-1)[:, None]

    def start(batch: int, prompt: int) -> Step:
        cache = make_prompt_cache(model)
        logits = model(mx.array(rows(batch, prompt, vocab)), cache=cache)
        state = {"next": pick(logits[:, -1, :])}
        mx.async_eval(state["next"])

        def step() -> None:
            logits = model(state["next"], cache=cache)
            following = pick(logits[:, -1, :])
            mx.async_eval(following)
            state["next"].tolist()  # the host reads a token while the next step computes
            state["next"] = following

        return step

    return start


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["transformers", "mlx"], required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 4, 16])
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128, help="timed decode steps")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sample", action="store_true", help="sample at temperature 1")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="transformers: the weights' dtype, resolved as the server's --dtype is",
    )
    parser.add_argument(
        "--stdin",
        action="store_true",
        help="after the batches, measure each batch size read from stdin (one per line)",
    )
    parser.add_argument(
        "--compare-compile",
        action="store_true",
        help="transformers: the bare loop, our eager step and our compiled step, side by side",
    )
    parser.add_argument(
        "--compare-engine",
        action="store_true",
        help="mlx: the bare loop and our engine's decode step, side by side",
    )
    parser.add_argument(
        "--before",
        metavar="REV",
        help="with --compare-engine: also the engine as of this git revision",
    )
    parser.add_argument(
        "--warm-cache",
        action="store_true",
        help="with --compare-compile: Inductor's usual cache, not a fresh one (warm start)",
    )
    args = parser.parse_args(argv)
    if args.compare_compile:
        if args.engine != "transformers":
            parser.error("--compare-compile measures the transformers engine")
        compare_compile(args)
        return
    if args.compare_engine:
        if args.engine != "mlx":
            parser.error("--compare-engine measures the mlx engine")
        compare_engine(args)
        return
    if args.engine == "transformers":
        start = torch_loop(args.model, args.sample, args.dtype)
    else:
        start = mlx_loop(args.model, args.sample)
    start(1, 8)()  # warm-up: first calls allocate and pick kernels

    def measure(batch: int, repeats: int) -> None:
        best = float("inf")
        for _ in range(repeats):
            step = start(batch, args.prompt)
            step()  # the first step after a prefill is not timed
            started = time.perf_counter()
            for _ in range(args.tokens):
                step()
            best = min(best, (time.perf_counter() - started) / args.tokens)
        print(json.dumps({"batch": batch, "step": best, "tokens_per_s": batch / best}), flush=True)

    for batch in args.batches:
        measure(batch, args.repeats)
    if args.stdin:
        print("ready", flush=True)
        for line in sys.stdin:
            if line.strip():
                measure(int(line), 1)


if __name__ == "__main__":
    main()
