"""``torch.nn.Module`` forms of the losses, holding their hyper-parameters."""
from __future__ import annotations

from typing import Optional

import torch

from ._dispatch import ggpo_loss, gppo_loss, gr_opd_loss, ppo_loss
from ._types import LossOutput


class GGPOLoss(torch.nn.Module):
    """``ggpo_loss`` with its hyper-parameters held by the module."""

    def __init__(self, *, group_size: int, beta: float, clip_radius: Optional[float] = None,
                 loss_scale: float = 1.0, validate: bool = True):
        super().__init__()
        self.kwargs = dict(group_size=group_size, beta=beta, clip_radius=clip_radius,
                           loss_scale=loss_scale, validate=validate)

    def forward(self, policy, ref_logprobs, rewards, mask, *, num_tokens=None) -> LossOutput:
        return ggpo_loss(policy, ref_logprobs, rewards, mask, num_tokens=num_tokens,
                         **self.kwargs)


class GPPOLoss(torch.nn.Module):
    """``gppo_loss`` with its hyper-parameters held by the module."""

    def __init__(self, *, geometry: str = "chi2", topology: str = "atomic", delta=0.04,
                 agg: str = "token-mean", dual_clip: Optional[float] = None,
                 loss_scale: float = 1.0, validate: bool = True):
        super().__init__()
        self.kwargs = dict(geometry=geometry, topology=topology, delta=delta, agg=agg,
                           dual_clip=dual_clip, loss_scale=loss_scale, validate=validate)

    def forward(self, policy, old_logprobs, advantages, mask, *, weights=None, num_tokens=None,
                num_sequences=None) -> LossOutput:
        return gppo_loss(policy, old_logprobs, advantages, mask, weights=weights,
                         num_tokens=num_tokens, num_sequences=num_sequences, **self.kwargs)


class GROPDLoss(torch.nn.Module):
    """``gr_opd_loss`` with its hyper-parameters held by the module."""

    def __init__(self, *, group_size: int, gamma: float = 0.99, lam: float = 0.25,
                 eps: float = 0.2, feedback_clip: float = 5.0, adv_clip: float = 5.0,
                 std_eps: float = 1e-6, loss_scale: float = 1.0, validate: bool = True):
        super().__init__()
        self.kwargs = dict(group_size=group_size, gamma=gamma, lam=lam, eps=eps,
                           feedback_clip=feedback_clip, adv_clip=adv_clip, std_eps=std_eps,
                           loss_scale=loss_scale, validate=validate)

    def forward(self, policy, old_logprobs, teacher_logprobs, mask, *, advantages=None,
                num_sequences=None) -> LossOutput:
        return gr_opd_loss(policy, old_logprobs, teacher_logprobs, mask, advantages=advantages,
                           num_sequences=num_sequences, **self.kwargs)


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
