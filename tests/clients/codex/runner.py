"""Run ``codex exec`` against a test server, both inside a loopback-only
network namespace, and print what happened as JSON.

    unshare -rn python -m tests.clients.codex.runner --model DIR --codex BIN --root DIR

Started by ``test_codex.py``; the report carries Codex's exit code, stdout,
stderr and the session it recorded, and the server's log (its access log
shows every request's status).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.clients.isolated import bring_loopback_up, only_loopback
from tests.e2e.harness import RunningServer, start_server

CODEX_SECONDS = 600

CONFIG = """\
model = "{model}"
model_provider = "sluiceway"
check_for_update_on_startup = false
{small}
[analytics]
enabled = false

[model_providers.sluiceway]
name = "sluiceway"
base_url = "{base_url}"
wire_api = "responses"
"""

#: For a model with a short context, as a user who serves one sets Codex
#: up: its own instructions in a file, and only the shell's tools (Codex's
#: defaults send about 40 KB: instructions, skills, goals, agents, search).
SMALL_CONTEXT = """\
model_instructions_file = "{instructions}"
web_search = "disabled"

[skills]
include_instructions = false

[features]
multi_agent = false
goals = false
view_image = false
collaboration_modes = false
"""
INSTRUCTIONS = "You are a coding agent in a terminal. Use the tools to do what the user asks.\n"


def run_codex(
    codex: Path, server: RunningServer, root: Path, prompt: str, *, small_context: bool = False
) -> dict[str, Any]:
    home, work = root / "home", root / "work"
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True)
    work.mkdir()
    small = ""
    if small_context:
        (codex_home / "instructions.md").write_text(INSTRUCTIONS)
        small = SMALL_CONTEXT.format(instructions=codex_home / "instructions.md")
    (codex_home / "config.toml").write_text(
        CONFIG.format(model=server.model, base_url=server.api_url, small=small)
    )
    # Only what it needs: the caller's PATH (node, bash), a home of its own.
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(codex_home)}
    finished = subprocess.run(
        [str(codex), "exec", "--skip-git-repo-check", prompt],
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=CODEX_SECONDS,
        check=False,
    )
    sessions = sorted(codex_home.glob("sessions/**/*.jsonl"))
    return {
        "returncode": finished.returncode,
        "stdout": finished.stdout.decode(errors="replace"),
        "stderr": finished.stderr.decode(errors="replace"),
        "session": [line for path in sessions for line in path.read_text().splitlines()],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--codex", type=Path, required=True)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--engine", default="mlx")
    parser.add_argument("--small-context", action="store_true")
    args = parser.parse_args(argv)
    bring_loopback_up()
    report: dict[str, Any] = {"only_loopback": only_loopback()}
    server = start_server(
        args.model,
        worker_class="asyncio",
        log_dir=args.root,
        name="scripted",
        extra_args=["--engine", args.engine],
    )
    try:
        report |= run_codex(
            args.codex, server, args.root, args.prompt, small_context=args.small_context
        )
    finally:
        server.stop()
        report["server_log"] = server.log()
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
