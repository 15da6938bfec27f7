"""The compiled decode step with its weights frozen into the graphs
(``--frozen-weights``): Inductor's own C++ matrix products in place of
oneDNN's, the same decode within bfloat16's tolerance, one graph for the
buckets from 2 up, and the rule that decides when weights are frozen.

Compiling is slow (15 s for each of the tiny model's graphs with frozen
weights on a 2-core host, and Inductor never caches one), so one engine
serves the module, it compiles the buckets 1, 2 and 4 only and prefills
eagerly, and it is held to the eager engine, which compiles nothing.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from sluiceway.engines import torch_engine
from sluiceway.engines.compile_choice import verdict_key
from sluiceway.engines.loader import ModelSource
from sluiceway.engines.torch_compiled import FROZEN_OPTIONS, CompiledStep
from sluiceway.engines.torch_engine import TransformersEngine
from sluiceway.engines.torch_prepack import (
    PackedLinear,
    frozen_graph,
    linear_bytes,
    prepack_linears,
    unsupported,
)
from tests.engines.helpers import LOGPROB_TOLERANCES

CPU = torch.device("cpu")

pytestmark = [
    pytest.mark.skipif(
        unsupported(CPU, torch.bfloat16) is not None,
        reason=f"no bfloat16 products here: {unsupported(CPU, torch.bfloat16)}",
    ),
    pytest.mark.timeout(900),
]


def _templates() -> int:
    """C++ matrix-product templates Inductor has written in this process."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cpp_templated_kernel_counter"])


def test_a_layer_in_a_frozen_graph_uses_its_matrix_as_loaded() -> None:
    """Inside frozen_graph the traced layer multiplies by its plain matrix, which
    Inductor packs for a product of its own; outside it, by oneDNN's copy."""
    torch.manual_seed(3)
    plain = torch.nn.Linear(64, 96, bias=True, dtype=torch.bfloat16)
    layer = PackedLinear(plain, keep_plain=True)
    rows = torch.randn(1, 64).to(torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: layer(x), fullgraph=True, options=FROZEN_OPTIONS)
    with torch.inference_mode():
        expected = plain(rows)
        before = _templates()
        with frozen_graph():
            frozen = compiled(rows)
        assert _templates() > before
        torch.testing.assert_close(frozen, expected, rtol=0.02, atol=0.02)
        before = _templates()
        torch._dynamo.reset()
        opaque = torch.compile(lambda x: layer(x), fullgraph=True)(rows)
        assert _templates() == before  # the custom op: oneDNN's product
        torch.testing.assert_close(opaque, expected, rtol=0, atol=0)


def test_a_layer_without_its_plain_matrix_keeps_only_onednns_copy() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 32, dtype=torch.bfloat16))
    assert prepack_linears(model) == 1
    assert isinstance(model[0], PackedLinear)
    assert model[0].weight is None
    kept = torch.nn.Sequential(torch.nn.Linear(16, 32, dtype=torch.bfloat16))
    plain = kept[0].weight
    prepack_linears(kept, keep_plain=True)
    assert kept[0].weight is plain
    # Counted as loaded: 16 x 32 bfloat16 matrices.
    assert linear_bytes(model) == linear_bytes(kept) == 16 * 32 * 2


MAX_BATCH = 4


@pytest.fixture(scope="module")
def pair(tiny_model: ModelSource) -> Iterator[tuple[TransformersEngine, TransformersEngine]]:
    engines = (
        TransformersEngine(tiny_model, dtype="bfloat16", compile="on", compile_max_batch=MAX_BATCH),
        TransformersEngine(tiny_model, dtype="bfloat16"),
    )
    # Prompts prefill eagerly: only the decode step freezes its weights, and
    # the prefill's graph would cost the suite a cold compile.
    engines[0]._compiled_prefill = None
    yield engines[0], engines[1]
    for engine in engines:
        engine.close()


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.asarray(logits, dtype=np.float64)
    shifted = shifted - shifted.max()
    result: np.ndarray = shifted - np.log(np.exp(shifted).sum())
    return result


def _assert_close_rows(got: np.ndarray, want: np.ndarray, what: object) -> None:
    """Logprobs within bfloat16's tolerance, and the same greedy token unless
    the expected top two are closer than that tolerance (a tie either kernel
    may break)."""
    tolerance = LOGPROB_TOLERANCES["bfloat16"]
    a, b = _log_softmax(got), _log_softmax(want)
    error = float(np.max(np.abs(a - b)))
    assert error < tolerance, (what, error)
    top, second = np.sort(b)[-2:][::-1]
    if top - second >= tolerance:
        assert int(np.argmax(a)) == int(np.argmax(b)), what


def _forced_schedule(
    engines: tuple[TransformersEngine, TransformersEngine],
    prompts: dict[int, list[int]],
    joins: dict[int, list[int]],
    leaves: dict[int, list[int]],
    steps: int,
) -> None:
    """Both engines decode the expected engine's greedy tokens (so that a
    near tie broken the other way cannot send them down different texts),
    every row of every step compared."""
    got, want = engines
    tokens: dict[int, int] = {}
    for step in range(steps):
        for slot in joins.get(step, []):
            first = [engine.prefill(slot, prompts[slot])[-1] for engine in engines]
            _assert_close_rows(first[0], first[1], ("prefill", slot))
            tokens[slot] = int(np.argmax(first[1]))
        for slot in leaves.get(step, []):
            for engine in engines:
                engine.free(slot)
            del tokens[slot]
        a, b = got.decode(tokens), want.decode(tokens)
        assert a.slots == b.slots
        for row, slot in enumerate(b.slots):
            _assert_close_rows(a.logits[row], b.logits[row], (step, slot))
            tokens[slot] = int(np.argmax(b.logits[row]))
    for slot in tokens:
        for engine in engines:
            engine.free(slot)


def test_frozen_graphs_decode_as_the_eager_step_within_bfloat16s_tolerance(
    pair: tuple[TransformersEngine, TransformersEngine],
) -> None:
    """Rows join and leave across the buckets 1, 2 and 4 (3 padded to 4):
    logprobs within bfloat16's tolerance of the eager step's, the same greedy
    tokens but for near ties, and the buckets 2 and 4 through one graph."""
    from torch._dynamo.utils import counters

    step = pair[0].compiled_step
    assert step is not None
    assert step.frozen
    rng = np.random.default_rng(5)
    prompts = {slot: [int(t) for t in rng.integers(3, 500, 4 + 11 * slot)] for slot in range(4)}
    graphs, templates = counters["stats"]["unique_graphs"], _templates()
    _forced_schedule(pair, prompts, {0: [0], 2: [1], 4: [2], 6: [3]}, {9: [1]}, steps=14)
    assert step.frozen
    assert step.failure is None
    assert _templates() > templates
    assert {bucket for bucket, ran in step.steps.items() if ran} == {1, 2, 4}
    # The one-row graph and one for every bucket from 2 up.
    assert counters["stats"]["unique_graphs"] - graphs <= 2


def test_weights_are_frozen_only_in_bfloat16_with_a_compiled_step(
    tiny_model: ModelSource, caplog: pytest.LogCaptureFixture
) -> None:
    eager = TransformersEngine(tiny_model, dtype="bfloat16", frozen_weights="on")
    assert eager.compiled_step is None
    assert not eager._frozen
    caplog.set_level(logging.WARNING, logger=torch_engine.__name__)
    wide = TransformersEngine(tiny_model, dtype="float32", compile="on", frozen_weights="on")
    assert wide.compiled_step is not None
    assert not wide.compiled_step.frozen
    assert "float32" in caplog.text
    with pytest.raises(ValueError, match="--frozen-weights"):
        TransformersEngine(tiny_model, dtype="bfloat16", frozen_weights="always")


def test_auto_freezes_only_where_the_copies_fit_an_eighth_of_free_memory() -> None:
    mib = 2**20
    assert torch_engine._frozen_memory(10 * mib, available=240 * mib) is None
    why = torch_engine._frozen_memory(11 * mib, available=240 * mib)
    assert why is not None
    assert "33 MiB" in why
    assert "240 MiB" in why


def test_frozen_weights_have_verdicts_of_their_own(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    keys = {
        verdict_key(
            tmp_path,
            dtype="bfloat16",
            threads=2,
            torch_version="2.13.0",
            buckets=(1, 2),
            prepacked=True,
            frozen=frozen,
        )
        for frozen in (False, True)
    }
    assert len(keys) == 2


def _fails_when_frozen(gm: torch.fx.GraphModule, inputs: object, **options: object) -> object:
    """A backend that runs the traced graph as it is, but fails a graph with
    frozen weights (the only one compiled with options)."""
    if options:
        raise RuntimeError("no C++ GEMM here")
    return gm.forward


def test_a_frozen_graph_that_fails_falls_back_to_the_plain_graphs(
    tiny_model: ModelSource,
    pair: tuple[TransformersEngine, TransformersEngine],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(
        torch_engine,
        "CompiledStep",
        functools.partial(CompiledStep, backend=_fails_when_frozen),
    )
    engine = TransformersEngine(tiny_model, dtype="bfloat16", compile="on", compile_max_batch=2)
    step = engine.compiled_step
    assert step is not None
    assert step.frozen
    engine._compiled_prefill = None  # prefills eagerly: only the step is under test
    prompts = {slot: [int(t) for t in range(3 + slot, 40 + slot)] for slot in range(2)}
    with caplog.at_level(logging.WARNING, logger="sluiceway.engines.torch_compiled"):
        _forced_schedule((engine, pair[1]), prompts, {0: [0], 1: [1]}, {}, steps=4)
    engine.close()
    assert "frozen weights failed, compiling it without" in caplog.text
    assert "no C++ GEMM here" in caplog.text
    assert not step.frozen
    assert step.failure is None  # the plain graphs took over
    assert step.steps[1] >= 1
    assert step.steps[2] >= 3
