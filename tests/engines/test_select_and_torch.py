"""Engine selection, and what is particular to the transformers engine."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

from sluiceway.engines import torch_engine
from sluiceway.engines.device import resolve_device
from sluiceway.engines.loader import ModelSource
from sluiceway.engines.mlx_engine import MlxEngine
from sluiceway.engines.select import (
    choose_engine,
    in_child_process_by_default,
    make_engine,
)
from sluiceway.engines.torch_engine import (
    KVRows,
    LayerLayout,
    TransformersEngine,
    _attention,
    _full_attention_only,
    cpu_has_bfloat16,
    resolve_dtype,
    set_threads,
)
from tests.engines.helpers import LOGPROB_TOLERANCES, greedy_alone
from tests.engines.test_parity import PROMPTS


def test_auto_prefers_torch_on_a_cpu_only_linux_host(caplog: pytest.LogCaptureFixture) -> None:
    import mlx.core as mx

    if mx.metal.is_available():
        pytest.skip("this host has a Metal GPU, where auto picks mlx")
    with caplog.at_level(logging.INFO, logger="sluiceway.engines.select"):
        assert choose_engine("auto") == "transformers"
    assert "auto" in caplog.text


def test_engines_on_the_cpu_run_in_a_child_process_by_default() -> None:
    import mlx.core as mx
    import torch

    assert in_child_process_by_default("mlx") is not mx.metal.is_available()
    assert in_child_process_by_default("transformers", "cpu")
    assert not in_child_process_by_default("transformers", "cuda:1")
    on_gpu = torch.cuda.is_available()
    assert in_child_process_by_default("transformers", "auto") is not on_gpu


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


def test_auto_dtype_on_the_cpu_is_bfloat16_where_the_cpu_computes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cpu = torch.device("cpu")
    for native, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(torch_engine, "cpu_has_bfloat16", lambda native=native: native)
        for saved in ("bfloat16", "float16", "float32", None):
            assert resolve_dtype("auto", {"torch_dtype": saved}, cpu) == expected
        assert resolve_dtype("float32", {}, cpu) == torch.float32
        assert resolve_dtype("bfloat16", {}, cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="--dtype"):
        resolve_dtype("int8", {}, cpu)


def test_native_bfloat16_is_read_from_the_cpu_flags() -> None:
    assert cpu_has_bfloat16("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 sse\n")
    assert cpu_has_bfloat16("flags : fpu amx_bf16 amx_tile\n")
    assert not cpu_has_bfloat16("flags : fpu avx512f avx512bw avx512_vnni\n")
    assert not cpu_has_bfloat16("processor : 0\n")


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
    error = float(np.max(np.abs(np.stack(got.logprobs) - np.stack(want.logprobs))))
    assert error < LOGPROB_TOLERANCES["bfloat16"]


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


def test_only_full_attention_models_get_ready_decode_masks() -> None:
    from transformers import Gemma2Config, MistralConfig, Qwen3Config

    assert _full_attention_only(Qwen3Config())
    assert not _full_attention_only(MistralConfig())  # sliding_window, no layer_types
    assert not _full_attention_only(Gemma2Config())  # sliding layers among full ones
    layouts = [LayerLayout(keys=(2, 4), values=(2, 4), dtype=torch.float32)]
    for ready, dims in ((True, 4), (False, 2)):
        rows = KVRows(layouts, torch.device("cpu"), ready_masks=ready)
        rows.open_row()
        rows.advance(1)
        rows.open_row()  # an empty row beside a one-token row: padding
        _, mask = rows.inputs(1)
        assert mask is not None
        assert mask.dim() == dims
        _, longer = rows.inputs(3)  # only decode steps get the 4D mask
        assert longer is not None
        assert longer.dim() == 2


def test_masked_decode_attention_matches_transformers_sdpa() -> None:
    """The grouped-query kernel with a padding mask, against the query-folding
    path transformers takes: the same attention within float32 rounding."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    generator = torch.Generator().manual_seed(0)
    rows, heads, groups, window, dim = 5, 8, 4, 37, 16
    query = torch.randn(rows, heads, 1, dim, generator=generator)
    keys = torch.randn(rows, heads // groups, window, dim, generator=generator)
    values = torch.randn(rows, heads // groups, window, dim, generator=generator)
    first = torch.tensor([0, 3, 36, 10, 1])
    mask = torch.zeros(rows, 1, 1, window)
    mask.masked_fill_(torch.arange(window)[None, None, None, :] < first[:, None, None, None], -1e9)
    module = torch.nn.Module()
    module.num_key_value_groups = groups  # type: ignore[assignment]
    module.is_causal = True  # type: ignore[assignment]
    for given in (mask, None):
        ours, _ = _attention(module, query, keys, values, given, scaling=0.25)
        theirs, _ = sdpa_attention_forward(module, query, keys, values, given, scaling=0.25)
        assert ours.shape == theirs.shape == (rows, 1, heads, dim)
        assert torch.allclose(ours, theirs, atol=1e-5)


def test_the_cpu_engine_uses_its_own_attention(tiny_model: ModelSource) -> None:
    engine = TransformersEngine(tiny_model, device="cpu", dtype="float32")
    assert engine._model.config._attn_implementation == "sluiceway_sdpa"


@pytest.mark.parametrize("keep_bytes", [2**40, 0])
def test_an_emptied_batch_is_reused_up_to_a_size_and_leaks_nothing(
    tiny_model: ModelSource, monkeypatch: pytest.MonkeyPatch, keep_bytes: int
) -> None:
    """A long request leaves the batch; a short one joins the buffers it
    left (or fresh ones, over the size kept) and decodes as if alone."""
    monkeypatch.setattr(torch_engine, "KEEP_IDLE_BATCH_BYTES", keep_bytes)
    engine = TransformersEngine(tiny_model, device="cpu", dtype="float32")
    long_prompt, short_prompt = PROMPTS["long"], PROMPTS["short"]
    token = int(engine.prefill(0, long_prompt)[-1].argmax())
    for _ in range(3):
        token = int(engine.decode({0: token}).logits[0].argmax())
    left_behind = engine._batch
    engine.free(0)
    assert (engine._batch is left_behind) == (keep_bytes > 0)
    first = int(engine.prefill(1, short_prompt)[-1].argmax())
    steps = [engine.decode({1: first}).logits[0]]
    steps.append(engine.decode({1: int(steps[0].argmax())}).logits[0])
    # The window started afresh: it does not creep right request after request.
    assert engine._batch is not None
    assert engine._batch.end == len(short_prompt) + 2
    alone = TransformersEngine(tiny_model, device="cpu", dtype="float32")
    alone.prefill(1, short_prompt)
    expected = [alone.decode({1: first}).logits[0]]
    expected.append(alone.decode({1: int(expected[0].argmax())}).logits[0])
    np.testing.assert_allclose(np.stack(steps), np.stack(expected), atol=1e-5)


def test_engine_threads_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--engine-threads`` first, then ``OMP_NUM_THREADS``, then every core."""
    before = torch.get_num_threads()
    cpu = torch.device("cpu")
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert set_threads(cpu, 1) == 1
        assert set_threads(cpu) == 2
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert set_threads(cpu) == len(os.sched_getaffinity(0))
    finally:
        torch.set_num_threads(before)


def test_a_transformers_engine_reports_its_threads(tiny_model: ModelSource) -> None:
    before = torch.get_num_threads()
    engine = TransformersEngine(tiny_model, device="cpu", dtype="float32", threads=1)
    try:
        assert engine.info.threads == 1
    finally:
        engine.close()
        torch.set_num_threads(before)


def test_the_thread_count_changes_no_logit(tiny_model: ModelSource) -> None:
    """The engine's child process changes torch's thread count between
    steps (``ThreadTuner``); a stream must come out the same whichever count
    computed each step, so the logits must not move by a bit."""
    before = torch.get_num_threads()
    engine = TransformersEngine(tiny_model, device="cpu", dtype="float32", threads=2)
    prompt = [int(t) for t in np.arange(3, 60) % 200]
    try:
        prefilled = []
        for slot, threads in ((0, 2), (1, 1)):
            engine.set_threads(threads)
            assert torch.get_num_threads() == threads
            prefilled.append(engine.prefill(slot, prompt))
        assert np.array_equal(prefilled[0], prefilled[1])
        decoded = []
        for threads in (2, 1):
            engine.set_threads(threads)
            decoded.append(engine.decode({0: 7, 1: 9}).logits)
            engine.undo_decode()
        assert np.array_equal(decoded[0], decoded[1])
    finally:
        engine.close()
        torch.set_num_threads(before)


def test_a_daemonic_worker_keeps_the_engine_on_its_thread(
    tiny_model: ModelSource, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Hypercorn's own command runs the app in a daemonic process, which
    multiprocessing forbids to start children: the default falls back to
    the engine thread, and an explicit ``--engine-process`` says why it
    cannot be."""
    import multiprocessing
    from types import SimpleNamespace

    from sluiceway.server import runtime
    from sluiceway.server.config import ServerConfig

    monkeypatch.setattr(multiprocessing, "current_process", lambda: SimpleNamespace(daemon=True))
    asked = ServerConfig(engine="transformers", device="cpu", engine_process=True)
    with pytest.raises(RuntimeError, match="daemonic"):
        runtime._start_engine(asked, tiny_model)
    before = torch.get_num_threads()
    with caplog.at_level(logging.INFO, logger="sluiceway.server.runtime"):
        engine = runtime._start_engine(
            ServerConfig(engine="transformers", device="cpu", compile="off"), tiny_model
        )
    try:
        assert isinstance(engine, TransformersEngine)
        assert "daemonic worker" in caplog.text
    finally:
        engine.close()
        torch.set_num_threads(before)


def test_only_an_engine_given_no_thread_count_is_tunable(
    tiny_model: ModelSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--engine-threads`` and ``OMP_NUM_THREADS`` are the user's choice;
    the child process tunes only when neither says one and there are 2
    threads or more to choose from."""
    before = torch.get_num_threads()

    def tunable(threads: int = 0) -> bool:
        engine = TransformersEngine(tiny_model, device="cpu", dtype="float32", threads=threads)
        try:
            return engine.tunable
        finally:
            engine.close()

    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr(torch_engine, "_usable_cpus", lambda: 2)
        assert tunable()
        assert not tunable(threads=2)
        monkeypatch.setattr(torch_engine, "_usable_cpus", lambda: 1)
        assert not tunable()
        monkeypatch.setattr(torch_engine, "_usable_cpus", lambda: 2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert not tunable()
    finally:
        torch.set_num_threads(before)
