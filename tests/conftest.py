"""Shared fixtures: anyio backends and a small model built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluiceway.engines.default_model import default_model_dir


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Async tests run on both anyio backends."""
    return str(request.param)


@pytest.fixture(scope="session")
def default_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded default model, built into a session-private cache."""
    return default_model_dir(tmp_path_factory.mktemp("cache"))
