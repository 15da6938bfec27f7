"""The real client: the Codex CLI (pinned by package-lock.json beside this
file) runs a tool loop over the Responses API against the server.

``codex exec`` gets a prompt that selects the scripted model's tool call
(``scripts.py``); Codex runs the command, carries its output back, and the
model answers only once that output -- which holds the next script's
selector -- reaches it. Server and client run in a network namespace where
only loopback exists (``tests/clients/isolated.py``).
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

from tests.clients.codex.scripts import CODEX_SCRIPTS, DONE_SELECTOR, FINAL_ANSWER, MAX_POSITIONS
from tests.clients.isolated import isolation_command
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


def session_items(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The items Codex recorded in its session (its rollout file)."""
    items = []
    for line in report["session"]:
        record = json.loads(line)
        if record.get("type") == "response_item":
            items.append(record["payload"])
    return items


def run(codex: Path, model: ScriptedModel, root: Path) -> dict[str, Any]:
    command = [
        *isolation_command(),
        sys.executable,
        "-m",
        "tests.clients.codex.runner",
        "--model",
        str(model.path),
        "--codex",
        str(codex),
        "--root",
        str(root),
        "--prompt",
        PROMPT,
    ]
    finished = subprocess.run(
        command, cwd=REPO, capture_output=True, timeout=RUN_SECONDS, check=False
    )
    assert finished.returncode == 0, finished.stderr.decode(errors="replace")
    report: dict[str, Any] = json.loads(finished.stdout)
    return report


def test_codex_exec_runs_a_tool_loop(
    codex: Path, long_scripted: ScriptedModel, tmp_path: Path
) -> None:
    report = run(codex, long_scripted, tmp_path)
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
    assert report["stdout"].strip().splitlines()[-1] == FINAL_ANSWER
