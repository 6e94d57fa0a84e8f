"""Which implementation a call runs: the Triton kernels or the plain-torch reference."""
from __future__ import annotations

import importlib.util
import inspect
import os
from typing import Callable, Union

import torch

from ._policy import policy_device

HAVE_TRITON = importlib.util.find_spec("triton") is not None
# `@triton.jit` picks the interpreter when the kernels are decorated, at their import right
# after this one (``kernels.utils.INTERPRET`` records the same decision).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_kernels(device: Union[torch.device, str]) -> bool:
    """CUDA tensors run the kernels; CPU tensors too when ``TRITON_INTERPRET=1`` was set before
    rlfuse was imported (the Triton interpreter); anything else falls back to the reference.
    ``device``: a ``torch.device`` or what it accepts (``"cuda"``, ``"cpu"``, ``"cuda:1"``)."""
    device = torch.device(device)
    if not HAVE_TRITON:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and INTERPRET


def falls_back_to(reference_fn: Callable) -> Callable:
    """Declares a public fused function's reference twin.

    The decorated function is the kernel path only. The public function forwards every call,
    unchanged, to ``reference_fn`` when the kernels do not run on the device of its first
    argument (a policy, logits or log-probs; anything else goes to the reference, whose checks
    name what was expected). The two must have the same signature (checked here, at import)
    and share the reference's docstring, written once.
    """
    def declare(kernel_fn: Callable) -> Callable:
        signature = inspect.signature(kernel_fn)
        if signature != inspect.signature(reference_fn):
            raise TypeError(f"{kernel_fn.__name__}: signature {signature} differs from its "
                            f"reference twin's {inspect.signature(reference_fn)}")
        first = next(iter(signature.parameters))

        def public(*args, **kwargs):
            device = policy_device(args[0] if args else kwargs.get(first))
            if device is None or not use_kernels(device):
                return reference_fn(*args, **kwargs)
            return kernel_fn(*args, **kwargs)

        public.__name__, public.__qualname__ = kernel_fn.__name__, kernel_fn.__qualname__
        public.__module__ = kernel_fn.__module__
        public.__doc__ = reference_fn.__doc__
        public.__signature__ = signature
        public.reference = reference_fn
        return public

    return declare
