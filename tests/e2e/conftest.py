"""A real server per worker class, started once per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import RunningServer, start_server
from tests.fixtures.scripted_model import ScriptedModel

#: Every worker class with every engine.
SETUPS = [
    pytest.param(("asyncio", "mlx"), id="asyncio-mlx"),
    pytest.param(("trio", "mlx"), id="trio-mlx"),
    pytest.param(("asyncio", "transformers"), id="asyncio-transformers"),
    pytest.param(("trio", "transformers"), id="trio-transformers"),
]


@pytest.fixture(scope="session", params=SETUPS)
def server(
    request: pytest.FixtureRequest, default_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """The default model served under Hypercorn, per worker class and engine."""
    worker_class, engine = request.param
    running = start_server(
        default_model,
        worker_class=worker_class,
        log_dir=tmp_path_factory.mktemp("logs"),
        extra_args=["--max-body-bytes", "65536", "--engine", engine],
    )
    yield running
    running.stop()


@pytest.fixture(scope="session", params=SETUPS)
def scripted_server(
    request: pytest.FixtureRequest,
    scripted: ScriptedModel,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RunningServer]:
    """The scripted model served under Hypercorn, per worker class and engine."""
    worker_class, engine = request.param
    running = start_server(
        scripted.path,
        worker_class=worker_class,
        log_dir=tmp_path_factory.mktemp("logs"),
        name="scripted",
        extra_args=["--engine", engine],
    )
    # A looping script whose every token carries text times the pace.
    running.pace_fields = {"chat_template_kwargs": scripted.chat_kwargs("bytes_stop")}
    yield running
    running.stop()


@pytest.fixture(scope="session")
def reference(default_model: Path) -> Any:
    """The default model in transformers, for direct forward passes."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(default_model), dtype=torch.float32)
    return model.eval()
