"""Exit 0 when a folder's node_modules holds what its package-lock.json pins.

Every package the lock lists must be installed at the locked version, except
optional ones (another platform's binaries), which may be absent.

    python scripts/npm_installed.py tests/clients/codex
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def installed(folder: Path) -> bool:
    packages = json.loads((folder / "package-lock.json").read_text())["packages"]
    for path, entry in packages.items():
        if not path:  # the folder's own package
            continue
        manifest = folder / path / "package.json"
        if not manifest.exists():
            if entry.get("optional"):
                continue
            return False
        if json.loads(manifest.read_text()).get("version") != entry.get("version"):
            return False
    return True


def main() -> None:
    sys.exit(0 if installed(Path(sys.argv[1])) else 1)


if __name__ == "__main__":
    main()
