"""The benchmark's traced server (``bench/trace_server.py``) wraps pipeline
internals by name and signature; this keeps it in step with them, so that
``make bench`` does not find out first."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.harness import sse_lines, start_server

TRACE_SERVER = Path(__file__).parents[2] / "bench" / "trace_server.py"


@pytest.mark.parametrize("engine", ["transformers", "mlx"])
def test_traced_server_streams_and_records_its_steps(
    default_model: Path, tmp_path: Path, engine: str
) -> None:
    trace_path = tmp_path / "trace.json"
    server = start_server(
        default_model,
        worker_class="asyncio",
        log_dir=tmp_path,
        extra_args=["--engine", engine],
        launcher=[sys.executable, str(TRACE_SERVER), str(trace_path)],
    )
    try:
        body = {
            "model": server.model,
            "prompt": "trace me",
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        reply = httpx.post(server.api_url + "/completions", json=body, timeout=60)
        chunks = [json.loads(line[6:]) for line in sse_lines(reply.text) if line[6:7] == "{"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length", server.log()
        assert reply.text.endswith("data: [DONE]\n\n")
    finally:
        server.stop()
    trace = json.loads(trace_path.read_text())
    decoded = sum(rows for _, _, rows, _ in trace["steps"])
    # Every token after the first comes from a traced decode step; decoding
    # ahead may add one step past the end, which is then taken back.
    assert decoded in (11, 12)
    labels = {label for label, _ in trace["points"]}
    assert {"exec_start", "exec_end", "absorb", "plan", "submit"} <= labels
