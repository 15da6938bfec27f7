"""The mlx engine's OpenBLAS thread count: found in the process, and set
when ``--engine-threads`` asks for one."""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import pytest

from sluiceway.actors.engine_process import EngineSpec, ProcessEngine
from sluiceway.actors.thread_tuner import ThreadedEngine
from sluiceway.engines.blas import find_openblas
from sluiceway.engines.loader import ModelSource

pytest.importorskip("mlx.core")

from sluiceway.engines.mlx_engine import MlxEngine

#: Debian's OpenBLAS (``make openblas``), where installed.
DEBIAN_OPENBLAS = sorted(glob.glob("/usr/lib/*/openblas-pthread/libopenblas.so.0"))


class _Function:
    """A ctypes function stand-in: callable, with the attributes ctypes sets."""

    def __init__(self, body: Callable[..., Any]) -> None:
        self.body = body
        self.restype: Any = None
        self.argtypes: Any = None

    def __call__(self, *args: Any) -> Any:
        return self.body(*args)


class _Scope:
    """A process's symbols with OpenBLAS's two thread calls in them."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.openblas_get_num_threads = _Function(lambda: self.count)
        self.openblas_set_num_threads = _Function(self._set)

    def _set(self, count: ctypes.c_int) -> None:
        self.count = count.value


def _fake_openblas(count: int) -> tuple[_Scope, Any]:
    scope = _Scope(count)
    found = find_openblas(scope)
    assert found is not None
    return scope, found


def test_openblas_is_found_by_both_of_its_thread_calls() -> None:
    scope, found = _fake_openblas(4)
    assert found.count() == 4
    found.set_count(1)
    assert scope.count == 1
    assert found.count() == 1
    assert scope.openblas_set_num_threads.argtypes == [ctypes.c_int]
    del scope.openblas_set_num_threads
    assert find_openblas(scope) is None
    assert find_openblas(object()) is None


@pytest.fixture
def no_count_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.usefixtures("no_count_variables")
def test_the_engine_sets_the_count_asked_for(
    tiny_model: ModelSource, caplog: pytest.LogCaptureFixture
) -> None:
    scope, found = _fake_openblas(2)
    with caplog.at_level(logging.WARNING, logger="sluiceway.engines.mlx_engine"):
        engine = MlxEngine(tiny_model, blas=found)
    assert "reference BLAS" not in caplog.text
    assert engine.info.threads == 2
    assert scope.count == 2

    scope, found = _fake_openblas(2)
    engine = MlxEngine(tiny_model, threads=1, blas=found)
    assert scope.count == 1
    assert engine.info.threads == 1
    # Not tuned by timing (see MlxEngine._blas_count): the engine process
    # leaves its count alone.
    assert not isinstance(engine, ThreadedEngine)


def test_without_openblas_there_is_no_count(
    tiny_model: ModelSource, caplog: pytest.LogCaptureFixture
) -> None:
    if find_openblas() is not None:
        pytest.skip("this test process runs with OpenBLAS loaded")
    with caplog.at_level(logging.WARNING, logger="sluiceway.engines.mlx_engine"):
        engine = MlxEngine(tiny_model, threads=2)
    assert engine.info.threads == 0
    assert "ignores --engine-threads 2" in caplog.text
    # On Linux the bundled BLAS is a reference one: the log says how to do better.
    assert ("reference BLAS" in caplog.text) is (sys.platform == "linux")


@pytest.mark.skipif(
    not DEBIAN_OPENBLAS and os.environ.get("CI") != "true",
    reason="Debian's OpenBLAS is not installed (make openblas; under CI=true this fails)",
)
@pytest.mark.usefixtures("no_count_variables")
def test_an_engine_process_on_openblas_reports_its_threads(tiny_model: ModelSource) -> None:
    """With OpenBLAS preloaded into the engine's child, the child finds it and
    reports its count: OpenBLAS's own, or the one ``--engine-threads`` asks
    for. It is not tuned."""
    assert DEBIAN_OPENBLAS, "Debian's OpenBLAS is not installed: make test installs it"
    for threads in (0, 1):
        spec = EngineSpec(
            choice="mlx",
            source=tiny_model,
            device="auto",
            dtype="auto",
            threads=threads,
            environment={"LD_PRELOAD": DEBIAN_OPENBLAS[0]},
        )
        child = ProcessEngine(spec)
        try:
            if threads:
                assert child.info.threads == threads
            else:
                assert child.info.threads >= 1
            assert not child.info.threads_tuned
            assert child.prefill(0, [5, 6, 7]).shape[0] == 1
        finally:
            child.close()
