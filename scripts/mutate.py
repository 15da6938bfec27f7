"""Mutation testing of the parsers (`make mutate`): run mutmut module by
module, then print each module's mutation score.

    python scripts/mutate.py [MODULE ...]      # run, then score (all modules by default)
    python scripts/mutate.py --score [MODULE ...]   # only score what the last runs left

A module is a file of sluiceway/parsers/ that pyproject.toml's
``[tool.mutmut]`` lets mutmut mutate (its ``only_mutate``); the tests are
its ``pytest_add_cli_args_test_selection``, and each mutant runs only those
of them that reached the mutated function. One module at a time keeps a run
to minutes on a loaded two-core host, and a run that stops resumes where it
left off (mutmut keeps its results in ./mutants, which git ignores).

The score of a module is killed / (mutants - equivalent): a timeout counts
as killed (the mutant made a test hang), a survivor listed in
tests/mutation_equivalents.txt (``name  # why it cannot be told apart``)
is left out. A survivor that is not listed makes the exit status 1: it
needs a test that kills it, or a line there.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tomllib
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EQUIVALENTS = ROOT / "tests" / "mutation_equivalents.txt"
MUTMUT = Path(sys.executable).with_name("mutmut")
KILLED = {"killed", "timeout", "caught by type check"}


def modules() -> list[str]:
    """The modules mutmut may mutate, by stem, in pyproject.toml's order."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    return [Path(path).stem for path in config["only_mutate"]]


def equivalents() -> dict[str, str]:
    """Mutant name -> why it is equivalent, from the checked-in list."""
    found = {}
    for line in EQUIVALENTS.read_text().splitlines():
        name, _, reason = line.partition("#")
        if name.strip():
            if not reason.strip():
                raise SystemExit(f"{EQUIVALENTS.name}: {name.strip()} has no reason")
            found[name.strip()] = reason.strip()
    return found


def run(module: str) -> None:
    jobs = os.environ.get("MUTATE_JOBS", "2")
    # A tenth of each property test's examples (tests/parsers/harness.py):
    # still dozens per test, and every mutant runs every test that reaches it.
    environment = {**os.environ, "SLUICEWAY_SOAK": os.environ.get("SLUICEWAY_SOAK", "0.1")}
    pattern = f"sluiceway.parsers.{module}.*"
    subprocess.run(
        [str(MUTMUT), "run", pattern, "--max-children", jobs],
        cwd=ROOT,
        check=True,
        env=environment,
    )


def results() -> dict[str, str]:
    """Every mutant mutmut knows of -> its status."""
    listing = subprocess.run(
        [str(MUTMUT), "results", "--all", "true"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    found = {}
    for line in listing.splitlines():
        match = re.fullmatch(r"\s*(\S+): (.+)", line)
        if match:
            found[match[1]] = match[2].strip()
    return found


def module_of(mutant: str) -> str:
    return mutant.split(".")[2]


def score(names: list[str]) -> int:
    statuses = results()
    listed = equivalents()
    unexplained = []
    print(f"{'module':<12} {'mutants':>7} {'killed':>6} {'equiv':>5} {'left':>5}  score")
    total_killed = total_counted = 0
    for module in names:
        mine = {k: v for k, v in statuses.items() if module_of(k) == module}
        if not mine:
            print(f"{module:<12} not run")
            continue
        counts = Counter(
            "equivalent"
            if status == "survived" and name in listed
            else "killed"
            if status in KILLED
            else status
            for name, status in mine.items()
        )
        counted = len(mine) - counts["equivalent"]
        left = counted - counts["killed"]
        unexplained += sorted(n for n, s in mine.items() if s == "survived" and n not in listed)
        ratio = counts["killed"] / counted if counted else 1.0
        print(
            f"{module:<12} {len(mine):>7} {counts['killed']:>6} {counts['equivalent']:>5} "
            f"{left:>5}  {ratio:.1%}"
        )
        total_killed += counts["killed"]
        total_counted += counted
    if total_counted:
        print(
            f"{'all':<12} {'':>7} {total_killed:>6} {'':>5} {'':>5}  "
            f"{total_killed / total_counted:.1%}"
        )
    others = sorted(
        f"{n}: {s}"
        for n, s in statuses.items()
        if module_of(n) in names and s not in KILLED and s != "survived"
    )
    for line in others:
        print("not killed:", line)
    for name in unexplained:
        print("survived, unexplained:", name)
    return 1 if unexplained or others else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("modules", nargs="*", help="parsers modules (default: all)")
    parser.add_argument("--score", action="store_true", help="score the last runs only")
    args = parser.parse_args()
    known = modules()
    names = args.modules or known
    if unknown := sorted(set(names) - set(known)):
        parser.error(f"not mutated: {unknown}; choose among {known}")
    if not args.score:
        for module in names:
            run(module)
    return score(names)


if __name__ == "__main__":
    sys.exit(main())
