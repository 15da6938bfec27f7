"""``--device``: which devices the transformers engine accepts, and the one it runs on.

Its own module so that both :mod:`sluiceway.engines.select` (which builds the
engines) and :mod:`sluiceway.engines.torch_engine` (which is built) can use it
without importing each other. torch is imported only when a device is resolved.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: ``--device`` values: what the transformers engine accepts (``cuda:N`` is
#: the N-th CUDA device). The configuration checks against this one list.
DEVICES = ("auto", "cpu", "cuda", "cuda:N")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device(choice: str) -> str:
    """``choice`` if it is one of :data:`DEVICES` (N a device index)."""
    if not _DEVICE.fullmatch(choice):
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, not {choice!r}")
    return choice


def resolve_device(choice: str) -> torch.device:
    """The transformers engine's device: ``auto`` is CUDA when a GPU is
    visible, else the CPU."""
    import torch

    if check_device(choice) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(choice)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but torch sees no CUDA device")
    return device
