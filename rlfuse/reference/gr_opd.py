"""Reference GR-OPD advantages: the group-relative credit of a teacher's feedback."""
from __future__ import annotations

import torch

from ..shared.aggregation import (clamped_feedback, discounted_sums, group_credit,
                                  masked_mean)


def gr_opd_advantages(old_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                      mask: torch.Tensor, hyper, acc: torch.dtype):
    """``(advantages [B], mean clamped feedback)`` of GR-OPD in ``acc`` (``hyper``:
    ``api.gr_opd.AdvantageArgs``)."""
    with torch.no_grad():
        feedback = clamped_feedback(old_logprobs.to(acc), teacher_logprobs.to(acc), mask,
                                    hyper.feedback_clip)
        num, den = discounted_sums(feedback, mask, hyper.gamma)
        score = num / den.clamp_min(torch.finfo(den.dtype).tiny)
        adv = group_credit(score, hyper.group_size, hyper.lam, hyper.adv_clip, hyper.std_eps)
        return adv, masked_mean(feedback, mask)
