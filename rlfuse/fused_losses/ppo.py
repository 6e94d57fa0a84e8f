"""Fused PPO family (GRPO, DAPO, Dr. GRPO, GSPO): the surrogate kernels with PPO's region."""
from __future__ import annotations

from typing import Optional

import torch

from .. import reference
from ..api.args import check_ppo_args
from .._dispatch import falls_back_to
from .._types import LossOutput
from .surrogate import surrogate_family_loss


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
    return surrogate_family_loss(policy, old_logprobs, args, agg, validate=validate,
                                 ratio=ratio_level)
