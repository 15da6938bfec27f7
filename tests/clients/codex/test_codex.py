"""The real client: the Codex CLI (pinned by package-lock.json beside this
file) runs a tool loop over the Responses API against the server.

``codex exec`` gets a prompt that selects the scripted model's tool call
(``scripts.py``); Codex runs the command, carries its output back, and the
model answers only once that output -- which holds the next script's
selector -- reaches it. The same loop runs against the harmony model
(gpt-oss's format, ``tests/fixtures/harmony_model.py``), whose reasoning,
call and answer travel in harmony's channels. Server and client run in a
network namespace where only loopback exists (``tests/clients/isolated.py``).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sluiceway.engines.default_model import default_cache_dir
from tests.clients.codex.scripts import (
    CODEX_SCRIPTS,
    DONE_SELECTOR,
    FINAL_ANSWER,
    HARMONY_ANSWER,
    HARMONY_PROMPT,
    HARMONY_SCRIPTS,
    HARMONY_WINDOW,
    MAX_POSITIONS,
)
from tests.clients.isolated import isolation_command, run_isolated
from tests.fixtures.harmony_model import HarmonyModel, cached_harmony_model
from tests.fixtures.scripted_model import ScriptedModel, build_scripted_model

pytestmark = [pytest.mark.e2e, pytest.mark.client]

HERE = Path(__file__).parent
REPO = HERE.parents[2]
PROMPT = "Run the check. <|script:codex_call|>"
RUN_SECONDS = 900


@pytest.fixture(scope="module")
def codex() -> Path:
    """The Codex CLI at the pinned version, installed with ``npm ci`` when
    it is missing or another version."""
    pinned = json.loads((HERE / "package.json").read_text())["dependencies"]["@openai/codex"]
    installed = HERE / "node_modules" / "@openai" / "codex" / "package.json"
    if not installed.exists() or json.loads(installed.read_text())["version"] != pinned:
        npm = shutil.which("npm")
        assert npm is not None, "the Codex client test needs npm (Node.js) to install the CLI"
        subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"], cwd=HERE, check=True, timeout=RUN_SECONDS
        )
    return HERE / "node_modules" / ".bin" / "codex"


@pytest.fixture(scope="module")
def long_scripted(tmp_path_factory: pytest.TempPathFactory) -> ScriptedModel:
    return build_scripted_model(
        tmp_path_factory.mktemp("codex-model"),
        CODEX_SCRIPTS,
        max_position_embeddings=MAX_POSITIONS,
    )


@pytest.fixture(scope="module")
def harmony() -> HarmonyModel:
    """The harmony model of the Codex scripts, attending over a window (the
    transformers engine's: mlx-lm's Qwen3 has no window)."""
    return cached_harmony_model(
        default_cache_dir() / "test-models", HARMONY_SCRIPTS, window=HARMONY_WINDOW
    )


def session_items(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The items Codex recorded in its session (its rollout file)."""
    items = []
    for line in report["session"]:
        record = json.loads(line)
        if record.get("type") == "response_item":
            items.append(record["payload"])
    return items


def run(
    codex: Path, model: Path, root: Path, *, prompt: str = PROMPT, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    command = [
        *isolation_command(),
        sys.executable,
        "-m",
        "tests.clients.codex.runner",
        "--model",
        str(model),
        "--codex",
        str(codex),
        "--root",
        str(root),
        "--prompt",
        prompt,
        *extra,
    ]
    finished = run_isolated(command, cwd=REPO, timeout=RUN_SECONDS)
    assert finished.returncode == 0, finished.stderr.decode(errors="replace")
    report: dict[str, Any] = json.loads(finished.stdout)
    return report


def check_loop(report: dict[str, Any], answer: str) -> list[dict[str, Any]]:
    """Every request answered 200, Codex ran the call, carried its output
    back and printed the answer; the session's items are returned."""
    assert report["only_loopback"]
    log = report["server_log"]
    statuses = re.findall(r'"POST /v1/responses(?:\?[^\s"]*)?(?: [^"]*)?" (\d{3})', log)
    assert len(statuses) >= 2, f"Codex made {len(statuses)} Responses requests:\n{log}"
    assert set(statuses) == {"200"}, log
    stderr = report["stderr"]
    assert report["returncode"] == 0, stderr
    errors = [line for line in stderr.splitlines() if re.search(r"\berror\b", line, re.I)]
    assert not errors, stderr
    # The call went out, its output came back with the next script's
    # selector, and the model (which answers only after seeing it) answered.
    items = session_items(report)
    calls = [item for item in items if item["type"] == "function_call"]
    assert [call["name"] for call in calls] == ["exec_command"]
    outputs = [item for item in items if item["type"] == "function_call_output"]
    assert [output["call_id"] for output in outputs] == [calls[0]["call_id"]]
    assert DONE_SELECTOR in outputs[0]["output"]
    assert report["stdout"].strip().splitlines()[-1] == answer
    return items


def test_codex_exec_runs_a_tool_loop(
    codex: Path, long_scripted: ScriptedModel, tmp_path: Path
) -> None:
    check_loop(run(codex, long_scripted.path, tmp_path), FINAL_ANSWER)


#: Its model trains on first use (a minute or two on a busy 2-core host).
@pytest.mark.timeout(1200)
def test_codex_exec_runs_a_tool_loop_on_harmony(
    codex: Path, harmony: HarmonyModel, tmp_path: Path
) -> None:
    """gpt-oss's format: the reasoning, the call (``<|constrain|>json``)
    and the answer each come out of their channel into Codex's items. Codex
    is set up as for a small local model (``--small-context``: about 4,300
    prompt tokens instead of 34,500; both were run by hand), which keeps the
    test to seconds; the long prompt is the scripted test's."""
    report = run(
        codex,
        harmony.path,
        tmp_path,
        prompt=HARMONY_PROMPT,
        extra=("--engine", "transformers", "--small-context"),
    )
    items = check_loop(report, HARMONY_ANSWER)
    reasoning = [
        part["text"] for item in items if item["type"] == "reasoning" for part in item["content"]
    ]
    assert reasoning == ["Calling exec now.", "Marker came back."]
    said = [
        part["text"]
        for item in items
        if item["type"] == "message" and item["role"] == "assistant"
        for part in item["content"]
    ]
    assert said == [HARMONY_ANSWER]
    call = next(item for item in items if item["type"] == "function_call")
    assert json.loads(call["arguments"]) == {"cmd": "printf %s%s '<|script:' 'codex_done|>'"}
