"""Fused GR-OPD: the advantage op, the loss (from log-probs or in one pass from logits) and the
nn.Module."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import reference
from ..api.args import check_advantage_inputs, check_gr_opd_args
from .._dispatch import falls_back_to
from ..shared.aggregation import aggregation_weights, clamped_feedback, masked_mean
from .._types import LossOutput, compute_dtype
from ..kernels.gr_opd import GROUP_COLUMNS, gr_opd_advantages_fwd
from ._op import custom_op
from .surrogate import surrogate_loss


@custom_op("gr_opd_advantages")
def gr_opd_advantages_op(old_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor,
                         group_size: int, gamma: float, lam: float, feedback_clip: float,
                         adv_clip: float, std_eps: float,
                         acc: torch.dtype) -> Tuple[Tensor, Tensor]:
    """``(advantages [B], group_sums [G, GROUP_COLUMNS])`` computed in ``acc``."""
    return gr_opd_advantages_fwd(old_logprobs, teacher_logprobs, mask, group_size=group_size,
                                 gamma=gamma, lam=lam, feedback_clip=feedback_clip,
                                 adv_clip=adv_clip, std_eps=std_eps, acc=acc)


@gr_opd_advantages_op.register_fake
def _(old_logprobs, teacher_logprobs, mask, group_size, gamma, lam, feedback_clip, adv_clip,
      std_eps, acc):
    B = old_logprobs.shape[0]
    return (old_logprobs.new_empty((B,), dtype=acc),
            old_logprobs.new_empty((B // group_size, len(GROUP_COLUMNS)), dtype=acc))


@falls_back_to(reference.gr_opd_advantages)
def gr_opd_advantages(old_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                      mask: torch.Tensor, *, group_size: int, gamma: float = 0.99,
                      lam: float = 0.25, feedback_clip: float = 5.0, adv_clip: float = 5.0,
                      std_eps: float = 1e-6, validate: bool = True) -> torch.Tensor:
    args = check_advantage_inputs(
        old_logprobs, teacher_logprobs, mask, group_size=group_size, gamma=gamma, lam=lam,
        feedback_clip=feedback_clip, adv_clip=adv_clip, std_eps=std_eps, validate=validate)
    adv, _ = gr_opd_advantages_op(old_logprobs.detach(), teacher_logprobs.detach(), args.mask,
                                  *args.hyper,
                                  compute_dtype(old_logprobs.dtype, teacher_logprobs.dtype))
    return adv


@falls_back_to(reference.gr_opd_loss)
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
    old, teacher = old_logprobs.detach(), teacher_logprobs.detach()
    acc = compute_dtype(cdt, old.dtype, teacher.dtype)   # the advantages' widest input
    if args.advantages is None:
        adv, group_sums = gr_opd_advantages_op(old, teacher, mask, *hyper, acc)
        totals = dict(zip(GROUP_COLUMNS, group_sums.sum(0).unbind()))
        feedback_mean = totals["feedback"] / totals["tokens"].clamp_min(1)
    else:  # the metric alone, from [B, T] data
        adv = args.advantages.detach()
        feedback_mean = masked_mean(clamped_feedback(old.to(acc), teacher.to(acc), mask,
                                                     hyper.feedback_clip), mask)

    row_scale = args.loss_scale * aggregation_weights(mask, "seq-mean-token-mean", cdt,
                                                      num_sequences=args.num_sequences)
    loss, totals, _ = surrogate_loss(policy, old, adv, mask, row_scale, args.objective,
                                     validate=validate)
    adv_c = adv.to(cdt)
    tokens = mask.sum().to(cdt).clamp_min(1)
    metrics = {
        "clip_frac": (totals["flag0"] + totals["flag1"]) / tokens,
        "clip_frac_low": totals["flag0"] / tokens,
        "clip_frac_high": totals["flag1"] / tokens,
        "adv_mean": adv_c.mean() if adv_c.numel() else adv_c.new_zeros(()),
        "adv_abs_mean": adv_c.abs().mean() if adv_c.numel() else adv_c.new_zeros(()),
        "feedback_mean": feedback_mean,
        "overflow": (totals["overflow"] > 0).to(cdt),
    }
    return LossOutput(loss, metrics)
