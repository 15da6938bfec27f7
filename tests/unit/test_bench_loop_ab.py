"""The loop A/B bench's stand-in engine and its report (bench/loop_ab.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))

from loop_ab import FIRST_TOKEN, StandInEngine, report


def test_stand_in_engine_streams_one_token_per_row_and_step() -> None:
    engine = StandInEngine(vocab_size=1000, step_seconds=0.0)
    first = engine.prefill(1, [5, 6, 7])
    assert first.shape == (1, 1000)
    assert engine.prefill(2, [5, 6], all_logits=True).shape == (2, 1000)
    engine.fork(1, 3)
    step = engine.decode({1: int(first.argmax()), 3: int(first.argmax())})
    assert step.slots == (1, 3)
    # Forked rows decode alike; every row's next token is an ordinary piece.
    assert step.logits[0].argmax() == step.logits[1].argmax() >= FIRST_TOKEN
    again = engine.decode({1: 0, 3: 0})
    assert again.logits[0].argmax() != step.logits[0].argmax()
    engine.undo_decode()
    assert np.array_equal(engine.decode({1: 0, 3: 0}).logits, again.logits)
    # Undoing takes back only the rows that decoded: slot 2 (prefilled with
    # two tokens, never decoded) stays at its length.
    engine.decode({1: 0, 3: 0})
    engine.undo_decode()
    assert engine.decode({2: 0}).logits[0].argmax() == FIRST_TOKEN + (3 * 7) % 500
    engine.free(3)
    assert engine.decode({1: 0}).slots == (1,)


def test_report_gives_the_paired_difference() -> None:
    line = report({"A": [500.0, 520.0, 510.0], "B": [450.0, 480.0, 455.0]})
    assert "A: 510 µs per token" in line
    assert "B: 462" in line
    assert "B - A: -48 ± 4 µs per token (3 paired phases)" in line


def test_floor_app_streams_a_frame_per_tick_that_the_load_generator_counts() -> None:
    import asyncio
    import json

    from floor_app import FloorApp
    from loadgen import Sample, _read_events

    async def stream() -> tuple[list[bytes], int]:
        app = FloorApp(step_seconds=0.0)
        ticker = asyncio.get_running_loop().create_task(app.tick())
        body = json.dumps({"max_tokens": 5}).encode()
        incoming = [{"type": "http.request", "body": body, "more_body": False}]
        sent: list[dict[str, object]] = []

        async def receive() -> dict[str, object]:
            return incoming.pop(0)

        async def send(message: dict[str, object]) -> None:
            sent.append(message)

        scope = {"type": "http", "path": "/v1/completions"}
        await app(scope, receive, send)
        ticker.cancel()
        status = sent[0]["status"]
        assert isinstance(status, int)
        return [m["body"] for m in sent[1:] if isinstance(m["body"], bytes)], status

    bodies, status = asyncio.run(stream())
    assert status == 200
    assert len(bodies) == 6  # one frame a tick, then the finish and [DONE]
    sample = Sample(sent=0.0)
    _read_events(sample, [(float(i), body) for i, body in enumerate(bodies)])
    assert sample.error is None
    assert sample.finished
    assert len(sample.arrivals) == 5
    assert sample.usage_tokens == 5
