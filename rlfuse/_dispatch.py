"""Which implementation a call runs: the Triton kernels where they run on its tensors' device,
the plain-torch reference elsewhere; and the public functions bound to that choice (what
``rlfuse`` exports)."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import warnings
from typing import NamedTuple, Optional, Union

import torch

from . import api, reference
from .api import Implementation, bind
from .checks.policy import no_dtensor, policy_device

HAVE_TRITON = importlib.util.find_spec("triton") is not None
# `@triton.jit` picks the interpreter when the kernels are decorated, at their import below
# (``kernels.lib.utils.INTERPRET`` records the same decision).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

if HAVE_TRITON:
    from .fused_losses import FUSED
else:  # a platform without Triton: the reference runs every call
    FUSED = None


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


def fallback_reason(device: torch.device) -> Optional[str]:
    """Why a call on ``device`` runs the reference where the kernels were expected — tensors on
    an accelerator, or ``TRITON_INTERPRET=1`` in the environment now — else None (the kernels
    run, or the CPU without the interpreter asked for: the documented reference)."""
    if device.type == "cuda" and not HAVE_TRITON:
        return "CUDA tensors, but triton is not importable (pip install triton)"
    if device.type == "cpu" and not INTERPRET and HAVE_TRITON and \
            os.environ.get("TRITON_INTERPRET") == "1":
        return ("TRITON_INTERPRET=1 was set after rlfuse was imported (set it before Python "
                "starts, or at least before `import rlfuse`)")
    if device.type not in ("cpu", "cuda"):
        return (f"tensors on {device.type}: the kernels run on CUDA devices (and on the CPU "
                f"with TRITON_INTERPRET=1)")
    return None


_WARNED = set()


def warn_fallback(device: torch.device) -> None:
    """A warning, once per reason in a process, where ``fallback_reason`` gives one."""
    reason = fallback_reason(device)
    if reason is not None and reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"rlfuse runs its plain-torch reference, not its fused kernels: {reason}",
                      RuntimeWarning, stacklevel=2)


def autocast_dtype(device: torch.device) -> Optional[torch.dtype]:
    """The dtype ``torch.autocast`` casts to on ``device``'s type, None when it is off."""
    kind = device.type
    if not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)


class Dispatch(NamedTuple):
    """The kernels (``fused``) where they run, else the reference."""

    fused: Optional[Implementation]
    reference: Implementation

    @contextlib.contextmanager
    def on(self, x, *others):
        """``(implementation, x, *others)`` for ``x``, a policy, logits or log-probs (anything
        else goes to the reference, whose checks name what was expected), and policies that go
        with it (a distillation's teacher), each holding DTensors first made of its local
        tensors (``scaleout.dtensor``), a sequence-parallel head of every rank's rows
        (``scaleout.sequence``). On the kernels, a head's matmuls run in its ``head_dtype``,
        else in autocast's dtype (as autocast runs a linear layer), and the rest in the kernels'
        own precision (fp32 accumulation): autocast is off inside."""
        xs = [y.prepared() if hasattr(y, "prepared") else no_dtensor(y) for y in (x, *others)]
        device = policy_device(xs[0])
        if self.fused is None or device is None or not use_kernels(device):
            if device is not None:
                warn_fallback(device)
            yield (self.reference, *xs)
            return
        dtype = autocast_dtype(device)
        xs = [y.for_matmul(dtype) if hasattr(y, "for_matmul") else y for y in xs]
        with contextlib.nullcontext() if dtype is None else \
                torch.autocast(device.type, enabled=False):
            yield (self.fused, *xs)


DISPATCH = Dispatch(FUSED, reference.REFERENCE)

distill_loss = bind(api.distill_loss, DISPATCH)
ggpo_loss = bind(api.ggpo_loss, DISPATCH)
gppo_bounds = bind(api.gppo_bounds, DISPATCH)
gppo_loss = bind(api.gppo_loss, DISPATCH)
gr_opd_advantages = bind(api.gr_opd_advantages, DISPATCH)
gr_opd_loss = bind(api.gr_opd_loss, DISPATCH)
head_logits = bind(api.head_logits, DISPATCH)
kl_penalty = bind(api.kl_penalty, DISPATCH)
policy_logprobs = bind(api.policy_logprobs, DISPATCH)
policy_loss = bind(api.policy_loss, DISPATCH)
ppo_loss = bind(api.ppo_loss, DISPATCH)
token_divergence = bind(api.token_divergence, DISPATCH)
token_logprobs = bind(api.token_logprobs, DISPATCH)
