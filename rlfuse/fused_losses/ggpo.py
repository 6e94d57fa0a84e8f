"""Fused GGPO: autograd Function, functional API and nn.Module."""
from __future__ import annotations

from typing import Optional

import torch

from .. import reference
from .._dispatch import use_kernels
from .._types import LossOutput
from .._validation import check_policy
from ..reference.ggpo import check_ggpo_args
from .logprobs import policy_logprobs


class GGPOFunction(torch.autograd.Function):
    """``(loss, group_sums)`` of GGPO from learner log-probs ``lp [B, T]``; ``group_sums`` holds
    the per-group partial sums the metrics are made of (not differentiable)."""

    @staticmethod
    def forward(ctx, lp, ref_lp, rewards, mask, group_size, beta, clip_radius, num_tokens):
        from ..kernels import ggpo as k

        coef, group_sums = k.ggpo_fwd(lp.detach(), ref_lp, mask, rewards, group_size, beta,
                                      clip_radius)
        if num_tokens is None:
            t_tok = group_sums[:, k.GROUP_TOKENS].sum().clamp_min(1)
        else:  # a fill, not a host-to-device copy
            t_tok = torch.full((), num_tokens, dtype=coef.dtype, device=coef.device)
        loss = group_sums[:, k.GROUP_LOSS].sum() / t_tok
        ctx.save_for_backward(coef, mask, t_tok)
        ctx.lp_dtype = lp.dtype
        ctx.mark_non_differentiable(group_sums)
        return loss, group_sums

    @staticmethod
    def backward(ctx, grad_loss, _grad_group_sums):
        from ..kernels.ggpo import ggpo_bwd

        coef, mask, t_tok = ctx.saved_tensors
        dlp = ggpo_bwd(coef, mask, grad_loss.to(coef.dtype), t_tok, ctx.lp_dtype)
        return dlp, None, None, None, None, None, None, None


def _metrics(group_sums: torch.Tensor, batch: int):
    from ..kernels import ggpo as k

    if group_sums.shape[0] == 0:  # an empty batch: every metric 0, as in the reference
        group_sums = group_sums.new_zeros(1, group_sums.shape[1])
    tokens = group_sums[:, k.GROUP_TOKENS].sum()
    return {
        "gap": group_sums[:, k.GROUP_GAP].mean(),
        "q_max": group_sums[:, k.GROUP_QMAX].max(),
        "clip_frac": group_sums[:, k.GROUP_CLIPPED].sum() / tokens.clamp_min(1),
        "seq_logratio_mean": group_sums[:, k.GROUP_LOGRATIO].sum() / max(batch, 1),
    }


def ggpo_loss(policy, ref_logprobs: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, *,
              group_size: int, beta: float, clip_radius: Optional[float] = None,
              num_tokens: Optional[float] = None, validate: bool = True) -> LossOutput:
    """GGPO: the stable Gibbs (log-mean-exp) gap of KL-adjusted rewards, fused.

    Args:
        policy: learner log-probs ``[B, T]`` (requires grad) or ``rlfuse.Logits``.
        ref_logprobs: ``[B, T]`` log-probs of the reference policy (detached; garbage allowed at
            masked positions).
        rewards: ``[B]`` sequence rewards.
        mask: ``[B, T]`` bool (or 0/1): the response tokens.
        group_size: ``m >= 2``; rows ``[g m, (g + 1) m)`` form group ``g``.
        beta: KL weight ``> 0`` (a runtime kernel argument: changing it does not recompile).
        clip_radius: ``rho`` (> 0, may be ``inf``) selects the clipped branch.
        num_tokens: the token count ``T_tok`` of the whole minibatch (for gradient accumulation
            and data parallelism); default: ``mask.sum()``.
        validate: check values of the ``[B, T]`` inputs (0/1 mask, finite values at actor
            positions, a token in every group); shapes and devices are always checked.

    With ``s_i = sum_t M lp``, ``R_i = r_i - beta (s_i - s_i^ref)``, ``q = softmax_g(R / beta)``::

        J_g = beta (logsumexp_i z_i - log m),   z_i = (R_i - mean_g R) / beta
        L   = m sum_g J_g / (beta sqrt(m - 1) T_tok),   dL/dlp_it = -c_i M_it / T_tok,
        c_i = (m q_i - 1) / sqrt(m - 1)

    Clipped branch: ``d = clamp(lp - ref_lp, -rho, rho)``, ``q~ = softmax_g((r - beta sum_t M d)
    / beta)``, ``L = -(1/T_tok) sum_i c~_i s_i`` with ``c~`` detached. See
    ``rlfuse.reference.ggpo_loss`` for the full definition and the metrics (``gap``, ``q_max``,
    ``clip_frac``, ``seq_logratio_mean``).

    From log-probs: one forward kernel (one program per group) and one backward kernel. From
    ``Logits``: the log-prob pass over the logits, the group kernel, and one backward pass that
    writes ``dlogits``: two reads and one write of the logits.
    """
    if not use_kernels(check_policy(policy).device):
        return reference.ggpo_loss(policy, ref_logprobs, rewards, mask, group_size=group_size,
                                   beta=beta, clip_radius=clip_radius, num_tokens=num_tokens,
                                   validate=validate)
    info, mask, m, beta, clip_radius, num_tokens = check_ggpo_args(
        policy, ref_logprobs, rewards, mask, group_size=group_size, beta=beta,
        clip_radius=clip_radius, num_tokens=num_tokens, validate=validate)

    lp = policy_logprobs(policy, mask)
    loss, group_sums = GGPOFunction.apply(lp, ref_logprobs.detach(), rewards.detach(), mask, m,
                                          beta, clip_radius, num_tokens)
    return LossOutput(loss, _metrics(group_sums, info.shape[0]))


class GGPOLoss(torch.nn.Module):
    """``ggpo_loss`` with its hyper-parameters held by the module."""

    def __init__(self, *, group_size: int, beta: float, clip_radius: Optional[float] = None,
                 validate: bool = True):
        super().__init__()
        self.group_size, self.beta, self.clip_radius = group_size, beta, clip_radius
        self.validate = validate

    def forward(self, policy, ref_logprobs, rewards, mask, *, num_tokens=None) -> LossOutput:
        return ggpo_loss(policy, ref_logprobs, rewards, mask, group_size=self.group_size,
                         beta=self.beta, clip_radius=self.clip_radius, num_tokens=num_tokens,
                         validate=self.validate)
