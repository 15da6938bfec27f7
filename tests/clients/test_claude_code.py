"""The real client: the Claude Code CLI (pinned by tests/clients/claude-code's
npm lock, installed here with ``npm ci``) runs a tool loop against the
server on a scripted model, telemetry off, in a temporary home.

How the model knows what to do. A real client cannot send
``chat_template_kwargs``, so the server picks the script for every request
with ``--default-chat-template-kwargs '{"script": "cc_read"}'``: think, then
call ``Read`` on a notes file. Claude Code runs the tool and sends its
result back (to ``/v1/messages?beta=true``). The notes hold another
script's selector token, and two selectors in one context cancel out in the
scripted model (it ends at once), so from then on the model answers with
nothing: Claude Code asks once more for visible output, gets nothing again,
and finishes. Had the tool result not reached the prompt, every turn would
call ``Read`` again and the run would end at its turn limit
(``error_max_turns``), not with ``success``.
Its prompts are long (version 2.1.332: ~44k tokens of tools and
instructions per request on the test tokenizer), so the model gets a 128k
context; the first request takes most of a minute to prefill on a CPU (the
next ones reuse its prefix), which is why this test has its own make target
(``make test-clients``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import RunningServer, serving
from tests.fixtures.scripted_model import REASONING, Script, ScriptedModel, build_scripted_model

pytestmark = [pytest.mark.client, pytest.mark.timeout(1500)]

CLIENT_DIR = Path(__file__).parent / "claude-code"
CONTEXT = 131072
API_KEY = "sk-sluiceway-test"
#: An access-log line: method, path and status.
ACCESS = re.compile(r'"([A-Z]+) ([^\s"]+)(?: [^"]*)?" (\d{3}) ')


def pinned_version() -> str:
    """The CLI's version as the checked-in lock pins it."""
    lock = json.loads((CLIENT_DIR / "package-lock.json").read_text())
    version: str = lock["packages"]["node_modules/@anthropic-ai/claude-code"]["version"]
    return version


@pytest.fixture(scope="session")
def claude() -> Path:
    """The pinned CLI, installed from the lock as `make test-clients` does
    (again when the lock changed), and checked to be the locked version."""
    binary = CLIENT_DIR / "node_modules" / ".bin" / "claude"
    stamp = CLIENT_DIR / "node_modules" / ".installed"
    newest = max(
        (CLIENT_DIR / name).stat().st_mtime for name in ("package.json", "package-lock.json")
    )
    if not (stamp.is_file() and stamp.stat().st_mtime >= newest and binary.exists()):
        npm = shutil.which("npm")
        assert npm, "the Claude Code client test needs Node.js and npm (apt-get install nodejs npm)"
        subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"], cwd=CLIENT_DIR, check=True, timeout=600
        )
        stamp.touch()
    shown = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, timeout=60, check=True
    )
    assert shown.stdout.split()[0] == pinned_version(), shown.stdout
    return binary


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("project")


@pytest.fixture(scope="module")
def model(workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> ScriptedModel:
    notes = workspace / "notes.txt"
    read = Script(
        "cc_read",
        (
            "<think>", "\nRead", " the notes", ".\n", "</think>", "\n\n",
            "<tool_call>", "\n", '{"name": ', '"Read"', ', "arguments": ',
            '{"file_path": ', json.dumps(str(notes)), "}}\n", "</tool_call>",
        ),
    )  # fmt: skip
    built = build_scripted_model(
        tmp_path_factory.mktemp("cc-model"), (read, REASONING), max_position_embeddings=CONTEXT
    )
    notes.write_text(f"The notes say: stop here {built.selector('reasoning')}\n")
    return built


@pytest.fixture(scope="module")
def server(
    model: ScriptedModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    defaults = json.dumps(model.chat_kwargs("cc_read"))
    with serving(
        model.path,
        tmp_path_factory.mktemp("logs"),
        "--default-chat-template-kwargs",
        defaults,
        "--api-key",
        API_KEY,
    ) as running:
        yield running


def run_claude(claude: Path, server: RunningServer, workspace: Path, home: Path) -> dict[str, Any]:
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": server.base_url,
        "ANTHROPIC_API_KEY": API_KEY,
        "ANTHROPIC_MODEL": server.model,
        "ANTHROPIC_SMALL_FAST_MODEL": server.model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": server.model,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    done = subprocess.run(
        [str(claude), "-p", "What do the notes in notes.txt say?", "--max-turns", "3",
         "--output-format", "json", "--model", server.model],
        cwd=workspace,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"claude exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_claude_code_runs_a_tool_loop(
    claude: Path, server: RunningServer, workspace: Path, tmp_path: Path
) -> None:
    result = run_claude(claude, server, workspace, tmp_path / "home")
    # Every request the client made, whatever its route (the harness's own
    # health checks aside).
    requests = [hit for hit in ACCESS.findall(server.log()) if hit[:2] != ("GET", "/health")]
    seen = f"{json.dumps(result, indent=1)}\nrequests: {requests}"
    assert result["type"] == "result", seen
    assert result["subtype"] == "success", seen  # not error_max_turns: see the module comment
    assert result["is_error"] is False, seen
    assert result["api_error_status"] is None, seen
    assert "API Error" not in json.dumps(result), seen
    assert result["stop_reason"] == "end_turn", seen
    assert result["permission_denials"] == [], seen
    # The Read call, the turn its result ended, and the one Claude Code asked
    # for when that turn showed nothing.
    assert result["num_turns"] == 3, seen
    assert all(status == "200" for _, _, status in requests), seen
    messages = [hit for hit in requests if hit[:2] == ("POST", "/v1/messages")]
    assert len(messages) == result["num_turns"], seen
