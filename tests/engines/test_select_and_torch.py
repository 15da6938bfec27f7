"""Engine selection, and what is particular to the transformers engine."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from sluiceway.engines.loader import ModelSource
from sluiceway.engines.mlx_engine import MlxEngine
from sluiceway.engines.select import choose_engine, in_child_process_by_default, make_engine
from sluiceway.engines.torch_engine import TransformersEngine, resolve_device, resolve_dtype
from tests.engines.helpers import greedy_alone


def test_auto_prefers_torch_on_a_cpu_only_linux_host(caplog: pytest.LogCaptureFixture) -> None:
    import mlx.core as mx

    if mx.metal.is_available():
        pytest.skip("this host has a Metal GPU, where auto picks mlx")
    with caplog.at_level(logging.INFO, logger="sluiceway.engines.select"):
        assert choose_engine("auto") == "transformers"
    assert "auto" in caplog.text


def test_only_mlx_on_the_cpu_runs_in_a_child_process_by_default() -> None:
    import mlx.core as mx

    assert not in_child_process_by_default("transformers")
    assert in_child_process_by_default("mlx") is not mx.metal.is_available()


def test_explicit_choices_are_kept_and_unknown_ones_refused() -> None:
    assert choose_engine("mlx") == "mlx"
    assert choose_engine("transformers") == "transformers"
    with pytest.raises(ValueError, match="--engine"):
        choose_engine("vllm")


def test_make_engine_builds_the_named_engine(tiny_model: ModelSource) -> None:
    torch_engine = make_engine("transformers", tiny_model, device="cpu", dtype="float32")
    mlx_engine = make_engine("mlx", tiny_model, device="auto", dtype="auto")
    assert isinstance(torch_engine, TransformersEngine)
    assert isinstance(mlx_engine, MlxEngine)
    assert torch_engine.info.name == "transformers"
    assert (torch_engine.info.device, torch_engine.info.dtype) == ("cpu", "float32")
    assert torch_engine.info.vocab_size == mlx_engine.info.vocab_size == tiny_model.vocab_size


def test_auto_dtype_is_float32_on_the_cpu_whatever_the_checkpoint_says() -> None:
    cpu = torch.device("cpu")
    for saved in ("bfloat16", "float16", "float32", None):
        assert resolve_dtype("auto", {"torch_dtype": saved}, cpu) == torch.float32
    assert resolve_dtype("bfloat16", {}, cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="--dtype"):
        resolve_dtype("int8", {}, cpu)


def test_devices() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="--device"):
        resolve_device("mps")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA"):
            resolve_device("cuda")


def test_cpu_logits_are_handed_over_without_a_copy(tiny_model: ModelSource) -> None:
    engine = TransformersEngine(tiny_model, device="cpu", dtype="float32")
    logits = engine.prefill(0, [1, 2, 3])
    step = engine.decode({0: 4}).logits
    # A NumPy view of the tensor's storage, not a copy of it.
    assert not logits.flags.owndata
    assert not step.flags.owndata
    assert step.flags.c_contiguous


def test_bfloat16_runs_and_stays_close(tiny_model: ModelSource) -> None:
    exact = TransformersEngine(tiny_model, device="cpu", dtype="float32")
    half = TransformersEngine(tiny_model, device="cpu", dtype="bfloat16")
    assert half.info.dtype == "bfloat16"
    prompt = [5, 6, 7, 8, 9]
    assert half.prefill(0, prompt).dtype == np.float32  # upcast for the sampler
    half.free(0)
    want = greedy_alone(exact, prompt, 4)
    got = greedy_alone(half, prompt, 4)
    assert float(np.max(np.abs(got.logprobs[0] - want.logprobs[0]))) < 0.1


def test_torch_engine_refuses_to_overwrite_a_slot(tiny_model: ModelSource) -> None:
    engine = TransformersEngine(tiny_model, device="cpu", dtype="float32")
    engine.prefill(0, [1, 2])
    engine.prefill(1, [3])
    with pytest.raises(ValueError, match="in use"):
        engine.fork(0, 1)
    with pytest.raises(ValueError, match="not a prefilled slot"):
        engine.fork(7, 8)
    engine.decode({0: 4, 1: 5})
    with pytest.raises(ValueError, match="already decoding"):
        engine.prefill(0, [6])
    with pytest.raises(ValueError, match="at least one slot"):
        engine.decode({})
    assert sorted(engine.decode({0: 4, 1: 5}).slots) == [0, 1]
