"""The mlx engine's OpenBLAS thread count: found in the process, set when
asked for, otherwise left to the engine process's thread tuner."""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from sluiceway.actors.engine_process import EngineSpec, ProcessEngine
from sluiceway.engines.blas import COUNT_VARIABLES, find_openblas, requested_count
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


def test_the_count_asked_for_reads_as_openblas_reads_it() -> None:
    assert requested_count(3, {"OPENBLAS_NUM_THREADS": "1"}) == 3
    assert requested_count(0, {}) == 0
    for name in COUNT_VARIABLES:
        assert requested_count(0, {name: "2"}) == 2
    # The first variable holding a positive number wins, as in OpenBLAS.
    assert requested_count(0, {"OPENBLAS_NUM_THREADS": "0", "OMP_NUM_THREADS": "3"}) == 3
    assert requested_count(0, {"GOTO_NUM_THREADS": "5", "OMP_NUM_THREADS": "3"}) == 5
    assert requested_count(0, {"OMP_NUM_THREADS": "two"}) == 0


@pytest.fixture
def no_count_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in COUNT_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.usefixtures("no_count_variables")
def test_the_engine_tunes_openblas_only_when_no_count_was_asked_for(
    tiny_model: ModelSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    scope, found = _fake_openblas(2)
    engine = MlxEngine(tiny_model, blas=found)
    assert engine.tunable
    assert engine.info.threads == 2
    engine.set_threads(1)
    assert scope.count == 1

    scope, found = _fake_openblas(2)
    engine = MlxEngine(tiny_model, threads=1, blas=found)
    assert not engine.tunable
    assert scope.count == 1
    assert engine.info.threads == 1

    for name in COUNT_VARIABLES:
        with monkeypatch.context() as patch:
            patch.setenv(name, "2")
            assert not MlxEngine(tiny_model, blas=_fake_openblas(2)[1]).tunable

    assert not MlxEngine(tiny_model, blas=_fake_openblas(1)[1]).tunable


def test_without_openblas_there_is_no_count(
    tiny_model: ModelSource, caplog: pytest.LogCaptureFixture
) -> None:
    if find_openblas() is not None:
        pytest.skip("this test process runs with OpenBLAS loaded")
    with caplog.at_level(logging.WARNING, logger="sluiceway.engines.mlx_engine"):
        engine = MlxEngine(tiny_model, threads=2)
    assert not engine.tunable
    assert engine.info.threads == 0
    assert "ignores --engine-threads 2" in caplog.text
    engine.set_threads(1)  # nothing to set: not an error


def test_a_switch_under_a_queued_step_keeps_the_stream(tiny_model: ModelSource) -> None:
    """The tuner switches between steps while the step queued ahead may be
    computing: the switch keeps that step, and the stream goes on as if the
    count had never changed."""
    scope, found = _fake_openblas(2)
    switching = MlxEngine(tiny_model, blas=found)
    steady = MlxEngine(tiny_model)
    tokens = {}
    for slot, ids in ((0, [5, 6, 7, 8]), (1, [9, 10, 11])):
        first = switching.prefill(slot, ids)
        np.testing.assert_array_equal(first, steady.prefill(slot, ids))
        tokens[slot] = int(first[-1].argmax())
    for step in range(8):
        switching.set_threads(1 + step % 2)
        got = switching.start_decode_chained(tokens)()
        expected = steady.decode(tokens)
        np.testing.assert_array_equal(got.logits, expected.logits)
        tokens = {slot: int(row.argmax()) for slot, row in zip(got.slots, got.logits, strict=True)}
    assert switching.queued_taken == 7
    assert scope.count == 2


#: Run under Debian's OpenBLAS: two rows decoded with the step after each
#: queued, the count switched before every step, against a second engine on
#: one thread throughout. Two rows compute alike on either count (a larger
#: batch's products may differ in the last bits between counts, as they do
#: between batch sizes), so every logit must match.
SWITCHING = """
import sys
import numpy as np
from sluiceway.engines.blas import find_openblas
from sluiceway.engines.loader import resolve_model
from sluiceway.engines.mlx_engine import MlxEngine

blas = find_openblas()
assert blas is not None and blas.count() >= 2, "OpenBLAS not preloaded"
source = resolve_model(sys.argv[1])
switching, steady = MlxEngine(source), MlxEngine(source, threads=1)
assert switching.tunable and not steady.tunable
tokens = {}
blas.set_count(1)
for slot, ids in ((0, [5, 6, 7, 8]), (1, [9, 10, 11])):
    first = switching.prefill(slot, ids)
    np.testing.assert_array_equal(first, steady.prefill(slot, ids))
    tokens[slot] = int(first[-1].argmax())
for step in range(12):
    switching.set_threads(1 + step % 2)
    assert blas.count() == 1 + step % 2
    got = switching.start_decode_chained(tokens)()
    blas.set_count(1)
    expected = steady.decode(tokens)
    np.testing.assert_array_equal(got.logits, expected.logits)
    tokens = {s: int(row.argmax()) for s, row in zip(got.slots, got.logits, strict=True)}
assert switching.queued_taken == 11
print("ok")
"""


@pytest.mark.skipif(not DEBIAN_OPENBLAS, reason="Debian's OpenBLAS is not installed")
@pytest.mark.usefixtures("no_count_variables")
def test_openblas_switches_under_queued_steps(tiny_model: ModelSource) -> None:
    env = {**os.environ, "LD_PRELOAD": DEBIAN_OPENBLAS[0]}
    done = subprocess.run(
        [sys.executable, "-c", SWITCHING, str(tiny_model.path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("ok")


@pytest.mark.skipif(not DEBIAN_OPENBLAS, reason="Debian's OpenBLAS is not installed")
@pytest.mark.usefixtures("no_count_variables")
def test_an_engine_process_on_openblas_tunes_its_threads(tiny_model: ModelSource) -> None:
    """With OpenBLAS preloaded into the engine's child, the child finds it,
    reports its count, and tunes it where it has 2 threads or more
    (``engine_threads_tuned``); given ``--engine-threads 1``, it computes
    on one thread and does not tune."""
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
                assert not child.info.threads_tuned
            else:
                assert child.info.threads >= 1
                assert child.info.threads_tuned is (child.info.threads >= 2)
            assert child.prefill(0, [5, 6, 7]).shape[0] == 1
        finally:
            child.close()
