"""The serving benchmark's report of the one-thread bare loop, the thread
tuner's switches and the peers side by side (bench/serve.py, bench/report.py)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))

from loadgen import Level, Sample
from peers import PeerSetup
from report import (
    OURS,
    Model,
    Section,
    ServerRun,
    Settings,
    section_table,
    side_by_side,
    targets,
    ttft_line,
)
from serve import (
    NO_VLLM_BARE,
    TUNER_SWITCH,
    pair,
    server_command,
    server_dtype,
    start_bare,
    uses_vllm,
    warm_up_waves,
)

from sluiceway.actors.thread_tuner import ThreadTuner


def test_the_tuner_switch_pattern_matches_what_the_tuner_logs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tuner = ThreadTuner(2, settle_seconds=1e-9)
    with caplog.at_level(logging.INFO, logger="sluiceway.actors.thread_tuner"):
        for _ in range(400):  # one thread is twice as fast: the check switches to it
            rows, threads = 16, tuner.threads_for(16)
            tuner.observe(rows, rows * (1e-3 if threads == 1 else 2e-3), steady=True)
    assert tuner.choices == {16: 1}
    found = [m.group(1) for m in TUNER_SWITCH.finditer(caplog.text)]
    assert found == ["batches of 16: 1, not 2 (50% of the time per row)"]


def _level(
    concurrency: int, seconds_per_token: float, tokens: int = 16, ttft: float = 0.0
) -> Level:
    samples = tuple(
        Sample(
            sent=0.0,
            arrivals=[ttft + i * seconds_per_token for i in range(tokens)],
            usage_tokens=tokens,
        )
        for _ in range(concurrency)
    )
    return Level(concurrency, samples, wall=ttft + tokens * seconds_per_token)


def _settings(concurrency: tuple[int, ...], *, peers: bool = True) -> Settings:
    return Settings(
        concurrency=concurrency,
        max_tokens=16,
        prompt_tokens=8,
        requests_per_client=dict.fromkeys(concurrency, 1),
        bare_repeats=1,
        openblas=None,
        peers=peers,
        worker_class="asyncio",
        busy=0.25,
        retries=0,
        trace=False,
    )


def test_rounds_against_the_one_thread_loop_are_reported() -> None:
    run = ServerRun(OURS)
    level = _level(16, 0.004)  # 16 streams at a token every 4 ms: 4,000 tok/s
    for rate in (4000.0, 5000.0, 3200.0):
        pair(run.single_ratios, run.single_middle, level, rate)
    assert run.single_ratios[16] == pytest.approx([1.0, 0.8, 1.25])
    run.levels.append(level)
    run.other_cpu.append(0.0)
    run.client_cpu.append(0.1)
    run.tuner = ["batches of 16: 1, not 2 (87% of the time per row)"]
    section = Section("transformers", Model("tiny", Path("."), "tiny", ()), runs=[run])
    settings = _settings((16,), peers=False)
    text = "\n".join(section_table(section, settings))
    assert "decode ÷ the bare loop on one torch thread, each paired round: c=16: " in text
    assert "1.000, 0.800, 1.250 (mean 1.017" in text
    assert "switches, in order: batches of 16: 1, not 2 (87% of the time per row)" in text


def _rounds(name: str, rates: list[float], about: str = "") -> ServerRun:
    run = ServerRun(name, about=about)
    run.round_throughput[4] = rates
    run.levels.append(_level(4, 4 / max(rates)))
    return run


def test_peers_are_side_by_side_with_the_median_of_the_rounds_ratios() -> None:
    ours = _rounds(OURS, [100.0, 90.0, 120.0])
    vllm = _rounds("vLLM's server", [50.0, 100.0, 100.0], about="vllm 0.32, `--dtype auto`")
    llama = _rounds("llama-server f32", [200.0, 180.0, 100.0])
    failed = ServerRun("llama-server Q8_0", failure="not run: llama.cpp did not build")
    model = Model("large", Path("."), "large", ())
    section = Section("transformers", model, runs=[ours, vllm, llama, failed])
    text = "\n".join(side_by_side([section]))
    # Ratios per round: 2.0, 0.9, 1.2 (median 1.2) and 0.5, 0.5, 1.2 (median 0.5).
    assert "| 4 | 120, " in text
    assert "| 100 (1.20x) " in text
    assert "| 200 (0.50x) " in text
    assert "- vLLM's server: vllm 0.32, `--dtype auto`" in text
    goals = "\n".join(targets([section]))
    assert "≥ 1.0x vLLM's server at every concurrency (tok/s): **met** (c=4: 1.20x)" in goals
    assert "≥ 1.0x llama-server f32 at every concurrency (tok/s): **missed**" in goals
    assert "ahead of llama-server Q8_0: n/a (not run: llama.cpp did not build)" in goals


def test_the_bare_loop_takes_our_servers_dtype() -> None:
    assert server_dtype(()) == "auto"
    assert server_dtype(("--engine-process", "--dtype", "float32")) == "float32"
    assert server_dtype(("--dtype=bfloat16",)) == "bfloat16"


def test_the_warm_up_runs_every_batch_bucket_up_to_the_highest_concurrency() -> None:
    # A compiled server compiles a bucket on its first step: each power of two
    # below the highest level gets a wave of its own, and the highest one too.
    assert warm_up_waves(64) == [1, 2, 4, 8, 16, 32, 64]
    assert warm_up_waves(16) == [1, 2, 4, 8, 16]
    assert warm_up_waves(12) == [1, 2, 4, 8, 12]
    assert warm_up_waves(1) == [1]


def test_ttft_is_a_target_beside_each_peer() -> None:
    ours, vllm = ServerRun(OURS), ServerRun("vLLM's server")
    ours.levels += [_level(1, 0.01, ttft=0.030), _level(16, 0.01, ttft=0.100)]
    vllm.levels += [_level(1, 0.01, ttft=0.020), _level(16, 0.01, ttft=0.150)]
    line = ttft_line(ours, vllm)
    assert line.startswith("TTFT p50 no worse than vLLM's server (ours / theirs): **missed**")
    assert "c=1: 30.0 / 20.0 ms, c=16: 100.0 / 150.0 ms); worse at c=1" in line
    ours.levels[0] = _level(1, 0.01, ttft=0.015)
    assert "**met**" in ttft_line(ours, vllm)
    section = Section("vllm", Model("large", Path("."), "large", ()), runs=[ours, vllm])
    goals = targets([section])
    assert any("TTFT p50 no worse" in line for line in goals)
    assert not any("of bare" in line for line in goals)  # no bare loop on vLLM's engine


def test_ours_over_vllm_runs_from_the_vllm_environment_with_no_bare_loop() -> None:
    settings = _settings((1, 4))
    setup = PeerSetup("/opt/vllm-env/bin/python", None)
    command = server_command(OURS, "vllm", Path("/m"), 8000, settings, None, None, setup)
    assert command[:3] == ["/opt/vllm-env/bin/python", "-m", "sluiceway"]
    assert command[command.index("--engine") + 1] == "vllm"
    assert uses_vllm(OURS, "vllm")
    assert uses_vllm("vllm", "transformers")
    assert not uses_vllm(OURS, "transformers")
    section = Section("vllm", Model("tiny", Path("."), "tiny", ()))
    assert start_bare(section, settings) is None
    assert section.bare_failure == NO_VLLM_BARE
    assert f"No bare engine figures: {NO_VLLM_BARE}" in "\n".join(section_table(section, settings))
