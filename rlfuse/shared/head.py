"""A head in plain torch: its logit scale and softcap, what a ``LinearHead`` puts after its
matmul (the reference's head, the scaled target logit of a split vocabulary, a model's own head
checked by the integrations), and its matmul row by row (a batch-invariant head's)."""
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


def linear_row_by_row(hidden: torch.Tensor, weight: torch.Tensor,
                      bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``hidden @ weight.T + bias`` with each row's logits by its own matmul: its bits its own,
    whatever the other rows (a batch-invariant head's definition)."""
    rows = hidden.reshape(-1, hidden.shape[-1]).split(1)
    logits = torch.cat([torch.nn.functional.linear(row, weight, bias) for row in rows])
    return logits.view(*hidden.shape[:-1], weight.shape[0])
