"""Fused GR-OPD: the advantage kernel, the loss (from log-probs or in one pass from logits), the
functional API and nn.Module."""
from __future__ import annotations

from typing import Optional

import torch

from .. import reference
from .._dispatch import use_kernels
from .._types import LossOutput
from .._validation import check_policy, check_tensor
from ..reference.gppo import masked_mean
from ..reference.gr_opd import check_advantage_inputs, check_gr_opd_args, clamped_feedback
from .surrogate import row_scales, surrogate_loss


def _advantages(old_logprobs, teacher_logprobs, mask, **kw):
    from ..kernels.gr_opd import gr_opd_advantages_kernel

    return gr_opd_advantages_kernel(old_logprobs.detach(), teacher_logprobs.detach(), mask, **kw)


def gr_opd_advantages(old_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                      mask: torch.Tensor, *, group_size: int, gamma: float = 0.99,
                      lam: float = 0.25, feedback_clip: float = 5.0, adv_clip: float = 5.0,
                      std_eps: float = 1e-6) -> torch.Tensor:
    """GR-OPD's group-relative sequence credit ``A [B]`` (detached), from one kernel.

    Call it once per rollout on the whole batch and pass ``advantages=`` to ``gr_opd_loss`` for
    every micro-batch. Definition: ``rlfuse.reference.gr_opd_advantages``.
    """
    check_tensor("old_logprobs", old_logprobs, floating=True)
    if not use_kernels(old_logprobs.device):
        return reference.gr_opd_advantages(
            old_logprobs, teacher_logprobs, mask, group_size=group_size, gamma=gamma, lam=lam,
            feedback_clip=feedback_clip, adv_clip=adv_clip, std_eps=std_eps)
    mask, (m, gamma, lam, feedback_clip, adv_clip, std_eps) = check_advantage_inputs(
        old_logprobs, teacher_logprobs, mask, group_size=group_size, gamma=gamma, lam=lam,
        feedback_clip=feedback_clip, adv_clip=adv_clip, std_eps=std_eps)
    adv, _ = _advantages(old_logprobs, teacher_logprobs, mask, group_size=m, gamma=gamma, lam=lam,
                         feedback_clip=feedback_clip, adv_clip=adv_clip, std_eps=std_eps)
    return adv


def gr_opd_loss(policy, old_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                mask: torch.Tensor, *, group_size: int, gamma: float = 0.99, lam: float = 0.25,
                eps: float = 0.2, feedback_clip: float = 5.0, adv_clip: float = 5.0,
                std_eps: float = 1e-6, advantages: Optional[torch.Tensor] = None,
                num_sequences: Optional[float] = None, validate: bool = True) -> LossOutput:
    """GR-OPD: PPO on the student's tokens with the group-relative teacher credit, fused.

    Args:
        policy: learner log-probs ``[B, T]`` (requires grad) or ``rlfuse.Logits``.
        old_logprobs: ``[B, T]`` log-probs of the sampling student (detached).
        teacher_logprobs: ``[B, T]`` log-probs of the frozen teacher on the student's tokens.
        mask: ``[B, T]`` bool (or 0/1): the response tokens; every response needs one.
        group_size: responses per prompt; rows ``[g m, (g + 1) m)`` form group ``g``.
        gamma, lam, feedback_clip, adv_clip, std_eps: the advantage (see
            ``gr_opd_advantages``); all runtime kernel arguments.
        eps: PPO clip range ``[1 - eps, 1 + eps]``.
        advantages: precomputed ``[B]`` advantages (from ``gr_opd_advantages`` on the whole
            rollout); ``teacher_logprobs`` then only feeds the ``feedback_mean`` metric.
        num_sequences: the global number of responses ``B`` (default: the local one).
        validate: check values of the ``[B, T]`` inputs (shapes are always checked).

    ``L = -(1/B) sum_i (1/T_i) sum_t M_it min(rho A_i, clip(rho, 1 - eps, 1 + eps) A_i)``:
    per-response token mean, then the mean over responses. An unclipped ``rho A`` that overflows
    the compute dtype raises ``ValueError`` (a flag set by the kernel, read with one host sync).
    Metrics: ``clip_frac``, ``adv_mean``, ``adv_abs_mean``, ``feedback_mean``. Definition:
    ``rlfuse.reference.gr_opd_loss``.
    """
    if not use_kernels(check_policy(policy).device):
        return reference.gr_opd_loss(
            policy, old_logprobs, teacher_logprobs, mask, group_size=group_size, gamma=gamma,
            lam=lam, eps=eps, feedback_clip=feedback_clip, adv_clip=adv_clip, std_eps=std_eps,
            advantages=advantages, num_sequences=num_sequences, validate=validate)
    info, mask, m, gamma, lam, eps, feedback_clip, adv_clip, std_eps, num_sequences = \
        check_gr_opd_args(policy, old_logprobs, teacher_logprobs, mask, group_size=group_size,
                          gamma=gamma, lam=lam, eps=eps, feedback_clip=feedback_clip,
                          adv_clip=adv_clip, std_eps=std_eps, advantages=advantages,
                          num_sequences=num_sequences, validate=validate)
    batch = info.shape[0]

    cdt = info.compute_dtype
    if advantages is None:
        from ..kernels.gr_opd import GROUP_FEEDBACK, GROUP_TOKENS

        adv, group_sums = _advantages(old_logprobs, teacher_logprobs, mask, group_size=m,
                                      gamma=gamma, lam=lam, feedback_clip=feedback_clip,
                                      adv_clip=adv_clip, std_eps=std_eps)
        totals = group_sums.sum(0)
        feedback_mean = totals[GROUP_FEEDBACK] / totals[GROUP_TOKENS].clamp_min(1)
    else:  # the metric alone, from [B, T] data
        adv = advantages.detach()
        feedback = clamped_feedback(old_logprobs.detach().to(cdt), teacher_logprobs.to(cdt),
                                    mask, feedback_clip)
        feedback_mean = masked_mean(feedback, mask)

    from ..kernels.gppo import PPO_CLIP
    from ..kernels.surrogate import SUM_CLIP_HIGH, SUM_CLIP_LOW

    scale = row_scales(mask, "seq-mean-token-mean", cdt, num_sequences=num_sequences)
    loss, totals = surrogate_loss(policy, old_logprobs.detach(), adv, mask, scale,
                                  geometry_code=PPO_CLIP, topology_code=0, delta=eps)
    adv_c = adv.to(cdt)
    metrics = {
        "clip_frac": (totals[SUM_CLIP_LOW] + totals[SUM_CLIP_HIGH]) / mask.sum().clamp_min(1),
        "adv_mean": adv_c.mean() if batch else adv_c.new_zeros(()),
        "adv_abs_mean": adv_c.abs().mean() if batch else adv_c.new_zeros(()),
        "feedback_mean": feedback_mean,
    }
    return LossOutput(loss, metrics)


class GROPDLoss(torch.nn.Module):
    """``gr_opd_loss`` with its hyper-parameters held by the module."""

    def __init__(self, *, group_size: int, gamma: float = 0.99, lam: float = 0.25,
                 eps: float = 0.2, feedback_clip: float = 5.0, adv_clip: float = 5.0,
                 std_eps: float = 1e-6, validate: bool = True):
        super().__init__()
        self.kwargs = dict(group_size=group_size, gamma=gamma, lam=lam, eps=eps,
                           feedback_clip=feedback_clip, adv_clip=adv_clip, std_eps=std_eps,
                           validate=validate)

    def forward(self, policy, old_logprobs, teacher_logprobs, mask, *, advantages=None,
                num_sequences=None) -> LossOutput:
        return gr_opd_loss(policy, old_logprobs, teacher_logprobs, mask, advantages=advantages,
                           num_sequences=num_sequences, **self.kwargs)
