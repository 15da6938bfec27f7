"""Tokens in, tokens out against chat, on one server: the throughput of
``/inference/v1/generate`` as a ratio of ``/v1/chat/completions``'.

    .venv/bin/python bench/tokens.py [--engine transformers|mlx] [--model tiny|large]
        [--concurrency 1 16] [--rounds 3] [--max-tokens 128] [--prompt-tokens 64]

One server (ours, ``--max-num-seqs`` the largest concurrency) and the load
generator of ``bench/loadgen.py``: closed-loop streaming clients, greedy,
``ignore_eos``, a fixed ``max_tokens``. Both endpoints get the same prompts:
chat sends each as a user message; generate sends the ids ``/tokenize`` gives
for that message (what chat's template renders), so both prefill the same
tokens and decode as many. The only difference is the output path: chat
detokenizes, runs the parsers and frames text; generate frames ids.

At each concurrency the two take turns for ``--rounds`` rounds (chat first in
even rounds, generate first in odd ones), each turn waiting for a quiet host
first; every round gives a ratio generate ÷ chat of the tokens per second
(prefill included) and of the steady decode rate, and the median over rounds
is reported with the spread, so that the host's drift over minutes does not
decide it. The CPU other processes used during each turn is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
from hostload import Span, wait_quiet
from loadgen import Level, Prompt, Target, prompts_of_length, run_level, wait_healthy
from models import serving_model, shipped_corpus, synthetic_corpus

from sluiceway.engines.default_model import default_model_dir

PYTHON = sys.executable
APIS = ("chat", "generate")


def model_and_text(key: str) -> tuple[Path, str]:
    if key == "large":
        return serving_model(), synthetic_corpus(seed=1, lines=4000)
    return default_model_dir(), shipped_corpus()


def tokenized(base_url: str, texts: Sequence[str]) -> list[list[int]]:
    """Each text as chat renders it in a user message, as ids."""
    with httpx.Client(timeout=60) as client:
        return [
            client.post(
                base_url + "/tokenize", json={"messages": [{"role": "user", "content": text}]}
            ).json()["tokens"]
            for text in texts
        ]


def turn(
    target: Target, prompts: Iterator[Prompt], concurrency: int, args: argparse.Namespace
) -> tuple[Level, float]:
    wait_quiet(args.quiet)
    span = Span.start()
    level = asyncio.run(
        run_level(
            target,
            prompts,
            concurrency=concurrency,
            requests_per_client=args.requests_per_client,
            max_tokens=args.max_tokens,
        )
    )
    if level.errors:
        raise RuntimeError(f"{target.api}: {level.first_errors()}")
    return level, span.other_cores()


def measure(base_url: str, model: Path, texts: list[str], args: argparse.Namespace) -> str:
    ids = tokenized(base_url, texts)
    prompts: dict[str, Iterator[Prompt]] = {
        "chat": itertools.cycle(texts),
        "generate": itertools.cycle(ids),
    }
    targets = {api: Target(base_url, str(model), api=api) for api in APIS}  # type: ignore[arg-type]
    for api in APIS:  # warm-up
        turn(targets[api], prompts[api], max(args.concurrency), args)
    lines = [
        f"prompt {len(ids[0])} tokens (chat's rendering), {args.max_tokens} generated, "
        f"{args.rounds} rounds per level, median [min, max] over rounds",
        "",
        "| concurrency | chat tok/s | generate tok/s | generate ÷ chat (tok/s) "
        "| generate ÷ chat (decode) | other CPU (cores) |",
        "|---|---|---|---|---|---|",
    ]
    for concurrency in args.concurrency:
        ratios, decode_ratios, rates, others = [], [], {api: [] for api in APIS}, []
        for index in range(args.rounds):
            order = APIS if index % 2 == 0 else APIS[::-1]
            levels: dict[str, Level] = {}
            for api in order:
                levels[api], other = turn(targets[api], prompts[api], concurrency, args)
                rates[api].append(levels[api].throughput)
                others.append(other)
                print(
                    f"  c={concurrency:<3} round {index} {api:>8}: "
                    f"{levels[api].throughput:8.1f} tok/s, decode {levels[api].decode_throughput:8.1f}"
                    f" (other CPU {other:.2f})",
                    flush=True,
                )
            ratios.append(levels["generate"].throughput / levels["chat"].throughput)
            decode_ratios.append(
                levels["generate"].decode_throughput / levels["chat"].decode_throughput
            )
        lines.append(
            f"| {concurrency} | {statistics.median(rates['chat']):.1f} "
            f"| {statistics.median(rates['generate']):.1f} | {spread(ratios)} "
            f"| {spread(decode_ratios)} | {statistics.median(others):.2f} |"
        )
    return "\n".join(lines)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["transformers", "mlx"], default="transformers")
    parser.add_argument("--model", choices=["tiny", "large"], default="tiny")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=8871)
    parser.add_argument(
        "--quiet", type=float, default=0.5, help="wait until others use fewer cores than this"
    )
    args = parser.parse_args(argv)
    model, text = model_and_text(args.model)
    needed = 2 * max(args.concurrency) * args.requests_per_client
    texts = prompts_of_length(str(model / "tokenizer.json"), text, args.prompt_tokens, needed)
    command = [
        *(PYTHON, "-m", "sluiceway", "serve", "--model", str(model), "--engine", args.engine),
        *("--port", str(args.port), "--max-num-seqs", str(max(args.concurrency))),
        *("--log-level", "warning"),
    ]
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            base_url = f"http://127.0.0.1:{args.port}"
            asyncio.run(wait_healthy(base_url, 600, lambda: server.poll() is None))
            report = measure(base_url, model, texts, args)
        finally:
            server.terminate()
            server.wait(30)
    print(f"\n{args.engine}, {args.model} model: {report}")
    print(json.dumps({"argv": sys.argv[1:]}))


if __name__ == "__main__":
    main()
