"""The docs say what the code does: docs/cli.md has a row for every flag of
``sluiceway serve`` naming each of its choices, docs/api.md's route table
lists every route the app serves, and the routes that answer without an API
key are the ones both documents say."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluiceway.server.app import SluicewayApp
from sluiceway.server.cli import build_parser
from sluiceway.server.config import ServerConfig

DOCS = Path(__file__).resolve().parents[2] / "docs"


def serve_flags() -> list[argparse.Action]:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = commands.choices["serve"]
    return [a for a in serve._actions if not isinstance(a, argparse._HelpAction)]


def cli_rows() -> dict[str, str]:
    """Each flag spelled in a row of docs/cli.md's table -> that row."""
    rows: dict[str, str] = {}
    for line in (DOCS / "cli.md").read_text().splitlines():
        if line.startswith("| `--"):
            first = _cells(line)[1]
            for flag in re.findall(r"`(--[a-z0-9-]+)", first):
                rows[flag] = line
    return rows


def _cells(line: str) -> list[str]:
    """A table row's cells (``\\|`` is a pipe inside a cell)."""
    return re.split(r"(?<!\\)\|", line)


def missing_from_cli_docs(actions: list[argparse.Action], rows: dict[str, str]) -> list[str]:
    """What docs/cli.md leaves out, one line per flag or choice."""
    missing = []
    for action in actions:
        for flag in action.option_strings:
            if flag not in rows:
                missing.append(f"{flag}: no row in docs/cli.md")
        row = next((rows[f] for f in action.option_strings if f in rows), None)
        if row is None or action.choices is None:
            continue
        for choice in action.choices:
            if not re.search(rf"(?<![\w-]){re.escape(str(choice))}(?![\w-])", row):
                flag = action.option_strings[0]
                missing.append(f"{flag}: its row in docs/cli.md does not name choice {choice!r}")
    return missing


def test_the_cli_docs_list_each_flag_and_its_choices() -> None:
    missing = missing_from_cli_docs(serve_flags(), cli_rows())
    assert missing == [], "docs/cli.md is behind the CLI:\n" + "\n".join(missing)


def test_a_missing_flag_or_choice_is_named() -> None:
    """The check above fails, and says which flag, when the docs lag."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--colour", choices=("red", "green"))
    parser.add_argument("--shade")
    parser.add_argument("--loud", action=argparse.BooleanOptionalAction)
    actions = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    rows = {"--colour": "| `--colour red\\|blue` | x |", "--loud": "| `--loud` | x |"}
    assert missing_from_cli_docs(actions, rows) == [
        "--colour: its row in docs/cli.md does not name choice 'green'",
        "--shade: no row in docs/cli.md",
        "--no-loud: no row in docs/cli.md",
    ]


def api_table() -> Iterator[tuple[str, str]]:
    """(method, path) pairs of the route table atop docs/api.md."""
    for line in (DOCS / "api.md").read_text().splitlines():
        cells = line.split("|")
        if len(cells) < 4 or not cells[1].strip().startswith("`"):
            continue
        methods = re.findall(r"`([A-Z]+)`", cells[1])
        paths = re.findall(r"`(/[^`]*)`", cells[2])
        for method in methods:
            for path in paths:
                yield method, path


def served_routes(config: ServerConfig) -> dict[tuple[str, str], bool]:
    """Every (method, path) the app routes, and whether it needs no API key;
    the playground's files as the table names them."""
    app = SluicewayApp(config)
    routes = {}
    for path, methods in app.router.routes.items():
        shown = "/playground/{file}" if path.startswith("/playground/") else path
        for method, route in methods.items():
            routes[method, shown] = route.public
    return routes


def test_the_api_docs_list_every_route() -> None:
    documented = set(api_table())
    missing = [f"{m} {p}" for m, p in served_routes(ServerConfig()) if (m, p) not in documented]
    assert missing == [], "docs/api.md's route table lacks:\n" + "\n".join(missing)
    stale = [f"{m} {p}" for m, p in documented if (m, p) not in served_routes(ServerConfig())]
    assert stale == [], "docs/api.md's route table lists routes the app lacks:\n" + "\n".join(stale)


@pytest.mark.parametrize("doc", ["cli.md", "api.md"])
def test_the_docs_name_the_routes_that_need_no_key(doc: str) -> None:
    """The sentence each document gives about ``--api-key`` names every
    route that answers without it (the playground's files aside) and none
    that needs it."""
    routes = served_routes(ServerConfig(api_key="k"))
    public = {p for (_, p), free in routes.items() if free and not p.startswith("/playground/")}
    guarded = {p for (_, p), free in routes.items() if not free}
    text = (DOCS / doc).read_text()
    sentence = next(s for s in re.split(r"(?<=\.)\s", text) if "without the key:" in s)
    named = set(re.findall(r"`(/[a-z_./]*)`", sentence))
    assert named == public, f"docs/{doc}: {sentence!r}"
    assert not named & guarded
