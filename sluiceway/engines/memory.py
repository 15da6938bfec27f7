"""How much memory is still free, for sizing the prefix cache by default."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

MEMINFO = Path("/proc/meminfo")


def host_available_bytes() -> int:
    """Memory the host can still give without swapping: Linux's
    ``MemAvailable`` (free pages plus reclaimable caches), else the free
    pages ``sysconf`` reports; 0 when neither is known."""
    with contextlib.suppress(OSError, ValueError):
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    return 0
