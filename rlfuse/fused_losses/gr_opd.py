"""Fused GR-OPD advantages: the custom op over the advantage kernel."""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from ..kernels.tokens.gr_opd import GROUP_COLUMNS, gr_opd_advantages_fwd
from ._op import custom_op


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


def gr_opd_advantages(old_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor, hyper,
                      acc: torch.dtype) -> Tuple[Tensor, Tensor]:
    """``(advantages [B], mean clamped feedback)`` of GR-OPD in ``acc`` (``hyper``:
    ``api.gr_opd.AdvantageArgs``): one kernel, one program per group."""
    adv, group_sums = gr_opd_advantages_op(old_logprobs, teacher_logprobs, mask, *hyper, acc)
    totals = dict(zip(GROUP_COLUMNS, group_sums.sum(0).unbind()))
    return adv, totals["feedback"] / totals["tokens"].clamp_min(1)
