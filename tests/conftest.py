"""Shared fixtures: anyio backends and a small model built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import Phase, settings

from sluiceway.engines.default_model import default_model_dir
from sluiceway.parsers import formats
from tests.e2e.scripts import ALL_SCRIPTS
from tests.fixtures.scripted_model import ScriptedModel, build_scripted_model

# The gate draws the same examples on every run, so a CI failure is one
# `CI=true make test` reproduces; everywhere else each run explores anew
# (that is how the date-format defect was found).
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
# `make mutate` (scripts/mutate.py) asks only whether a test fails: no
# shrinking (a failing state machine shrinks for longer than mutmut waits,
# and the mutant would count as a timeout), and no example database (a
# verdict must not depend on what failed for an earlier mutant).
settings.register_profile("mutate", phases=[Phase.explicit, Phase.generate], database=None)
if os.environ.get("SLUICEWAY_MUTATE"):
    settings.load_profile("mutate")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under `make mutate`, each test builds the tool-call formats and their
    graphs anew. mutmut imports everything and runs its stats pass in one
    process, then forks a child per mutant and switches the mutant on there:
    a build cached before the fork would never run with the mutant on (and
    the stats pass would tie the builders to the one test that first built
    them, so a mutant of theirs would run only that test)."""
    if os.environ.get("SLUICEWAY_MUTATE"):
        formats.formats.cache_clear()
        formats.graphs.cache_clear()


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Async tests run on both anyio backends."""
    return str(request.param)


@pytest.fixture(scope="session")
def default_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded default model, built into a session-private cache."""
    return default_model_dir(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> ScriptedModel:
    """A real Qwen3 model whose greedy decoding follows the scripts in tests/e2e/scripts.py."""
    # vLLM's CPU attention takes head sizes of 32 and up (make test-vllm).
    multiple = 32 if os.environ.get("SLUICEWAY_TEST_SETUPS") == "vllm" else 8
    return build_scripted_model(
        tmp_path_factory.mktemp("scripted"), ALL_SCRIPTS, head_dim_multiple=multiple
    )
