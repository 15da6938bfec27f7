"""The package's imports point only down the layer table of
docs/architecture.md, and API surfaces never import one another."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "sluiceway"

#: Each layer may import the layers with a lower rank, and itself. parsers
#: and engines share a rank: neither imports the other.
RANKS = {
    "protocol": 0,
    "parsers": 1,
    "engines": 1,
    "actors": 2,
    "surfaces": 3,
    "server": 4,
    # The package's own top-level modules: ``__main__`` runs the CLI.
    "__main__": 5,
    "__init__": 5,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> Iterator[str]:
    """Every ``sluiceway`` module the file imports, lazily or not."""
    tree = ast.parse(path.read_text(), str(path))
    module = module_name(path)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: level 1 is the package itself
                base = package[: len(package) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            yield target
            # ``from sluiceway.surfaces import openai`` imports a module too.
            yield from (f"{target}.{alias.name}" for alias in node.names)


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def surface_folder(module: str) -> str | None:
    """The surface folder a module lies in (``openai``), if any."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "surfaces":
        is_folder = len(parts) > 3 or (PACKAGE / "surfaces" / parts[2]).is_dir()
        return parts[2] if is_folder else None
    return None


def is_module(module: str) -> bool:
    relative = Path(*module.split(".")[1:])
    return (PACKAGE / relative).with_suffix(".py").is_file() or (PACKAGE / relative).is_dir()


def arrows() -> Iterator[tuple[str, str]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        source = module_name(path)
        if path.name == "__main__.py":
            source = "sluiceway.__main__"
        for target in imported(path):
            if target.startswith("sluiceway.") and is_module(target):
                yield source, target


def wrong_way(source: str, target: str) -> str | None:
    """Why the arrow source -> target breaks the layering (None: it does not)."""
    here, there = layer(source), layer(target)
    if here == there:
        if here != "surfaces":
            return None
        mine, theirs = surface_folder(source), surface_folder(target)
        if theirs is not None and mine != theirs:
            return "a surface imports another surface (or shared code imports one)"
        return None
    if there not in RANKS or here not in RANKS:
        return f"a layer outside the table ({here} -> {there})"
    if RANKS[there] >= RANKS[here]:
        return f"{here} may not import {there}"
    return None


def test_the_walk_sees_imports() -> None:
    """The check below is not vacuous: it sees the arrows that exist."""
    found = set(arrows())
    assert ("sluiceway.server.app", "sluiceway.surfaces.openai") in found
    assert ("sluiceway.parsers.detokenizer", "sluiceway.protocol.tokens") in found
    assert len(found) > 100


@pytest.mark.parametrize(
    ("source", "target"),
    [
        ("sluiceway.engines.tokenizer", "sluiceway.parsers.detokenizer"),
        ("sluiceway.parsers.registry", "sluiceway.engines.tokenizer"),
        ("sluiceway.actors.output", "sluiceway.surfaces.base"),
        ("sluiceway.surfaces.openai.chat", "sluiceway.server.http"),
        ("sluiceway.protocol.messages", "sluiceway.parsers.events"),
        ("sluiceway.surfaces.anthropic.messages", "sluiceway.surfaces.openai.wire"),
        ("sluiceway.surfaces.conversation", "sluiceway.surfaces.openai.chat_wire"),
    ],
)
def test_wrong_arrows_are_caught(source: str, target: str) -> None:
    assert wrong_way(source, target) is not None


def test_imports_point_only_down() -> None:
    wrong = [
        f"{source} -> {target}: {reason}"
        for source, target in arrows()
        if (reason := wrong_way(source, target)) is not None
    ]
    assert wrong == []


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = module_name(path)
        tree = ast.parse(path.read_text(), str(path))
        targets = graph.setdefault(source, set())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _from_base(node, source, path)
                modules = [f"{base}.{alias.name}" for alias in node.names]
                submodules = [name for name in modules if is_module(name)]
                targets.update(submodules)
                if len(submodules) < len(modules):  # a name defined in ``base`` itself
                    targets.add(base)
        graph[source] = {
            t for t in targets if t != source and t.startswith("sluiceway.") and is_module(t)
        }
    return graph


def _from_base(node: ast.ImportFrom, module: str, path: Path) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every knot: a strongly connected set of two or more modules (Tarjan),
    sorted, so that a failure reads the same each run."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for after in sorted(graph.get(node, ())):
            if after not in index:
                visit(after)
                low[node] = min(low[node], low[after])
            elif after in stack:
                low[node] = min(low[node], index[after])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def one_circle(graph: dict[str, set[str]], members: set[str]) -> list[str]:
    """A path from the first member back to itself inside ``members``."""
    start = min(members)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for after in sorted(graph.get(node, ()) & members):
            if after == start:
                return [*paths[node], start]
            if after not in paths:
                paths[after] = [*paths[node], after]
                frontier.append(after)
    raise AssertionError(f"no circle through {start} in {sorted(members)}")


def test_the_circle_walk_sees_lazy_and_type_only_imports() -> None:
    graph = import_graph()
    # make_engine imports the transformers engine inside the function.
    assert "sluiceway.engines.torch_engine" in graph["sluiceway.engines.select"]
    # ``from sluiceway.surfaces.openai import fields`` names the module only.
    assert "sluiceway.surfaces.openai.fields" in graph["sluiceway.surfaces.openai.chat"]
    assert "sluiceway.surfaces.openai" not in graph["sluiceway.surfaces.openai.chat"]


def test_circles_are_found_and_named() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": {"e"}}
    assert circles(graph) == [["a", "b", "c"], ["e", "e2"]]
    assert one_circle(graph, {"a", "b", "c"}) == ["a", "b", "c", "a"]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles() -> None:
    """No module imports one that (through others) imports it back, counting
    imports inside functions and under ``TYPE_CHECKING``: a circle is a knot
    a reader must untie before any of its modules makes sense alone."""
    graph = import_graph()
    found = [
        f"{' -> '.join(one_circle(graph, set(knot)))} (the knot: {', '.join(knot)})"
        for knot in circles(graph)
    ]
    assert found == [], "import circles:\n" + "\n".join(found)
