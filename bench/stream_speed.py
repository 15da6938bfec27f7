"""Tokens/s of one 256-token greedy stream from the embedded default model.

Starts ``sluiceway serve`` on the default model for each engine, streams one
chat completion (greedy, EOS ignored) and prints time to first token and the
decode rate seen by the client.

    .venv/bin/python bench/stream_speed.py [--tokens 256] [--engine mlx transformers]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start(engine: str, port: int) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "sluiceway", "serve", "--engine", engine, "--port", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("the server did not start")


def measure(port: int, tokens: int) -> tuple[float, float, int]:
    body = {
        "model": "sluiceway-default",
        "messages": [{"role": "user", "content": "Tell me about rivers."}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first = None
    count = 0
    with httpx.stream(
        "POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=600
    ) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                count = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["delta"].get("role") is None:
                first = first or time.perf_counter()
    done = time.perf_counter()
    assert first is not None
    return first - started, (count - 1) / (done - first), count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--engine", nargs="+", default=["mlx", "transformers"])
    args = parser.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    for engine in args.engine:
        port = free_port()
        process = start(engine, port)
        try:
            measure(port, 8)  # warm-up
            ttft, rate, count = measure(port, args.tokens)
        finally:
            process.terminate()
            process.wait()
        print(f"{engine:>12}: {count} tokens, TTFT {ttft * 1000:.0f} ms, {rate:.0f} tokens/s")


if __name__ == "__main__":
    main()
