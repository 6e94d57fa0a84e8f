"""Reference GR-OPD: group-relative on-policy distillation with a per-response PPO mean."""
from __future__ import annotations

from typing import Optional

import torch

from ..api.args import check_advantage_inputs, check_gr_opd_args
from .._docs import documented
from ..shared.aggregation import clamped_feedback, masked_mean
from .._types import LossOutput, compute_dtype
from .surrogate import overflow_metric, surrogate


def _advantages(feedback: torch.Tensor, mask: torch.Tensor, m: int, gamma: float, lam: float,
                adv_clip: float, std_eps: float) -> torch.Tensor:
    k = mask.to(feedback.dtype).cumsum(-1)                        # t_k: 1-based actor index
    weight = torch.where(mask, torch.pow(gamma, k - 1.0), 0.0)   # γ^{k−1}, restarts per row
    score = (weight * feedback).sum(-1) / weight.sum(-1).clamp_min(torch.finfo(weight.dtype).tiny)
    score = score.reshape(-1, m)
    mu = score.mean(-1, keepdim=True)
    sigma = (score - mu).square().mean(-1, keepdim=True).sqrt()   # population std (ddof = 0)
    adv = ((score - mu + lam * mu) / (sigma + std_eps)).clamp(-adv_clip, adv_clip)
    return adv.reshape(-1)


@documented
def gr_opd_advantages(old_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                      mask: torch.Tensor, *, group_size: int, gamma: float = 0.99,
                      lam: float = 0.25, feedback_clip: float = 5.0, adv_clip: float = 5.0,
                      std_eps: float = 1e-6, validate: bool = True) -> torch.Tensor:
    args = check_advantage_inputs(
        old_logprobs, teacher_logprobs, mask, group_size=group_size, gamma=gamma, lam=lam,
        feedback_clip=feedback_clip, adv_clip=adv_clip, std_eps=std_eps, validate=validate)
    hyper = args.hyper
    cdt = compute_dtype(old_logprobs.dtype, teacher_logprobs.dtype)
    with torch.no_grad():
        feedback = clamped_feedback(old_logprobs.to(cdt), teacher_logprobs.to(cdt), args.mask,
                                    hyper.feedback_clip)
        return _advantages(feedback, args.mask, hyper.group_size, hyper.gamma, hyper.lam,
                           hyper.adv_clip, hyper.std_eps)


@documented
def gr_opd_loss(policy, old_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                mask: torch.Tensor, *, group_size: int, gamma: float = 0.99, lam: float = 0.25,
                eps: float = 0.2, feedback_clip: float = 5.0, adv_clip: float = 5.0,
                std_eps: float = 1e-6, advantages: Optional[torch.Tensor] = None,
                loss_scale: float = 1.0, num_sequences: Optional[float] = None,
                validate: bool = True) -> LossOutput:
    args = check_gr_opd_args(
        policy, old_logprobs, teacher_logprobs, mask, group_size=group_size, gamma=gamma,
        lam=lam, eps=eps, feedback_clip=feedback_clip, adv_clip=adv_clip, std_eps=std_eps,
        advantages=advantages, loss_scale=loss_scale, num_sequences=num_sequences,
        validate=validate)
    mask, hyper, cdt = args.mask, args.hyper, args.info.compute_dtype
    acc = compute_dtype(cdt, old_logprobs.dtype, teacher_logprobs.dtype)  # widest input
    with torch.no_grad():
        feedback = clamped_feedback(old_logprobs.to(acc), teacher_logprobs.to(acc), mask,
                                    hyper.feedback_clip)
        if args.advantages is None:
            adv = _advantages(feedback, mask, hyper.group_size, hyper.gamma, hyper.lam,
                              hyper.adv_clip, hyper.std_eps)
        else:
            adv = args.advantages.to(acc)
    result = surrogate(policy, old_logprobs, adv, mask, args.objective, compute_dtype=cdt,
                       agg="seq-mean-token-mean", loss_scale=args.loss_scale,
                       num_sequences=args.num_sequences, validate=validate)
    terms = result.terms
    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean((terms.flags[0] | terms.flags[1]).to(cdt), mask),
            "clip_frac_low": masked_mean(terms.flags[0].to(cdt), mask),
            "clip_frac_high": masked_mean(terms.flags[1].to(cdt), mask),
            "adv_mean": adv.mean() if adv.numel() else adv.new_zeros(()),
            "adv_abs_mean": adv.abs().mean() if adv.numel() else adv.new_zeros(()),
            "feedback_mean": masked_mean(feedback, mask),
            "overflow": overflow_metric(terms),
        }
    return LossOutput(result.loss, metrics)
