"""Linear layers whose weights are reordered once, at load, for oneDNN.

On a CPU, torch computes a bfloat16 linear layer with oneDNN, which first
reorders the weight matrix into its blocked layout, on every call. The
reorder is a pass over the whole matrix: for a decode step's few rows it
costs as much as the product. vLLM's CPU backend and Inductor's ``freezing``
keep the weights in the blocked layout instead; so does
:class:`PackedLinear`, whose weight is reordered once, when the model loads,
and replaces the plain one (no second copy).

Measured on the 2-core development host (AVX512-BF16 and AMX), each call
on its own: a 1536x512 layer took 64 against 33 µs for one row, 126
against 74 µs for 64; the engine's eager decode step of the 42M benchmark
model was 1.11-1.15x faster at batch 1 to 64, its prefill 1.04-1.17x
(docs/engines.md). The product itself is oneDNN's same kernel, so the
outputs are the plain layer's, bit for bit, on that host.

Inside ``torch.compile`` the call goes through a custom op
(``sluiceway::packed_linear``): Inductor cannot lower oneDNN's op on a
weight it did not pack itself, and calls the custom op as an opaque kernel.
A graph that freezes its weights instead (the compiled decode step's, see
:mod:`~sluiceway.engines.torch_compiled`) needs the matrix as loaded, to pack
for its own kernels: a layer built with ``keep_plain`` keeps it too, and
inside :func:`frozen_graph` a traced layer uses it.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)


@torch.library.custom_op("sluiceway::packed_linear", mutates_args=())
def packed_linear(
    inputs: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, features: int
) -> torch.Tensor:
    """``inputs @ weight.T + bias``, ``weight`` held reordered in ``packed``."""
    return _product(inputs, packed, bias)


@packed_linear.register_fake
def _packed_linear_shape(
    inputs: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, features: int
) -> torch.Tensor:
    return inputs.new_empty((*inputs.shape[:-1], features))


def _product(inputs: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    result: torch.Tensor = torch.ops.mkldnn._linear_pointwise(inputs, packed, bias, "none", [], "")
    return result


#: Whether the graph being traced freezes its weights (:func:`frozen_graph`).
_FROZEN_GRAPH = False


@contextlib.contextmanager
def frozen_graph() -> Iterator[None]:
    """Around a call of a graph that freezes its weights: Inductor's
    ``freezing`` is on (Dynamo reads it while tracing, before a compile's own
    options apply), and a layer traced in it multiplies by its matrix as
    loaded (Dynamo guards on this flag, so a graph traced with it and one
    traced without each keep their own form)."""
    global _FROZEN_GRAPH
    before, _FROZEN_GRAPH = _FROZEN_GRAPH, True
    try:
        with torch._inductor.config.patch(freezing=True):
            yield
    finally:
        _FROZEN_GRAPH = before


class PackedLinear(torch.nn.Module):
    """A :class:`torch.nn.Linear` whose weight oneDNN reordered once; with
    ``keep_plain``, the matrix as loaded stays beside it, for graphs that
    freeze their weights."""

    def __init__(self, linear: torch.nn.Linear, *, keep_plain: bool = False) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        # A buffer, not a parameter: its values are in oneDNN's layout, not a
        # matrix anyone else may read.
        self.packed: torch.Tensor
        self.register_buffer("packed", packed)
        self.bias: torch.Tensor | None = linear.bias
        self.weight: torch.Tensor | None = linear.weight if keep_plain else None

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            if _FROZEN_GRAPH and self.weight is not None:
                return torch.nn.functional.linear(inputs, self.weight, self.bias)
            result: torch.Tensor = packed_linear(inputs, self.packed, self.bias, self.out_features)
            return result
        return _product(inputs, self.packed, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, prepacked"


def unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why weights on ``device`` in ``dtype`` are not prepacked; None: they are."""
    if device.type != "cpu":
        return f"the device is {device.type}, not the CPU"
    if dtype != torch.bfloat16:
        # float32 measured no faster at one row (MKL's own GEMV wins there).
        return f"the weights are {str(dtype).removeprefix('torch.')}, not bfloat16"
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return "this torch build has no oneDNN"
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "oneDNN has no bfloat16 kernels for this CPU"
    return None


def prepack_linears(model: torch.nn.Module, *, keep_plain: bool = False) -> int:
    """Replace each plain bfloat16 linear layer of ``model`` with a
    :class:`PackedLinear` (``keep_plain``: keeping its matrix as loaded);
    returns how many. A layer whose weight another module shares (an output
    layer tied to the embeddings) stays as it is: packing it would keep a
    second copy of the matrix."""
    shared = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear or child.weight.dtype != torch.bfloat16:
                continue
            if shared[id(child.weight)] > 1:
                continue
            setattr(parent, name, PackedLinear(child, keep_plain=keep_plain))
            replaced += 1
    return replaced


def linear_bytes(model: torch.nn.Module) -> int:
    """Bytes of the matrices of ``model``'s linear layers (plain or packed,
    counted as loaded): what each graph that freezes its weights adds."""
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear | PackedLinear):
            total += module.in_features * module.out_features * _itemsize(module)
    return total


def _itemsize(module: torch.nn.Linear | PackedLinear) -> int:
    weight = module.packed if isinstance(module, PackedLinear) else module.weight
    return weight.element_size()
