"""Structured output's cost in the server: decode throughput with and without
a constraint, in one run.

    .venv/bin/python bench/structured.py [--model default] [--engine auto] [--rounds 3] [--tokens 256]

One server of ours on the embedded default model (``--model default``:
Qwen3 128x4, 1,920 ids, where a step is cheapest and a constraint's fixed
costs weigh most) or the serving benchmark's (``--model serving``,
``bench/models.py``: Qwen3 512x8, 16k vocabulary), streaming
``/v1/completions``, greedy,
``ignore_eos``, prompts of 64 tokens. The constraint is
``structured_outputs.grammar``: JSON objects of a schema in an array that
never closes, and every token is masked. The grammar accepts after each
object, so EOS is allowed there and, once taken, completes it (``ignore_eos``
does not stop that); constrained requests send ``min_tokens = max_tokens``
instead, which keeps EOS out wherever the grammar allows anything else, so
every constrained request runs to ``--tokens`` as a free one does. Phases, taking turns for ``--rounds``
rounds (the host's drift falls on both sides alike):

- ``c=1``: one free stream; one constrained stream;
- ``c=16``: sixteen free streams; sixteen constrained streams;
- ``c=16 mixed``: fifteen free streams beside one constrained stream. A
  greedy constrained row stays on the greedy fast path (the engine takes the
  argmax under the mask its plan carries, and decodes ahead) from its second
  token on; its first token goes through the sampler with every row of its
  step. The free streams' decode rate against sixteen free streams is what
  the one constrained row costs its neighbours.

Both kinds of request are greedy with no logprobs; they differ only in the
grammar and in how they are kept running to ``--tokens`` (``ignore_eos`` for
the free ones; ``min_tokens`` for the constrained ones, whose suppressed EOS
is folded into their mask).

Reported per phase: the streams' decode rate (tokens/s after each stream's
first token), the median over rounds, each round's constrained ÷ free ratio,
the server's CPU per generated token (its free ÷ constrained ratio is the
throughput ratio of a CPU-bound server, whatever share of a busy host it
got), and the CPU others used on the host meanwhile (a shared host). Then, off the
server, the mask's cost per token and row on the same vocabulary (llguidance
filling the bitmask, the sampler applying it, the matcher advancing;
``bench/grammar_mask.py``'s walk), for 1 and 16 rows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from grammar_mask import walk
from hostload import Span, tree_ticks
from loadgen import Level, Target, prompts_of_length, run_level, wait_healthy
from models import serving_model, synthetic_corpus

from sluiceway.engines.default_model import default_model_dir
from sluiceway.engines.grammar import GrammarEngine, lark_json
from sluiceway.engines.tokenizer import ModelTokenizer
from sluiceway.protocol.constraints import Constraint, ConstraintKind
from sluiceway.surfaces.tool_grammar import CallableTool, CallPlan, call_grammar

ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "active"],
    "additionalProperties": False,
}
#: JSON objects in an array that never closes: the grammar never completes.
GRAMMAR = f'start: "[" item (", " item)*\nitem: {lark_json(ITEM)}\n'

PROMPT_TOKENS = 64


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    free: int
    constrained: int


PHASES = (
    Phase("c=1 free", 1, 0),
    Phase("c=1 constrained", 0, 1),
    Phase("c=16 free", 16, 0),
    Phase("c=16 constrained", 0, 16),
    Phase("c=16 mixed", 15, 1),
)


@dataclass(slots=True)
class Outcome:
    #: Decode rate of the free and the constrained streams (tokens/s per stream, summed).
    free: float
    constrained: float
    other_cores: float
    #: The server's CPU per generated token (ms; all its threads, both kinds of stream).
    cpu_per_token: float


def per_stream(level: Level | None) -> float:
    """Tokens/s of one stream after its first token (0 when there is none)."""
    if level is None or not level.time_per_token:
        return 0.0
    return 1.0 / level.time_per_token


def constrained_target(base: str, tokens: int) -> Target:
    """Requests held to :data:`GRAMMAR` that run to ``tokens`` (see the module docstring)."""
    extra = (("structured_outputs", {"grammar": GRAMMAR}), ("min_tokens", tokens))
    return Target(base, "bench", ignore_eos=False, extra=extra)


async def run_phase(
    phase: Phase, base: str, server: int, prompts: Iterator[str], tokens: int
) -> Outcome:
    free, constrained = Target(base, "bench"), constrained_target(base, tokens)
    span = Span.start()
    ticks = tree_ticks(server)
    runs = []
    for target, count in ((free, phase.free), (constrained, phase.constrained)):
        if count:
            runs.append(
                run_level(
                    target, prompts, concurrency=count, requests_per_client=2, max_tokens=tokens
                )
            )
    levels = await asyncio.gather(*runs)
    cpu = (tree_ticks(server) - ticks) / os.sysconf("SC_CLK_TCK")
    generated = sum(level.tokens for level in levels)
    for level in levels:
        if level.errors:
            raise RuntimeError(f"{phase.name}: {level.first_errors()}")
        short = [s.tokens for s in level.samples if s.tokens != tokens]
        if short:
            raise RuntimeError(f"{phase.name}: requests of {short} tokens, not {tokens}")
    by_kind = iter(levels)
    free_level = next(by_kind) if phase.free else None
    constrained_level = next(by_kind) if phase.constrained else None
    return Outcome(
        per_stream(free_level),
        per_stream(constrained_level),
        span.other_cores(),
        cpu * 1e3 / generated,
    )


def start_server(model: Path, engine: str, port: int) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "sluiceway",
        "serve",
        "--model",
        str(model),
        "--served-model-name",
        "bench",
        "--port",
        str(port),
        "--engine",
        engine,
        "--log-level",
        "warning",
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.Popen(command, env=env)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def measure(args: argparse.Namespace, model: Path) -> dict[str, list[Outcome]]:
    port = free_port()
    server = start_server(model, args.engine, port)
    try:
        base = f"http://127.0.0.1:{port}"
        await wait_healthy(base, 600, alive=lambda: server.poll() is None)
        needed = (args.rounds + 1) * sum(2 * (p.free + p.constrained) for p in PHASES)
        text = synthetic_corpus(seed=1, lines=4000)
        prompts = iter(
            prompts_of_length(str(model / "tokenizer.json"), text, PROMPT_TOKENS, needed)
        )
        warm = Phase("warm-up", 4, 4)
        await run_phase(warm, base, server.pid, prompts, 32)
        results: dict[str, list[Outcome]] = {p.name: [] for p in PHASES}
        for round_ in range(args.rounds):
            for phase in PHASES:
                outcome = await run_phase(phase, base, server.pid, prompts, args.tokens)
                results[phase.name].append(outcome)
                print(
                    f"  round {round_ + 1} {phase.name:17s} free {outcome.free:8.3f} tok/s/stream"
                    f"  constrained {outcome.constrained:8.3f}  server CPU"
                    f" {outcome.cpu_per_token:6.2f} ms/token  others {outcome.other_cores:.2f} cores",
                    flush=True,
                )
        return results
    finally:
        server.terminate()
        server.wait(30)


def ratio_line(label: str, over: list[float], under: list[float]) -> str:
    ratios = [a / b for a, b in zip(over, under, strict=True) if b]
    rounds = " ".join(f"{r:.3f}" for r in ratios)
    return f"  {label:44s} {statistics.median(ratios):.3f}   (rounds: {rounds})"


def report(results: dict[str, list[Outcome]]) -> None:
    def rates(name: str, kind: str) -> list[float]:
        return [getattr(o, kind) for o in results[name]]

    print("\ndecode rate per stream (tokens/s, median of rounds):")
    for name, outcomes in results.items():
        free = statistics.median(o.free for o in outcomes)
        constrained = statistics.median(o.constrained for o in outcomes)
        others = max(o.other_cores for o in outcomes)
        print(
            f"  {name:17s} free {free:8.3f}  constrained {constrained:8.3f}  others ≤ {others:.2f} cores"
        )
    print("\nserver CPU per generated token (ms, median of rounds):")
    for name, outcomes in results.items():
        print(f"  {name:17s} {statistics.median(o.cpu_per_token for o in outcomes):6.2f}")
    print("\nratios (per round, same round):")
    print(
        ratio_line(
            "c=1: constrained ÷ free",
            rates("c=1 constrained", "constrained"),
            rates("c=1 free", "free"),
        )
    )
    print(
        ratio_line(
            "c=16: constrained ÷ free",
            rates("c=16 constrained", "constrained"),
            rates("c=16 free", "free"),
        )
    )
    print(
        ratio_line(
            "c=16: free beside one constrained ÷ all free",
            rates("c=16 mixed", "free"),
            rates("c=16 free", "free"),
        )
    )
    print(
        ratio_line(
            "c=16: the one constrained ÷ free",
            rates("c=16 mixed", "constrained"),
            rates("c=16 free", "free"),
        )
    )
    # On a shared host the streams' rates measure our share of the cores as
    # much as our work; the CPU a token costs the server does not depend on
    # that share, and bounds the rate a CPU-bound server reaches when alone.
    for level in ("c=1", "c=16"):
        print(
            ratio_line(
                f"{level}: free ÷ constrained server CPU per token",
                rates(f"{level} free", "cpu_per_token"),
                rates(f"{level} constrained", "cpu_per_token"),
            )
        )
    print(
        ratio_line(
            "c=16: all free ÷ mixed server CPU per token",
            rates("c=16 free", "cpu_per_token"),
            rates("c=16 mixed", "cpu_per_token"),
        )
    )


def mask_costs(model: Path, tokens: int) -> None:
    config = json.loads((model / "config.json").read_text())
    tokenizer = ModelTokenizer(model, config["vocab_size"])
    engine = GrammarEngine(tokenizer.hf, config["vocab_size"], tokenizer.eos_ids)
    tools = CallPlan(
        tools=(CallableTool(name="record", parameters=ITEM),), required=False, parallel=True
    )
    text = call_grammar(
        "hermes", tools, lambda piece: engine.markup(piece, tokenizer.single_token(piece))
    )
    constraints = {
        "the endless array": Constraint(kind=ConstraintKind.GRAMMAR, text=GRAMMAR),
        # Free text beside a strict tool (tool_choice auto): every content token is masked.
        "text or a strict call": Constraint(kind=ConstraintKind.GRAMMAR, text=text),
    }
    print(f"\nmasks off the server ({config['vocab_size']} ids), per row and token, median/p90:")
    print(f"  {'grammar':22s} {'rows':>4s} {'fill µs':>12s} {'apply µs':>12s} {'consume µs':>12s}")
    for label, constraint in constraints.items():
        for rows in (1, 16):
            times = walk(engine, constraint, rows, tokens, seed=1)
            cells = []
            for key in ("fill", "apply", "consume"):
                values = sorted(times[key])
                p90 = values[int(len(values) * 0.9)]
                cells.append(f"{statistics.median(values) * 1e6:6.1f}/{p90 * 1e6:<5.0f}")
            print(f"  {label:22s} {rows:4d} " + " ".join(f"{c:>12s}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default", choices=["default", "serving"])
    parser.add_argument("--engine", default="auto", choices=["auto", "mlx", "transformers"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256, help="max_tokens of every request")
    args = parser.parse_args()
    model = default_model_dir() if args.model == "default" else serving_model()
    print(
        f"model {model}; engine {args.engine}; {args.rounds} rounds of {len(PHASES)} phases, {args.tokens} tokens per request"
    )
    results = asyncio.run(measure(args, model))
    report(results)
    mask_costs(model, 2000)


if __name__ == "__main__":
    main()
