"""``torch.nn.Module`` forms of the losses: each holds its hyper-parameters as attributes (set
them between steps, e.g. ``module.beta = 0.05``) and passes them, with a batch's tensors, to
its function."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ._dispatch import distill_loss, ggpo_loss, gppo_loss, gr_opd_loss, policy_loss, ppo_loss
from ._types import LossOutput


class _LossModule(torch.nn.Module):
    """A loss function (``loss``) with hyper-parameters held as attributes."""

    loss: Callable

    def __init__(self, **hyper_parameters):
        super().__init__()
        self._hyper_names = tuple(hyper_parameters)
        for name, value in hyper_parameters.items():
            setattr(self, name, value)

    def hyper_parameters(self) -> dict:
        """The module's hyper-parameters, as its function takes them."""
        return {name: getattr(self, name) for name in self._hyper_names}

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={value!r}" for name, value in self.hyper_parameters().items())

    def _loss(self, *args, **batch) -> LossOutput:
        return type(self).loss(*args, **batch, **self.hyper_parameters())


class PolicyLoss(_LossModule):
    """``policy_loss`` with its objective, terms, masks and options held by the module."""

    loss = policy_loss

    def __init__(self, objective="clip", *, agg: Optional[str] = None, kl=None, entropy=None,
                 entropy_mask=None, off_policy_mask=None, loss_scale: float = 1.0,
                 context_parallel_group=None, validate: bool = True):
        super().__init__(objective=objective, agg=agg, kl=kl, entropy=entropy,
                         entropy_mask=entropy_mask, off_policy_mask=off_policy_mask,
                         loss_scale=loss_scale, context_parallel_group=context_parallel_group,
                         validate=validate)

    def forward(self, policy, old_logprobs, advantages, mask, *, weights=None,
                ref_logprobs=None, num_tokens=None, num_sequences=None,
                generator=None) -> LossOutput:
        return self._loss(policy, old_logprobs, advantages, mask, weights=weights,
                          ref_logprobs=ref_logprobs, num_tokens=num_tokens,
                          num_sequences=num_sequences, generator=generator)


class PPOLoss(_LossModule):
    """``ppo_loss`` with its hyper-parameters held by the module."""

    loss = ppo_loss

    def __init__(self, *, clip=0.2, dual_clip: Optional[float] = None,
                 ratio_level: str = "token", agg: str = "token-mean", loss_scale: float = 1.0,
                 context_parallel_group=None, validate: bool = True):
        super().__init__(clip=clip, dual_clip=dual_clip, ratio_level=ratio_level, agg=agg,
                         loss_scale=loss_scale, context_parallel_group=context_parallel_group,
                         validate=validate)

    def forward(self, policy, old_logprobs, advantages, mask, *, weights=None, num_tokens=None,
                num_sequences=None) -> LossOutput:
        return self._loss(policy, old_logprobs, advantages, mask, weights=weights,
                          num_tokens=num_tokens, num_sequences=num_sequences)


class GPPOLoss(_LossModule):
    """``gppo_loss`` with its hyper-parameters held by the module."""

    loss = gppo_loss

    def __init__(self, *, geometry: str = "chi2", topology: str = "atomic", delta=0.04,
                 agg: str = "token-mean", dual_clip: Optional[float] = None,
                 loss_scale: float = 1.0, context_parallel_group=None, validate: bool = True):
        super().__init__(geometry=geometry, topology=topology, delta=delta, agg=agg,
                         dual_clip=dual_clip, loss_scale=loss_scale,
                         context_parallel_group=context_parallel_group, validate=validate)

    def forward(self, policy, old_logprobs, advantages, mask, *, weights=None, num_tokens=None,
                num_sequences=None) -> LossOutput:
        return self._loss(policy, old_logprobs, advantages, mask, weights=weights,
                          num_tokens=num_tokens, num_sequences=num_sequences)


class GGPOLoss(_LossModule):
    """``ggpo_loss`` with its hyper-parameters held by the module."""

    loss = ggpo_loss

    def __init__(self, *, group_size: int, beta: float, clip_radius: Optional[float] = None,
                 loss_scale: float = 1.0, context_parallel_group=None, validate: bool = True):
        super().__init__(group_size=group_size, beta=beta, clip_radius=clip_radius,
                         loss_scale=loss_scale, context_parallel_group=context_parallel_group,
                         validate=validate)

    def forward(self, policy, ref_logprobs, rewards, mask, *, num_tokens=None) -> LossOutput:
        return self._loss(policy, ref_logprobs, rewards, mask, num_tokens=num_tokens)


class GROPDLoss(_LossModule):
    """``gr_opd_loss`` with its hyper-parameters held by the module."""

    loss = gr_opd_loss

    def __init__(self, *, group_size: int, gamma: float = 0.99, lam: float = 0.25,
                 eps: float = 0.2, feedback_clip: float = 5.0, adv_clip: float = 5.0,
                 std_eps: float = 1e-6, loss_scale: float = 1.0, context_parallel_group=None,
                 validate: bool = True):
        super().__init__(group_size=group_size, gamma=gamma, lam=lam, eps=eps,
                         feedback_clip=feedback_clip, adv_clip=adv_clip, std_eps=std_eps,
                         loss_scale=loss_scale, context_parallel_group=context_parallel_group,
                         validate=validate)

    def forward(self, policy, old_logprobs, teacher_logprobs, mask, *, advantages=None,
                num_sequences=None) -> LossOutput:
        return self._loss(policy, old_logprobs, teacher_logprobs, mask, advantages=advantages,
                          num_sequences=num_sequences)


class DistillLoss(_LossModule):
    """``distill_loss`` with its divergence and options held by the module."""

    loss = distill_loss

    def __init__(self, divergence, *, agg: str = "token-mean", loss_scale: float = 1.0,
                 validate: bool = True):
        super().__init__(divergence=divergence, agg=agg, loss_scale=loss_scale,
                         validate=validate)

    def forward(self, student, teacher, mask, *, weights=None, num_tokens=None) -> LossOutput:
        return self._loss(student, teacher, mask, weights=weights, num_tokens=num_tokens)
