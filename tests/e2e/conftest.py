"""Real servers per worker class and engine, started once per xdist worker."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import RunningServer, ServerPool
from tests.fixtures.scripted_model import ScriptedModel

#: Every worker class with every engine.
ALL_SETUPS = [
    pytest.param(("asyncio", "mlx"), id="asyncio-mlx"),
    pytest.param(("trio", "mlx"), id="trio-mlx"),
    pytest.param(("asyncio", "transformers"), id="asyncio-transformers"),
    pytest.param(("trio", "transformers"), id="trio-transformers"),
]
#: Each worker class once and each engine once. The worker class touches only
#: the HTTP side and the engine only the generation side, so a fault that
#: needs one particular pair is unlikely, while the four pairs cost twice the
#: suite's time (the 15-minute budget of `make test`); SLUICEWAY_TEST_SETUPS=all
#: runs the four.
DIAGONAL = [ALL_SETUPS[1], ALL_SETUPS[2]]
#: vLLM's engine (``make test-vllm``, in .venv-vllm): asyncio only (vLLM's
#: AsyncLLM is asyncio code), one server per model shared by every module.
VLLM = [pytest.param(("asyncio", "vllm"), id="asyncio-vllm")]
SETUPS = {"all": ALL_SETUPS, "vllm": VLLM}.get(
    os.environ.get("SLUICEWAY_TEST_SETUPS", ""), DIAGONAL
)
ON_VLLM = SETUPS is VLLM
#: For a test that starts a server of its own on the default engine, to
#: check what no engine changes (an API key, a CLI flag's surface): under
#: ``make test-vllm`` it would repeat ``make test``, not run vLLM, at the
#: cost of a server start (10-20 s on a loaded 2-core host) each.
DEFAULT_ENGINE_ONLY = pytest.mark.skipif(
    ON_VLLM, reason="runs on the default engine, not vLLM: make test runs it"
)


@pytest.fixture(scope="session")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerPool]:
    """This worker's shared servers, each started when first asked for and
    stopped when the session ends."""
    pool = ServerPool(tmp_path_factory.mktemp("logs"))
    yield pool
    pool.close()


def default_args(engine: str) -> list[str]:
    """The flags of the default model's shared server on ``engine``."""
    return ["--max-body-bytes", "65536", "--engine", engine]


# Module scope over a session pool, not a parametrized session fixture: pytest
# keeps one parameter of a session fixture alive at a time, and a file runs
# both setups, so every file restarted both servers.
@pytest.fixture(scope="module", params=SETUPS)
def server(
    request: pytest.FixtureRequest, default_model: Path, servers: ServerPool
) -> RunningServer:
    """The default model served under Hypercorn, per worker class and engine."""
    worker_class, engine = request.param
    return servers.get(default_model, worker_class=worker_class, extra_args=default_args(engine))


@pytest.fixture(scope="module", params=SETUPS)
def scripted_server(
    request: pytest.FixtureRequest, scripted: ScriptedModel, servers: ServerPool
) -> RunningServer:
    """The scripted model served under Hypercorn, per worker class and engine."""
    worker_class, engine = request.param
    running = servers.get(
        scripted.path, worker_class=worker_class, name="scripted", extra_args=["--engine", engine]
    )
    # A looping script whose every token carries text times the pace.
    running.pace_fields = {"chat_template_kwargs": scripted.chat_kwargs("bytes_stop")}
    return running


@pytest.fixture(scope="session")
def reference(default_model: Path) -> Any:
    """The default model in transformers, for direct forward passes."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(default_model), dtype=torch.float32)
    return model.eval()
