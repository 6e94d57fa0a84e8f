"""Which implementation a call runs: Triton kernels or the plain-torch reference."""
from __future__ import annotations

import torch

try:
    from .kernels.utils import INTERPRET
    HAVE_TRITON = True
except ImportError:  # a platform without triton: the reference still works
    INTERPRET = False
    HAVE_TRITON = False


def use_kernels(device: torch.device) -> bool:
    """CUDA tensors run the kernels; CPU tensors too when ``TRITON_INTERPRET=1`` was set before
    rlfuse was imported (the Triton interpreter); anything else falls back to the reference."""
    if not HAVE_TRITON:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and INTERPRET
