"""Fused PPO family (GRPO, DAPO, Dr. GRPO, GSPO): GPPO's kernels with PPO's region, the
functional API and the nn.Module."""
from __future__ import annotations

from typing import Optional

import torch

from .. import reference
from .._contract import check_ppo_args
from .._dispatch import falls_back_to
from .._types import LossOutput
from .gppo import run_surrogate
from .surrogate import Region


@falls_back_to(reference.ppo_loss)
def ppo_loss(policy, old_logprobs: Optional[torch.Tensor], advantages: torch.Tensor,
             mask: torch.Tensor, *, clip=0.2, dual_clip: Optional[float] = None,
             ratio_level: str = "token", agg: str = "token-mean",
             weights: Optional[torch.Tensor] = None, loss_scale: float = 1.0,
             num_tokens: Optional[float] = None, num_sequences: Optional[float] = None,
             validate: bool = True) -> LossOutput:
    args = check_ppo_args(
        policy, old_logprobs, advantages, mask, clip=clip, dual_clip=dual_clip,
        ratio_level=ratio_level, agg=agg, weights=weights, loss_scale=loss_scale,
        num_tokens=num_tokens, num_sequences=num_sequences, validate=validate)
    region = Region("ppo_clip", "mc", *args.delta, args.dual_clip)
    return run_surrogate(policy, old_logprobs, args, agg, region, validate=validate,
                         sequence=ratio_level == "sequence")


class PPOLoss(torch.nn.Module):
    """``ppo_loss`` with its hyper-parameters held by the module."""

    def __init__(self, *, clip=0.2, dual_clip: Optional[float] = None,
                 ratio_level: str = "token", agg: str = "token-mean", loss_scale: float = 1.0,
                 validate: bool = True):
        super().__init__()
        self.kwargs = dict(clip=clip, dual_clip=dual_clip, ratio_level=ratio_level, agg=agg,
                           loss_scale=loss_scale, validate=validate)

    def forward(self, policy, old_logprobs, advantages, mask, *, weights=None, num_tokens=None,
                num_sequences=None) -> LossOutput:
        return ppo_loss(policy, old_logprobs, advantages, mask, weights=weights,
                        num_tokens=num_tokens, num_sequences=num_sequences, **self.kwargs)
