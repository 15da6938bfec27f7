"""A real server per worker class, started once per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.harness import RunningServer, start_server
from tests.fixtures.scripted_model import ScriptedModel


@pytest.fixture(scope="session", params=["asyncio", "trio"])
def server(
    request: pytest.FixtureRequest, default_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """The default model served under Hypercorn with each worker class."""
    running = start_server(
        default_model,
        worker_class=str(request.param),
        log_dir=tmp_path_factory.mktemp("logs"),
        extra_args=["--max-body-bytes", "65536"],
    )
    yield running
    running.stop()


@pytest.fixture(scope="session", params=["asyncio", "trio"])
def scripted_server(
    request: pytest.FixtureRequest,
    scripted: ScriptedModel,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RunningServer]:
    """The scripted model served under Hypercorn with each worker class."""
    running = start_server(
        scripted.path,
        worker_class=str(request.param),
        log_dir=tmp_path_factory.mktemp("logs"),
        name="scripted",
    )
    yield running
    running.stop()
