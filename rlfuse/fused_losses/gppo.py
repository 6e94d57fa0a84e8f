"""Fused GPPO: the bounds op, the loss (from log-probs or in one pass from logits) and the
nn.Module."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import reference
from .._contract import aggregation_weights, check_bounds_args, check_gppo_args
from .._dispatch import falls_back_to
from .._types import LossOutput, compute_dtype
from ._op import custom_op
from .surrogate import surrogate_loss


@custom_op("gppo_bounds")
def gppo_bounds_op(old_logprobs: Tensor, geometry: str, topology: str,
                   delta: float) -> Tuple[Tensor, Tensor]:
    from ..kernels.gppo import gppo_bounds_kernel

    return gppo_bounds_kernel(old_logprobs, geometry, topology, delta)


@gppo_bounds_op.register_fake
def _(old_logprobs, geometry, topology, delta):
    out = compute_dtype(old_logprobs.dtype)
    return (old_logprobs.new_empty(old_logprobs.shape, dtype=out),
            old_logprobs.new_empty(old_logprobs.shape, dtype=out))


@falls_back_to(reference.gppo_bounds)
def gppo_bounds(old_logprobs: torch.Tensor, *, geometry: str, topology: str,
                delta: float) -> Tuple[torch.Tensor, torch.Tensor]:
    delta = check_bounds_args(old_logprobs, geometry, topology, delta)
    return gppo_bounds_op(old_logprobs.detach(), geometry, topology, delta)


def surrogate_metrics(totals, tokens: Tensor):
    """GPPO's metrics from the surrogate's column totals."""
    tokens = tokens.clamp_min(1)
    return {
        "clip_frac_low": totals["clip_low"] / tokens,
        "clip_frac_high": totals["clip_high"] / tokens,
        "ratio_mean": totals["ratio"] / tokens,
        "approx_kl": totals["neg_log_ratio"] / tokens,
        "overflow": (totals["overflow"] > 0).to(tokens.dtype),
    }


@falls_back_to(reference.gppo_loss)
def gppo_loss(policy, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              *, geometry: str = "chi2", topology: str = "atomic", delta: float = 0.04,
              agg: str = "token-mean", loss_scale: float = 1.0,
              num_tokens: Optional[float] = None, num_sequences: Optional[float] = None,
              validate: bool = True) -> LossOutput:
    info, mask, delta, loss_scale, num_tokens, num_sequences = check_gppo_args(
        policy, old_logprobs, advantages, mask, geometry=geometry, topology=topology, delta=delta,
        agg=agg, loss_scale=loss_scale, num_tokens=num_tokens, num_sequences=num_sequences,
        validate=validate)
    weights = loss_scale * aggregation_weights(mask, agg, info.compute_dtype,
                                               num_tokens=num_tokens,
                                               num_sequences=num_sequences)
    loss, totals = surrogate_loss(policy, old_logprobs.detach(), advantages.detach(), mask,
                                  weights, geometry=geometry, topology=topology, delta=delta,
                                  validate=validate)
    return LossOutput(loss, surrogate_metrics(totals, mask.sum().to(info.compute_dtype)))


class GPPOLoss(torch.nn.Module):
    """``gppo_loss`` with its hyper-parameters held by the module."""

    def __init__(self, *, geometry: str = "chi2", topology: str = "atomic", delta: float = 0.04,
                 agg: str = "token-mean", loss_scale: float = 1.0, validate: bool = True):
        super().__init__()
        self.geometry, self.topology, self.delta, self.agg = geometry, topology, delta, agg
        self.loss_scale, self.validate = loss_scale, validate

    def forward(self, policy, old_logprobs, advantages, mask, *, num_tokens=None,
                num_sequences=None) -> LossOutput:
        return gppo_loss(policy, old_logprobs, advantages, mask, geometry=self.geometry,
                         topology=self.topology, delta=self.delta, agg=self.agg,
                         loss_scale=self.loss_scale, num_tokens=num_tokens,
                         num_sequences=num_sequences, validate=self.validate)
