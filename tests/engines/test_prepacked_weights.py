"""Linear layers prepacked for oneDNN (``--prepack``, the transformers engine
on the CPU in bfloat16): the same products as the plain layers, eagerly and
compiled, and an engine that decodes as one with its weights as loaded.

On this host torch's own bfloat16 product is oneDNN's kernel, so the tests
ask for equality, bit for bit; a host where they are not equal runs a
different kernel for one of the two, which is worth knowing.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from sluiceway.engines.loader import ModelSource
from sluiceway.engines.torch_engine import TransformersEngine
from sluiceway.engines.torch_prepack import PackedLinear, prepack_linears, unsupported
from tests.engines.helpers import run_schedule

CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(
    unsupported(CPU, torch.bfloat16) is not None,
    reason=f"no prepacked bfloat16 here: {unsupported(CPU, torch.bfloat16)}",
)


def _linear(inputs: int, outputs: int, *, bias: bool, seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(inputs, outputs, bias=bias, dtype=torch.bfloat16)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("inputs", "outputs"), [(64, 96), (96, 40), (512, 1536)])
def test_a_packed_layer_gives_the_plain_layers_products(
    inputs: int, outputs: int, bias: bool
) -> None:
    plain = _linear(inputs, outputs, bias=bias, seed=inputs + outputs)
    packed = PackedLinear(plain)
    assert not any(name == "weight" for name, _ in packed.named_parameters())
    generator = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for shape in [(1, inputs), (1, 1, inputs), (7, 1, inputs), (1, 33, inputs), (130, inputs)]:
            rows = torch.randn(shape, generator=generator).to(torch.bfloat16)
            assert torch.equal(packed(rows), plain(rows)), shape


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_compiled_graph_calls_the_packed_product(backend: str) -> None:
    plain = _linear(64, 96, bias=True, seed=5)
    packed = PackedLinear(plain)

    def layer(rows: torch.Tensor) -> torch.Tensor:
        # The view depends on the shape the graph was told (the fake's).
        return torch.nn.functional.silu(packed(rows)).view(4, 96)

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=backend, fullgraph=True, dynamic=False)
    rows = torch.randn(4, 1, 64).to(torch.bfloat16)
    with torch.inference_mode():
        expected = torch.nn.functional.silu(plain(rows)).view(4, 96)
        torch.testing.assert_close(compiled(rows), expected, rtol=0.02, atol=0.02)


class _Tied(torch.nn.Module):
    """An embedding, a plain layer, a float32 layer, a subclass of Linear and
    an output layer that shares the embedding's matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16, dtype=torch.bfloat16)
        self.inner = torch.nn.Linear(16, 16, dtype=torch.bfloat16)
        self.wide = torch.nn.Linear(16, 16, dtype=torch.float32)
        self.special = _Special(16, 16, dtype=torch.bfloat16)
        self.head = torch.nn.Linear(16, 50, bias=False, dtype=torch.bfloat16)
        self.head.weight = self.embed.weight


class _Special(torch.nn.Linear):
    pass


def test_only_plain_untied_bfloat16_layers_are_packed() -> None:
    model = _Tied()
    assert prepack_linears(model) == 1
    assert isinstance(model.inner, PackedLinear)
    assert type(model.wide) is torch.nn.Linear
    assert type(model.special) is _Special
    assert type(model.head) is torch.nn.Linear
    assert model.head.weight is model.embed.weight


def test_weights_are_packed_only_on_a_cpu_in_bfloat16() -> None:
    assert unsupported(CPU, torch.bfloat16) is None
    assert "float32" in (unsupported(CPU, torch.float32) or "")
    assert "cuda" in (unsupported(torch.device("cuda"), torch.bfloat16) or "")


@pytest.fixture(scope="module")
def pair(tiny_model: ModelSource) -> Iterator[tuple[TransformersEngine, TransformersEngine]]:
    engines = (
        TransformersEngine(tiny_model, dtype="bfloat16"),
        TransformersEngine(tiny_model, dtype="bfloat16", prepack=False),
    )
    yield engines
    for engine in engines:
        engine.close()


def _packed_layers(engine: TransformersEngine) -> int:
    return sum(isinstance(module, PackedLinear) for module in engine._model.modules())


def test_the_engine_prepacks_unless_told_not_to(
    pair: tuple[TransformersEngine, TransformersEngine],
) -> None:
    packed, plain = pair
    layers = sum(isinstance(module, torch.nn.Linear) for module in plain._model.modules())
    assert layers > 0
    assert _packed_layers(packed) == layers
    assert _packed_layers(plain) == 0


def test_a_prepacked_engine_decodes_as_the_plain_one(
    pair: tuple[TransformersEngine, TransformersEngine],
) -> None:
    rng = np.random.default_rng(11)
    prompts = {slot: [int(t) for t in rng.integers(3, 500, 5 + 9 * slot)] for slot in range(4)}
    joins = {0: [0, 1], 3: [2], 5: [3]}
    leaves = {6: [1]}
    runs = [run_schedule(engine, prompts, joins, leaves, steps=12) for engine in pair]
    assert len(runs[0]) == len(runs[1]) == 4
    for (slot, got), (other, want) in zip(*runs, strict=True):
        assert slot == other
        assert got.tokens == want.tokens, slot
        for step, (a, b) in enumerate(zip(got.logprobs, want.logprobs, strict=True)):
            assert np.array_equal(a, b), (slot, step)


def test_a_packed_pass_of_a_prepacked_engine_equals_the_plain_ones(
    pair: tuple[TransformersEngine, TransformersEngine],
) -> None:
    outcomes = []
    for engine in pair:
        first = int(np.argmax(engine.prefill(0, [5, 6, 7, 8])[-1]))
        engine.decode({0: first})
        decoded, chunks = engine.decode_prefilling({0: first}, [(1, [9, 10, 11]), (2, [12])])
        outcomes.append((decoded.logits, list(chunks)))
        for slot in (0, 1, 2):
            engine.free(slot)
    (decoded_a, chunks_a), (decoded_b, chunks_b) = outcomes
    assert np.array_equal(decoded_a, decoded_b)
    assert all(np.array_equal(a, b) for a, b in zip(chunks_a, chunks_b, strict=True))
