"""Check that a virtualenv holds exactly what the lock says.

Every distribution that ``pip freeze --all`` reports (the project itself
aside) must appear in the lock, for this platform, at the same version. A
local version label (torch's ``+cpu``) is the build the lock's version names,
so it is compared without it. Lock entries whose markers do not apply here,
and those a build does not need (the CUDA packages below torch), may be
absent.

    python scripts/check_lock.py requirements.lock [--python OTHER_VENV/bin/python]

With ``--python``, the virtualenv checked is that interpreter's (`make
test-latest` uses it to list what the newest releases changed; the markers
are still evaluated here, so the two must share a platform).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

PROJECT = "sluiceway"


def locked(path: Path) -> dict[str, Version]:
    """The lock's pins that apply to this interpreter and platform."""
    pins: dict[str, Version] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        requirement = Requirement(line)
        if requirement.marker is not None and not Marker(str(requirement.marker)).evaluate():
            continue
        (spec,) = requirement.specifier
        if spec.operator != "==":
            raise SystemExit(f"{path}: {line!r} is not an exact pin")
        pins[canonicalize_name(requirement.name)] = Version(spec.version)
    return pins


def installed(python: str) -> dict[str, Version]:
    freeze = subprocess.run(
        [python, "-m", "pip", "freeze", "--all", "--disable-pip-version-check"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    found: dict[str, Version] = {}
    for line in freeze.splitlines():
        if line.startswith(("-e ", "#")) or " @ " in line or "==" not in line:
            continue  # the editable project, or something not from a registry
        name, _, version = line.partition("==")
        found[canonicalize_name(name)] = Version(version)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("lock", type=Path, nargs="?", default=Path("requirements.lock"))
    parser.add_argument("--python", default=sys.executable, help="the virtualenv's interpreter")
    args = parser.parse_args()
    lock: Path = args.lock
    pins = locked(lock)
    problems = []
    for name, version in sorted(installed(args.python).items()):
        if name == PROJECT:
            continue
        want = pins.get(name)
        if want is None:
            problems.append(f"{name}=={version} is installed but not in {lock}")
        elif Version(version.public) != want:
            problems.append(f"{name}=={version} is installed; {lock} pins {want}")
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        print(f"{args.python}: the virtualenv does not match {lock}", file=sys.stderr)
        return 1
    print(f"every installed package matches {lock}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
