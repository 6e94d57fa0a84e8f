"""Reference GR-OPD advantages: the group-relative credit of a teacher's feedback."""
from __future__ import annotations

import torch

from ..shared.aggregation import clamped_feedback, masked_mean


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


def gr_opd_advantages(old_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                      mask: torch.Tensor, hyper, acc: torch.dtype):
    """``(advantages [B], mean clamped feedback)`` of GR-OPD in ``acc`` (``hyper``:
    ``api.args.AdvantageArgs``)."""
    with torch.no_grad():
        feedback = clamped_feedback(old_logprobs.to(acc), teacher_logprobs.to(acc), mask,
                                    hyper.feedback_clip)
        adv = _advantages(feedback, mask, hyper.group_size, hyper.gamma, hyper.lam,
                          hyper.adv_clip, hyper.std_eps)
        return adv, masked_mean(feedback, mask)
