"""Cost per token of whole text paths must not grow with the length of the reply.

Feeds 10k- and 100k-character documents (reasoning, content with tag and stop
near misses, tool calls, multi-byte characters) token by token through full
pipelines and prints microseconds per token for each length and their ratio.
A rescanning parser would show a ratio near 10; ours should be about 1.

    .venv/bin/python bench/parsers.py [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from sluiceway.parsers.pipeline import ChoicePipeline
from sluiceway.parsers.registry import TextPathOptions, ToolSchema, build_pipeline
from sluiceway.protocol.tokens import TokenTable

WORDS = [
    "the ",
    "model ",
    "thinks ",
    "about ",
    "a<b ",
    "x < y ",
    "é ",
    "漢字 ",
    "🙂 ",
    "\n",
    "code: ",
]
NEAR_MISSES = [
    "</thinking> ",
    "</thin ",
    "<tool_calls> ",
    "<tool_call x ",
    "</ ",
    "<div> ",
    "STO ",
    "STOP ",
    "<|endoftext ",
    "if (a<b) {}\n",
]
STOPS = ("STOP!", "<|endoftext|>")
TOOLS = (
    ToolSchema(
        name="search",
        parameters={"properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}},
    ),
)


def hermes_call(rng: random.Random) -> str:
    arguments = {"query": "".join(rng.choices(WORDS, k=6)), "limit": rng.randint(1, 9)}
    return (
        f'<tool_call>\n{{"name": "search", "arguments": {json.dumps(arguments)}}}\n</tool_call>\n'
    )


def coder_call(rng: random.Random) -> str:
    query = "".join(rng.choices(WORDS, k=6))
    return (
        "<tool_call>\n<function=search>\n<parameter=query>\n"
        f"{query}\n</parameter>\n<parameter=limit>\n{rng.randint(1, 9)}\n</parameter>\n"
        "</function>\n</tool_call>\n"
    )


def filler(rng: random.Random, length: int) -> str:
    parts: list[str] = []
    size = 0
    while size < length:
        part = rng.choice(NEAR_MISSES) if rng.random() < 0.2 else rng.choice(WORDS)
        parts.append(part)
        size += len(part)
    return "".join(parts)


def document(length: int, call: Callable[[random.Random], str], seed: int = 7) -> str:
    """Reasoning (30%), then content with a tool call every ~2000 characters."""
    rng = random.Random(seed)
    parts = ["<think>\n", filler(rng, length * 3 // 10), "</think>\n\n"]
    size = sum(len(p) for p in parts)
    while size < length:
        part = call(rng) if rng.random() < 0.1 else filler(rng, 200)
        parts.append(part)
        size += len(part)
    return "".join(parts)[:length]


def tokenize(text: str, seed: int = 11) -> tuple[TokenTable, list[int]]:
    """Random 1..8-byte pieces of the UTF-8 bytes (characters split mid-byte too)."""
    rng = random.Random(seed)
    data = text.encode()
    vocabulary: dict[bytes, int] = {}
    ids: list[int] = []
    position = 0
    while position < len(data):
        step = rng.randint(1, 8)
        ids.append(vocabulary.setdefault(data[position : position + step], len(vocabulary)))
        position += step
    return TokenTable(tuple(vocabulary), frozenset()), ids


@dataclass(frozen=True)
class Case:
    name: str
    call: Callable[[random.Random], str]
    make: Callable[[TokenTable], ChoicePipeline]


CASES = [
    Case("bare ChoicePipeline", hermes_call, ChoicePipeline),
    Case(
        "qwen3 + stop + hermes",
        hermes_call,
        lambda table: build_pipeline(
            table,
            TextPathOptions(
                reasoning_parser="qwen3", tool_parser="hermes", tools=TOOLS, stop=STOPS
            ),
        ),
    ),
    Case(
        "deepseek_r1 + stop + qwen3_coder",
        coder_call,
        lambda table: build_pipeline(
            table,
            TextPathOptions(
                reasoning_parser="deepseek_r1", tool_parser="qwen3_coder", tools=TOOLS, stop=STOPS
            ),
        ),
    ),
]


def per_token(case: Case, length: int, repeat: int) -> float:
    """Best-of-``repeat`` microseconds per token, feed and finish included."""
    table, ids = tokenize(document(length, case.call))
    best = float("inf")
    for _ in range(repeat):
        pipeline = case.make(table)
        start = time.perf_counter()
        for token_id in ids:
            pipeline.feed(token_id)
        pipeline.finish()
        best = min(best, time.perf_counter() - start)
    return best / len(ids) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(f"{'pipeline':34} {'10k µs/token':>13} {'100k µs/token':>14} {'ratio':>6}")
    for case in CASES:
        short = per_token(case, 10_000, args.repeat)
        long = per_token(case, 100_000, args.repeat)
        print(f"{case.name:34} {short:13.2f} {long:14.2f} {long / short:6.2f}")


if __name__ == "__main__":
    main()
