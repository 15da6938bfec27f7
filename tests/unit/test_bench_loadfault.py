"""The load-and-fault bench's verdict on memory (bench/loadfault.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))

from faults import Tally
from loadfault import Memory, checks


def memory(settled: float, cache: float) -> Memory:
    """A server at 650 MiB before any burst, 1,200 right after the
    measured one, ``settled`` once idle, its prefix cache then holding
    ``cache`` (empty before any burst)."""
    return Memory(
        before=650,
        warmed=840,
        peak=1210,
        after_burst=1200,
        settled=settled,
        cache_warmed=cache / 2,
        cache_settled=cache,
    )


def test_the_prefix_cache_is_not_counted_as_memory_kept() -> None:
    # 380 MiB of cache, and 70 of the other 170 MiB the bursts added kept.
    assert checks(Tally(), 0.0, memory(settled=1100, cache=380)) == []


def test_a_server_that_gives_nothing_back_fails_with_or_without_a_cache() -> None:
    for cache in (0.0, 380.0):
        (failure,) = [f for f in checks(Tally(), 0.0, memory(1190, cache)) if "given back" in f]
        assert f"keeps {1190 - 650 - cache:.0f} MiB" in failure
