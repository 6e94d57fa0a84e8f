"""A head's logit scale and softcap in plain torch: what a ``LinearHead`` puts after its matmul
(the reference's head, the scaled target logit of a split vocabulary, a model's own head
checked by the integrations)."""
from __future__ import annotations

from typing import Optional

import torch

from .._types import compute_dtype


def scaled_logits(x: torch.Tensor, logit_scale: float, softcap: Optional[float]) -> torch.Tensor:
    """``softcap(logit_scale x)`` with ``softcap(y) = cap tanh(y / cap)`` (None: none) in the
    compute dtype: what a ``LinearHead`` puts after its matmul, before the temperature."""
    x = x.to(compute_dtype(x.dtype))
    if logit_scale != 1.0:
        x = x * logit_scale
    if softcap is not None:
        x = torch.tanh(x / softcap) * softcap
    return x
