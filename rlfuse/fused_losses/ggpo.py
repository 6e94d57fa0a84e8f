"""Fused GGPO: the group op and its backward, and the loss over any policy form."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..shared.aggregation import k3_kl_mean
from .._types import LossOutput, compute_dtype
from ..kernels.tokens.ggpo import GROUP_COLUMNS, ggpo_bwd, ggpo_fwd
from ._op import custom_op, register_autograd
from .form_ops import window_logprobs


@custom_op("ggpo")
def ggpo_op(lp: Tensor, ref_lp: Tensor, rewards: Tensor, mask: Tensor, group_size: int,
            beta: float, clip_radius: Optional[float], loss_scale: float,
            num_tokens: Optional[float]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(loss, group_sums [G, GROUP_COLUMNS], coef [B], t_tok)`` from learner log-probs
    ``lp [B, T]``: the group kernel's coefficients ``c_i`` and the token normaliser over the
    loss scale (``T_tok / loss_scale``) are what the backward needs."""
    coef, group_sums = ggpo_fwd(lp, ref_lp, mask, rewards, group_size, beta, clip_radius)
    if num_tokens is None:
        t_tok = group_sums[:, GROUP_COLUMNS.index("tokens")].sum().clamp_min(1) / loss_scale
    else:  # a fill, not a host-to-device copy
        t_tok = torch.full((), num_tokens / loss_scale, dtype=coef.dtype, device=coef.device)
    loss = group_sums[:, GROUP_COLUMNS.index("loss")].sum() / t_tok
    return loss, group_sums, coef, t_tok


@ggpo_op.register_fake
def _(lp, ref_lp, rewards, mask, group_size, beta, clip_radius, loss_scale, num_tokens):
    acc = compute_dtype(lp.dtype)
    B = lp.shape[0]
    return (lp.new_empty((), dtype=acc),
            lp.new_empty((B // group_size, len(GROUP_COLUMNS)), dtype=acc),
            lp.new_empty((B,), dtype=acc), lp.new_empty((), dtype=acc))


@custom_op("ggpo_backward")
def ggpo_backward_op(coef: Tensor, mask: Tensor, grad: Tensor, t_tok: Tensor,
                     dtype: torch.dtype) -> Tensor:
    """``dlp [B, T]`` of ``dtype``: ``-c_i M_it grad / t_tok`` (every scalar read on the
    device)."""
    return ggpo_bwd(coef, mask, grad, t_tok, dtype)


@ggpo_backward_op.register_fake
def _(coef, mask, grad, t_tok, dtype):
    return mask.new_empty(mask.shape, dtype=dtype)


def _setup_context(ctx, inputs, output):
    _, group_sums, coef, t_tok = output
    ctx.save_for_backward(coef, inputs.mask, t_tok)
    ctx.lp_dtype = inputs.lp.dtype
    ctx.mark_non_differentiable(group_sums, coef, t_tok)


def _backward(ctx, grad_loss, _group_sums, _coef, _t_tok):
    coef, mask, t_tok = ctx.saved_tensors
    return {"lp": ggpo_backward_op(coef, mask, grad_loss.to(coef.dtype), t_tok, ctx.lp_dtype)}


register_autograd(ggpo_op, _backward, _setup_context)


def _metrics(group_sums: Tensor, batch: int):
    if group_sums.shape[0] == 0:  # an empty batch: every metric 0, as in the reference
        group_sums = group_sums.new_zeros(1, group_sums.shape[1])
    column = dict(zip(GROUP_COLUMNS, group_sums.unbind(-1)))
    return {
        "gap": column["gap"].mean(),
        "q_max": column["q_max"].max(),
        "clip_frac": column["clipped"].sum() / column["tokens"].sum().clamp_min(1),
        "seq_logratio_mean": column["log_ratio"].sum() / max(batch, 1),
    }


def ggpo(policy, args, ref_logprobs: Tensor, rewards: Tensor, validate: bool) -> LossOutput:
    """GGPO's loss and metrics (``rlfuse.ggpo_loss``) of checked ``args``
    (``api.ggpo.GGPOArgs``): the log-probs, the group kernel, the token gradient."""
    lp = policy if isinstance(policy, Tensor) else \
        window_logprobs(policy, args.mask, validate=validate)[0]
    loss, group_sums, _, _ = ggpo_op(lp, ref_logprobs, rewards, args.mask, args.group_size,
                                     args.beta, args.clip_radius, args.loss_scale,
                                     args.num_tokens)
    metrics = _metrics(group_sums, args.info.shape[0])
    metrics["kl"] = k3_kl_mean(lp.detach().to(args.info.compute_dtype), ref_logprobs, args.mask)
    return LossOutput(loss, metrics)
