"""The serving benchmark's results and their markdown report (``bench/serve.py``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from loadgen import Level
from trace_server import MARKS, Summary

OURS = "sluiceway"
#: Targets: our decode rate over the bare engine's, on the large model, at
#: concurrency 1 and 16 (issue J's; issue P raised mlx's at 16 to 0.92).
TARGETS = {"mlx": (0.95, 0.92)}
DEFAULT_TARGETS = (0.95, 0.90)


@dataclass(frozen=True, slots=True)
class Settings:
    concurrency: tuple[int, ...]
    max_tokens: int
    prompt_tokens: int
    requests_per_client: dict[int, int]
    bare_repeats: int
    openblas: str | None
    peers: bool
    worker_class: str
    #: Cores used by other processes above which a measurement is repeated.
    busy: float
    retries: int
    trace: bool
    #: Extra environment for our server only (``--server-env K=V``), for experiments.
    server_env: tuple[tuple[str, str], ...] = ()
    server_args: tuple[str, ...] = ()
    #: Rounds of (bare, our level, bare, the peer's level) at each concurrency
    #: the bare engine has a batch size for; each server's median round is reported.
    paired_rounds: int = 1
    #: More fields for every request's body (``--body``/``--load``): sampling,
    #: logprobs; empty is greedy.
    body: tuple[tuple[str, object], ...] = ()
    #: Keep each server's log (``--keep-logs``).
    keep_logs: bool = False
    #: Spread the clients' starts over this many seconds (``--stagger``;
    #: ``loadgen.run_level``).
    stagger: float = 0.0
    #: The bare loop samples at temperature 1 instead of taking the argmax
    #: (``--bare-samples``; ``bench/bare.py --sample``).
    bare_samples: bool = False
    #: Also measure a bare loop on one torch thread around each paired round
    #: (``--one-thread-bare``; transformers only).
    one_thread_bare: bool = False


@dataclass(frozen=True, slots=True)
class Model:
    key: str  # "large" / "tiny"
    path: Path
    label: str
    prompts: tuple[str, ...]


@dataclass(slots=True)
class ServerRun:
    server: str
    levels: list[Level] = field(default_factory=list)
    #: Cores used by other processes during each level: a busy host skews a row.
    other_cpu: list[float] = field(default_factory=list)
    #: Cores used by the load generator (this process) during each level.
    client_cpu: list[float] = field(default_factory=list)
    failure: str | None = None
    note: str = ""
    #: A peer's version, flags, and what it could not do on the same requests.
    about: str = ""
    #: The bare engine measured right before and after each level (tokens/s
    #: and seconds per step, the mean of the two), for the levels it has a batch for.
    paired_bare: dict[int, float] = field(default_factory=dict)
    paired_step: dict[int, float] = field(default_factory=dict)
    #: Decode ÷ bare of every paired round, in the order they ran.
    paired_ratios: dict[int, list[float]] = field(default_factory=dict)
    #: The same over each request's middle half (``Level.middle_throughput``).
    paired_middle: dict[int, list[float]] = field(default_factory=dict)
    #: Decode ÷ the one-thread bare loop of every paired round, and over the
    #: middle half (``--one-thread-bare``).
    single_ratios: dict[int, list[float]] = field(default_factory=dict)
    single_middle: dict[int, list[float]] = field(default_factory=dict)
    #: The thread tuner's switches, as the server logged them.
    tuner: list[str] = field(default_factory=list)
    #: The bare engine's tokens/s and step around each paired round.
    round_bare: dict[int, list[tuple[float, float]]] = field(default_factory=dict)
    #: Tokens/s of every round at each concurrency, in the order they ran.
    round_throughput: dict[int, list[float]] = field(default_factory=dict)
    #: With --trace: per level, where the server's time went, and its CPU by thread role.
    traces: list[Summary | None] = field(default_factory=list)
    thread_cpu: list[dict[str, float]] = field(default_factory=list)
    level_ticks: list[dict[int, int]] = field(default_factory=list)

    def bare_for(self, section: Section, concurrency: int) -> float | None:
        return self.paired_bare.get(concurrency) or section.bare.get(concurrency)

    def level(self, concurrency: int) -> Level | None:
        return next((lv for lv in self.levels if lv.concurrency == concurrency), None)


@dataclass(slots=True)
class Section:
    engine: str
    model: Model
    bare: dict[int, float] = field(default_factory=dict)  # batch -> tokens/s
    bare_step: dict[int, float] = field(default_factory=dict)  # batch -> seconds
    bare_failure: str | None = None
    runs: list[ServerRun] = field(default_factory=list)

    def run(self, server: str) -> ServerRun | None:
        return next((r for r in self.runs if r.server == server), None)

    @property
    def peers(self) -> list[ServerRun]:
        return [r for r in self.runs if r.server != OURS]

    @property
    def has_bare_loop(self) -> bool:
        """False for vLLM's engine: ours and vLLM's own server run the same
        ``AsyncLLM``, so its section races the servers only (no bare-loop
        targets, no pipeline cost)."""
        return self.engine != "vllm"


def ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:.1f}"


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**missed**"


def rounds_of(paired: dict[int, list[float]]) -> str:
    return "; ".join(
        f"c={c}: {', '.join(f'{r:.3f}' for r in ratios)}{spread(ratios)}"
        for c, ratios in paired.items()
    )


def spread(ratios: Sequence[float]) -> str:
    """`` (mean m ± standard error)`` of several rounds' ratios."""
    if len(ratios) < 3:
        return ""
    error = float(np.std(ratios, ddof=1)) / len(ratios) ** 0.5
    return f" (mean {np.mean(ratios):.3f} ± {error:.3f})"


def section_table(section: Section, settings: Settings) -> list[str]:
    lines = [f"### {section.engine} engine, {section.model.key} model ({section.model.label})", ""]
    if section.bare:
        cells = ", ".join(f"batch {b}: **{r:.1f}** tok/s" for b, r in section.bare.items())
        how = "sampling at temperature 1" if settings.bare_samples else "argmax"
        lines += [f"Bare engine (plain decode loop, {how}, no server): {cells}.", ""]
    elif section.bare_failure:
        lines += [f"No bare engine figures: {section.bare_failure[-200:]}", ""]
    lines += [
        "| server | conc | tok/s | decode tok/s | bare tok/s | tok/s ÷ bare | decode ÷ bare "
        "| TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | tok/req | errors "
        "| client CPU | other CPU |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for run in section.runs:
        if run.failure is not None and not run.levels:
            lines.append(f"| {run.server} | - | failed: {run.failure[:120]} |" + " |" * 12)
            continue
        for level, other, client in zip(run.levels, run.other_cpu, run.client_cpu, strict=True):
            bare = run.bare_for(section, level.concurrency)
            ratio = f"{level.throughput / bare:.3f}" if bare else "-"
            decode_ratio = f"{level.decode_throughput / bare:.3f}" if bare else "-"
            lines.append(
                f"| {run.server} | {level.concurrency} | {level.throughput:.1f} "
                f"| {level.decode_throughput:.1f} | {f'{bare:.1f}' if bare else '-'} "
                f"| {ratio} | {decode_ratio} | {ms(level.ttft(50))} | {ms(level.ttft(99))} "
                f"| {ms(level.itl(50))} | {ms(level.itl(99))} | {level.tokens_per_request:.1f} "
                f"| {level.errors}{f' ({level.retries} reconnects)' if level.retries else ''} "
                f"| {client:.2f} | {other:.2f}{' ⚠' if other > settings.busy else ''} |"
            )
    lines.append("")
    for run in section.runs:
        if any(len(ratios) > 1 for ratios in run.paired_ratios.values()):
            lines.append(
                f"- {run.server}, decode ÷ bare of each paired round: {rounds_of(run.paired_ratios)}"
            )
            lines.append(
                f"- {run.server}, the same over each request's middle half "
                f"(the wave's edges left out): {rounds_of(run.paired_middle)}"
            )
        if run.single_ratios:
            lines.append(
                f"- {run.server}, decode ÷ the bare loop on one torch thread, each paired "
                f"round: {rounds_of(run.single_ratios)}; over the middle half: "
                f"{rounds_of(run.single_middle)}"
            )
        if run.tuner:
            lines.append(
                f"- {run.server}, the thread tuner's switches, in order: " + "; ".join(run.tuner)
            )
        if run.note or run.failure:
            lines.append(f"- {run.server}: {run.failure or ''} {run.note}".rstrip())
        errors = [e for level in run.levels for e in level.first_errors()]
        if errors:
            lines.append(f"- {run.server} errors, e.g.: `{errors[0]}`")
        prompt_sizes = set().union(*(level.prompt_tokens for level in run.levels))
        if prompt_sizes and prompt_sizes != {settings.prompt_tokens}:
            lines.append(f"- {run.server} counted prompts of {sorted(prompt_sizes)} tokens")
    lines.append("")
    return lines


def ahead_by(ours: ServerRun, peer: ServerRun, concurrency: int) -> float:
    """Our tokens/s over the peer's: the median over the rounds they took
    turns in (each round's ratio is of two runs minutes apart at most), else
    the ratio of the reported levels."""
    mine, theirs = ours.round_throughput.get(concurrency), peer.round_throughput.get(concurrency)
    if mine and theirs and len(mine) == len(theirs):
        return float(np.median([m / t for m, t in zip(mine, theirs, strict=True) if t]))
    level, other = ours.level(concurrency), peer.level(concurrency)
    assert level is not None
    assert other is not None
    return level.throughput / other.throughput


def ahead_line(ours: ServerRun | None, peer: ServerRun) -> str:
    if ours is None or not peer.levels:
        return f"ahead of {peer.server}: n/a ({peer.failure} {peer.note}".rstrip() + ")"
    behind, speedups = [], []
    for level in ours.levels:
        theirs = peer.level(level.concurrency)
        if theirs is None or not theirs.throughput:
            continue
        speedup = ahead_by(ours, peer, level.concurrency)
        speedups.append(f"c={level.concurrency}: {speedup:.2f}x")
        if speedup < 1.0:
            behind.append(f"c={level.concurrency}")
    return (
        f"≥ 1.0x {peer.server} at every concurrency (tok/s): "
        f"{verdict(not behind)} ({', '.join(speedups)})"
        + (f"; behind at {', '.join(behind)}" if behind else "")
    )


def ttft_line(ours: ServerRun, peer: ServerRun) -> str:
    """TTFT p50 no worse than the peer's at every concurrency (the reported rounds)."""
    worse, cells = [], []
    for level in ours.levels:
        theirs = peer.level(level.concurrency)
        if theirs is None or not theirs.samples:
            continue
        mine, other = level.ttft(50), theirs.ttft(50)
        cells.append(f"c={level.concurrency}: {ms(mine)} / {ms(other)} ms")
        if mine > other:
            worse.append(f"c={level.concurrency}")
    return (
        f"TTFT p50 no worse than {peer.server} (ours / theirs): {verdict(not worse)} "
        f"({', '.join(cells)})" + (f"; worse at {', '.join(worse)}" if worse else "")
    )


def side_by_side(sections: Sequence[Section]) -> list[str]:
    """Ours and every peer per concurrency: tok/s (ours ÷ theirs, the median
    of the rounds' ratios) and TTFT p50."""
    lines: list[str] = []
    for section in sections:
        ours, peers = section.run(OURS), [p for p in section.peers if p.levels]
        if ours is None or not peers:
            continue
        names = " | ".join(f"{p.server}: tok/s (ours ÷) TTFT p50 ms" for p in peers)
        lines += [
            f"### Side by side: {section.engine} engine, {section.model.key} model",
            "",
            f"| conc | sluiceway: tok/s, TTFT p50 ms | {names} |",
            "|--:|--:|" + "--:|" * len(peers),
        ]
        for level in ours.levels:
            cells = []
            for peer in peers:
                theirs = peer.level(level.concurrency)
                if theirs is None or not theirs.throughput:
                    cells.append("-")
                    continue
                ratio = ahead_by(ours, peer, level.concurrency)
                cells.append(f"{theirs.throughput:.0f} ({ratio:.2f}x) {ms(theirs.ttft(50))}")
            lines.append(
                f"| {level.concurrency} | {level.throughput:.0f}, {ms(level.ttft(50))} "
                f"| {' | '.join(cells)} |"
            )
        lines.append("")
        lines += [f"- {p.server}: {p.about}" for p in section.peers if p.about]
        lines.append("")
    return lines


def targets(sections: Sequence[Section]) -> list[str]:
    lines = ["## Targets", ""]
    for section in sections:
        ours = section.run(OURS)
        name = f"{section.engine}, {section.model.key} model"
        if section.model.key == "large" and ours is not None and section.has_bare_loop:
            goals = TARGETS.get(section.engine, DEFAULT_TARGETS)
            for concurrency, goal in zip((1, 16), goals, strict=True):
                level, bare = ours.level(concurrency), ours.bare_for(section, concurrency)
                if level is None or not bare:
                    lines.append(f"- {name}: ≥ {goal} of bare at concurrency {concurrency}: n/a")
                    continue
                decode, e2e = level.decode_throughput / bare, level.throughput / bare
                lines.append(
                    f"- {name}: decode ≥ {goal} x bare engine at concurrency {concurrency}: "
                    f"{decode:.3f} {verdict(decode >= goal)} (end to end, prefill and "
                    f"TTFT included: {e2e:.3f})"
                )
        for peer in section.peers:
            lines.append(f"- {name}: {ahead_line(ours, peer)}")
            if ours is not None and peer.levels:
                lines.append(f"- {name}: {ttft_line(ours, peer)}")
        if ours is not None:
            errors = sum(level.errors for level in ours.levels)
            failed = ours.failure is not None
            lines.append(
                f"- {name}: zero errors: {verdict(errors == 0 and not failed)} "
                f"({errors} failed requests{'; the run failed' if failed else ''})"
            )
    lines.append("")
    return lines


def pipeline_cost(sections: Sequence[Section]) -> list[str]:
    """What the server adds to each streamed token, in wall time, against
    the bare loop's step at the same batch: at concurrency c the server
    streams a token every ``time_per_token / c`` seconds and the bare loop
    every ``step / c``. (Wall time, not CPU: on a GPU host the server's CPU
    work can overlap the forward pass; here it shares the cores with it.)"""
    lines = ["## Our pipeline's cost per streamed token (tiny model)", ""]
    for section in sections:
        if section.model.key != "tiny" or not section.has_bare_loop:
            continue
        ours = section.run(OURS)
        if ours is None:
            lines.append(f"- {section.engine}: n/a")
            continue
        cells = []
        for level in ours.levels:
            c = level.concurrency
            bare = ours.paired_step.get(c) or section.bare_step.get(c)
            if bare is None or not level.time_per_token:
                continue
            per_token = level.time_per_token
            cells.append(
                f"c={c}: {per_token / c * 1e6:.0f} µs per streamed token against the bare "
                f"loop's {bare / c * 1e6:.0f}: the pipeline adds "
                f"**{(per_token - bare) / c * 1e6:.0f} µs** ({per_token / bare:.2f}x)"
            )
        lines.append(f"- {section.engine}: " + ("; ".join(cells) if cells else "n/a"))
    lines.append("")
    return lines


def time_breakdown(sections: Sequence[Section]) -> list[str]:
    rows, split = [], []
    names = [name for _, name in MARKS]
    for section in sections:
        ours = section.run(OURS)
        if ours is None or not ours.traces:
            continue
        for level, summary, cpu in zip(ours.levels, ours.traces, ours.thread_cpu, strict=True):
            if summary is None:
                continue
            bare = ours.paired_step.get(level.concurrency) or section.bare_step.get(
                level.concurrency
            )
            rows.append(
                f"| {section.engine} | {section.model.key} | {level.concurrency} "
                f"| {level.decode_throughput:.1f} | {summary.engine_busy:.0%} "
                f"| {summary.decode_step * 1e3:.2f} ({summary.decode_rows:.1f} rows) "
                f"| {f'{bare * 1e3:.2f}' if bare else '-'} | {summary.gap * 1e3:.2f} "
                f"| {summary.sample * 1e3:.2f} | {cpu.get('event loop', 0.0):.2f} "
                f"| {cpu.get('engine', 0.0):.2f} | {cpu.get('sampler', 0.0):.2f} "
                f"| {cpu.get('compute', 0.0):.2f} |"
            )
            if summary.segments:
                cells = " | ".join(f"{summary.segments.get(n, 0.0) * 1e6:.0f}" for n in names)
                split.append(
                    f"| {section.engine} | {section.model.key} | {level.concurrency} | {cells} |"
                )
    if not rows:
        return []
    return [
        "## Where our server's time goes (`--trace`)",
        "",
        "Engine steps timed inside the server (bench/trace_server.py). *engine busy*: share "
        "of the wall the engine thread spent in steps; *decode step*: mean decode-only step, "
        "against the bare loop's step at the same batch; *gap*: mean engine idle time between "
        "two decode steps; *sampler*: mean sampler step; then CPU cores used per thread role "
        "over the level (*compute*: torch's OpenMP / BLAS threads, and idle pool threads).",
        "",
        "| engine | model | conc | decode tok/s | engine busy | decode step ms | bare step ms "
        "| gap ms | sampler ms | event loop | engine thread | sampler threads | compute |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
        *rows,
        "",
        "One scheduler step, segment by segment (mean µs over the level's complete steps, "
        "prefill steps included): everything after *engine step* is time the engine waits "
        "for the pipeline.",
        "",
        f"| engine | model | conc | {' | '.join(names)} |",
        "|---|---|--:|" + "--:|" * len(names),
        *split,
        "",
    ]


def render(sections: Sequence[Section], settings: Settings, header: str) -> str:
    lines = [header, ""]
    lines += side_by_side(sections)
    for section in sections:
        lines += section_table(section, settings)
    lines += targets(sections)
    lines += pipeline_cost(sections)
    lines += time_breakdown(sections)
    lines.append(
        "Columns: *tok/s* is output tokens over the level's wall time (prefill and TTFT "
        "included); *decode tok/s* is concurrency over the mean time per token after each "
        "request's first (the streams' steady rate, comparable to the bare decode loop when "
        "all streams run together: with staggered admission, as mlx_lm.server's, it "
        "overstates); *bare tok/s*, for our rows, is the bare engine measured right before and "
        "after that level (mean of the two), else the section's bare measurement; *ITL* is the "
        "gap between token chunks; *reconnects*: requests that could not connect (or got no "
        "response) and were retried, as the OpenAI SDK does; *client CPU*: cores the load "
        "generator used; *other CPU*: cores used by processes other than the benchmark and "
        f"the server (⚠ above {settings.busy}: measured on a busy host, after retries)."
    )
    return "\n".join(lines) + "\n"
