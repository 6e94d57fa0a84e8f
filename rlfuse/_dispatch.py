"""Which implementation a call runs: the Triton kernels or the plain-torch reference."""
from __future__ import annotations

import importlib.util
import inspect
import os
from typing import Callable, Optional, Union

import torch

from .checks.policy import matmul_head, policy_device
from .scaleout.dtensor import local_policy

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


def autocast_dtype(device: torch.device) -> Optional[torch.dtype]:
    """The dtype ``torch.autocast`` casts to on ``device``'s type, None when it is off."""
    kind = device.type
    if not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)


def falls_back_to(reference_fn: Callable) -> Callable:
    """Declares a public fused function's reference twin.

    The decorated function is the kernel path only. The public function forwards every call,
    unchanged, to ``reference_fn`` when the kernels do not run on the device of its first
    argument (a policy, logits or log-probs; anything else goes to the reference, whose checks
    name what was expected), a policy holding DTensors first made of its local tensors
    (``scaleout.dtensor``). The two must have the same signature (checked here, at import)
    and share the reference's docstring, written once.
    """
    def declare(kernel_fn: Callable) -> Callable:
        signature = inspect.signature(kernel_fn)
        if signature != inspect.signature(reference_fn):
            raise TypeError(f"{kernel_fn.__name__}: signature {signature} differs from its "
                            f"reference twin's {inspect.signature(reference_fn)}")
        first = next(iter(signature.parameters))

        def with_policy(policy, args, kwargs):
            return ((policy,) + args[1:], kwargs) if args else \
                ((), dict(kwargs, **{first: policy}))

        def public(*args, **kwargs):
            policy = local_policy(args[0] if args else kwargs.get(first))
            args, kwargs = with_policy(policy, args, kwargs)
            device = policy_device(policy)
            if device is None or not use_kernels(device):
                return reference_fn(*args, **kwargs)
            dtype = autocast_dtype(device)
            # a head's matmuls in its head_dtype, else in autocast's dtype (as autocast runs a
            # linear layer); the kernels' own precision (fp32 accumulation) for the rest
            args, kwargs = with_policy(matmul_head(policy, dtype), args, kwargs)
            if dtype is None:
                return kernel_fn(*args, **kwargs)
            with torch.autocast(device.type, enabled=False):
                return kernel_fn(*args, **kwargs)

        public.__name__, public.__qualname__ = kernel_fn.__name__, kernel_fn.__qualname__
        public.__module__ = kernel_fn.__module__
        public.__doc__ = reference_fn.__doc__
        public.__signature__ = signature
        public.reference = reference_fn
        return public

    return declare
