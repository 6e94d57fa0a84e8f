"""How rlfuse registers its custom ops (``torch.ops.rlfuse.<name>``).

Triton launches a kernel on the *current* CUDA device, not on its tensors' device: a call on
``cuda:1`` tensors while ``cuda:0`` is current would run on device 0 with device-1 pointers.
Every kernel launch happens inside an op's implementation, and every implementation runs here
under the device of its first tensor argument: the one place that guards them all.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, Sequence

import torch


def device_guard(device: torch.device):
    """The context a launch on ``device`` runs in: that CUDA device made current."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def custom_op(name: str, *, mutates_args: Sequence[str] = ()) -> Callable:
    """``torch.library.custom_op("rlfuse::<name>")`` over an implementation that runs under
    ``device_guard`` of its first tensor argument."""
    def register(impl: Callable):
        @functools.wraps(impl)
        def on_its_device(*args, **kwargs):
            device = next(a.device for a in (*args, *kwargs.values())
                          if isinstance(a, torch.Tensor))
            with device_guard(device):
                return impl(*args, **kwargs)

        schema = torch.library.infer_schema(impl, mutates_args=tuple(mutates_args))
        return torch.library.custom_op(f"rlfuse::{name}", on_its_device,
                                       mutates_args=tuple(mutates_args), schema=schema)

    return register
