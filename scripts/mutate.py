"""Mutation testing of the core (`make mutate`): run mutmut module by module,
then print each module's mutation score.

    python scripts/mutate.py [MODULE ...]           # run, then score (all modules by default)
    python scripts/mutate.py --rerun [MODULE ...]   # run every mutant again, verdict or not
    python scripts/mutate.py --score [MODULE ...]   # only score what the last runs left

A module is a file under sluiceway/ that pyproject.toml's ``[tool.mutmut]``
lets mutmut mutate (its ``only_mutate``, globs allowed), named by its dotted
path below the package (``parsers.markers``, ``actors.scheduler_core``). On
the command line any run of whole name parts picks modules: ``markers``,
``parsers.markers``, ``sluiceway/parsers/markers.py``, or ``formats`` for
every module of parsers/formats/. The tests are ``[tool.mutmut]``'s
``pytest_add_cli_args_test_selection``, and each mutant runs only those of
them that reached the mutated function, so that a parser mutant never runs
the scheduler's tests. One module at a time keeps a run to minutes on a
loaded two-core host; a run that stops resumes where it left off: mutmut
keeps its verdicts in ./mutants (which git ignores), and a module with
verdicts already runs only its unchecked mutants. After changing a module or
its tests, ``--rerun`` it.

The score of a module is killed / (mutants - equivalent): a timeout counts
as killed (the mutant made a test hang; the ``timeout`` column says how many,
since a loaded host can time out a mutant that would have survived), a
survivor listed in tests/mutation_equivalents.txt (``name  # why it cannot
be told apart``) is left out. A survivor that is not listed makes the exit
status 1: it needs a test that kills it, or a line there.
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
PACKAGE = "sluiceway"
EQUIVALENTS = ROOT / "tests" / "mutation_equivalents.txt"
MUTMUT = Path(sys.executable).with_name("mutmut")
KILLED = {"killed", "timeout", "caught by type check"}
UNCHECKED = "not checked"


def modules() -> list[str]:
    """The modules mutmut may mutate, dotted below the package, in
    pyproject.toml's order (a glob's files sorted)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    found: list[str] = []
    for pattern in config["only_mutate"]:
        for path in sorted(ROOT.glob(pattern)):
            name = module_name(path.relative_to(ROOT).as_posix())
            if name not in found:
                found.append(name)
    return found


def module_name(text: str) -> str:
    """``sluiceway/parsers/markers.py`` or ``sluiceway.parsers.markers`` -> ``parsers.markers``
    (a package's ``__init__.py`` is the package, as in mutmut's mutant names)."""
    dotted = text.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
    return dotted.removeprefix(f"{PACKAGE}.")


def select(asked: list[str], known: list[str]) -> list[str]:
    """The known modules that each asked name picks, in the known order."""
    chosen: set[str] = set()
    for text in asked:
        parts = module_name(text).split(".")
        picked = {
            name
            for name in known
            if any(
                name.split(".")[i : i + len(parts)] == parts
                for i in range(len(name.split(".")) - len(parts) + 1)
            )
        }
        if not picked:
            raise SystemExit(f"not mutated: {text!r}; choose among {known}")
        chosen |= picked
    return [name for name in known if name in chosen]


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


def run(module: str, *, rerun: bool) -> None:
    mine = {n: s for n, s in results().items() if module_of(n) == module}
    unchecked = sorted(n for n, s in mine.items() if s == UNCHECKED)
    if mine and not unchecked and not rerun:
        print(f"{module}: every mutant has a verdict (--rerun to run them again)")
        return
    # mutmut reruns every mutant a pattern matches: to resume, name the rest.
    # Mangled names start with x_ or xǁ, so a package's pattern leaves its
    # submodules out.
    names = unchecked if mine and unchecked and not rerun else [f"{PACKAGE}.{module}.x*"]
    jobs = os.environ.get("MUTATE_JOBS", "2")
    # A tenth of each property test's examples (tests/parsers/harness.py):
    # still dozens per test, and every mutant runs every test that reaches it.
    # tests/conftest.py's "mutate" profile: no shrinking, no example database.
    environment = {
        **os.environ,
        "SLUICEWAY_SOAK": os.environ.get("SLUICEWAY_SOAK", "0.1"),
        "SLUICEWAY_MUTATE": "1",
    }
    subprocess.run(
        [str(MUTMUT), "run", *names, "--max-children", jobs],
        cwd=ROOT,
        check=True,
        env=environment,
    )


def results() -> dict[str, str]:
    """Every mutant mutmut knows of -> its status."""
    if not (ROOT / "mutants").is_dir():
        return {}
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
    """``sluiceway.parsers.stop.xǁStopMatcherǁfeed__mutmut_3`` -> ``parsers.stop``."""
    return module_name(mutant.rpartition(".")[0])


def score(names: list[str]) -> int:
    statuses = results()
    listed = equivalents()
    unexplained = []
    width = max(len(name) for name in [*names, "module"])
    print(
        f"{'module':<{width}} {'mutants':>7} {'killed':>6} {'timeout':>7} {'equiv':>5} "
        f"{'left':>5}  score"
    )
    total_killed = total_counted = 0
    not_run: set[str] = set()
    for module in names:
        mine = {k: v for k, v in statuses.items() if module_of(k) == module}
        if all(status == UNCHECKED for status in mine.values()):  # generated, never run
            print(f"{module:<{width}} not run")
            not_run.add(module)
            continue
        counts = Counter(
            "equivalent"
            if status == "survived" and name in listed
            else "killed"
            if status in KILLED
            else status
            for name, status in mine.items()
        )
        timeouts = sum(status == "timeout" for status in mine.values())
        counted = len(mine) - counts["equivalent"]
        left = counted - counts["killed"]
        unexplained += sorted(n for n, s in mine.items() if s == "survived" and n not in listed)
        ratio = counts["killed"] / counted if counted else 1.0
        print(
            f"{module:<{width}} {len(mine):>7} {counts['killed']:>6} {timeouts:>7} "
            f"{counts['equivalent']:>5} {left:>5}  {ratio:.1%}"
        )
        total_killed += counts["killed"]
        total_counted += counted
    if total_counted:
        print(
            f"{'all':<{width}} {'':>7} {total_killed:>6} {'':>7} {'':>5} {'':>5}  "
            f"{total_killed / total_counted:.1%}"
        )
    others = sorted(
        f"{n}: {s}"
        for n, s in statuses.items()
        if module_of(n) in set(names) - not_run and s not in KILLED and s != "survived"
    )
    for line in others:
        print("not killed:", line)
    for name in unexplained:
        print("survived, unexplained:", name)
    return 1 if unexplained or others else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("modules", nargs="*", help="modules or packages (default: all)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--score", action="store_true", help="score the last runs only")
    mode.add_argument("--rerun", action="store_true", help="run mutants that have a verdict too")
    args = parser.parse_args()
    known = modules()
    names = select(args.modules, known) if args.modules else known
    if not args.score:
        for module in names:
            run(module, rerun=args.rerun)
    return score(names)


if __name__ == "__main__":
    sys.exit(main())
