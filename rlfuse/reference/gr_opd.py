"""Reference GR-OPD: group-relative on-policy distillation with a per-response PPO mean."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .._types import LossOutput
from .._validation import (PolicyInfo, check_actor_tokens, check_group_size,
                           check_logits_targets, check_nonnegative, check_number, check_policy,
                           check_positive, check_sequence_tensor, check_tensor,
                           check_token_tensors, check_unit_interval, compute_dtype)
from .gppo import aggregate, clipped_surrogate, masked_mean
from .logprobs import policy_logprobs


def check_advantage_args(group_size: int, batch: int, gamma, lam, feedback_clip, adv_clip,
                          std_eps):
    return (check_group_size(group_size, batch), check_unit_interval("gamma", gamma),
            check_number("lam", lam), check_nonnegative("feedback_clip", feedback_clip),
            check_nonnegative("adv_clip", adv_clip), check_positive("std_eps", std_eps))


def clamped_feedback(old: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor,
              feedback_clip: float) -> torch.Tensor:
    """r_it = clamp(teacher_lp − old_lp, ±feedback_clip) at actor tokens, 0 elsewhere."""
    return torch.where(mask, (teacher - old).clamp(-feedback_clip, feedback_clip), 0.0)


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


def check_advantage_inputs(old_logprobs, teacher_logprobs, mask, *, group_size, gamma, lam,
                           feedback_clip, adv_clip, std_eps):
    """The checks of ``gr_opd_advantages`` (shared by the fused path); returns the bool mask and
    the normalised hyper-parameters."""
    check_tensor("old_logprobs", old_logprobs, floating=True)
    if old_logprobs.dim() != 2:
        raise ValueError(f"old_logprobs: expected shape [B, T], got {tuple(old_logprobs.shape)}")
    shape = tuple(old_logprobs.shape)
    mask = check_token_tensors(mask, {"old_logprobs": old_logprobs,
                                      "teacher_logprobs": teacher_logprobs},
                               shape=shape, device=old_logprobs.device)
    m, gamma, lam, feedback_clip, adv_clip, std_eps = check_advantage_args(
        group_size, shape[0], gamma, lam, feedback_clip, adv_clip, std_eps)
    check_actor_tokens(mask, 1, what="sequence")
    return mask, (m, gamma, lam, feedback_clip, adv_clip, std_eps)


def gr_opd_advantages(old_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                      mask: torch.Tensor, *, group_size: int, gamma: float = 0.99,
                      lam: float = 0.25, feedback_clip: float = 5.0, adv_clip: float = 5.0,
                      std_eps: float = 1e-6) -> torch.Tensor:
    """Group-relative sequence credit of GR-OPD, one advantage per response ([B], detached)::

        r_it = clamp(teacher_lp_it − old_lp_it, −feedback_clip, feedback_clip)
        S_i  = Σ_k γ^{k−1} r_{i,t_k} / Σ_k γ^{k−1}
               (t_k = k-th actor token of response i, k = 1..T_i)
        μ_g, σ_g = mean and POPULATION std (ddof=0) of S over the group
        A_i  = clamp( (S_i − μ_g + λ μ_g) / (σ_g + std_eps), −adv_clip, adv_clip )

    The discount counts actor tokens only: it restarts at every response and skips masked
    positions. A group of equal scores (σ = 0) gives ``clamp(λ μ_g / std_eps)``, finite.
    Computed in fp32 (fp64 for fp64 ``old_logprobs``); every response needs an actor token.
    ``gamma`` in (0, 1], clips >= 0, ``std_eps`` > 0.
    """
    mask, (m, gamma, lam, feedback_clip, adv_clip, std_eps) = check_advantage_inputs(
        old_logprobs, teacher_logprobs, mask, group_size=group_size, gamma=gamma, lam=lam,
        feedback_clip=feedback_clip, adv_clip=adv_clip, std_eps=std_eps)
    cdt = compute_dtype(old_logprobs.dtype)
    with torch.no_grad():
        feedback = clamped_feedback(old_logprobs.to(cdt), teacher_logprobs.to(cdt), mask, feedback_clip)
        return _advantages(feedback, mask, m, gamma, lam, adv_clip, std_eps)


class GROPDArgs(NamedTuple):
    info: PolicyInfo
    mask: torch.Tensor             # bool
    group_size: int
    gamma: float
    lam: float
    eps: float
    feedback_clip: float
    adv_clip: float
    std_eps: float
    num_sequences: Optional[float]


def check_gr_opd_args(policy, old_logprobs, teacher_logprobs, mask, *, group_size, gamma, lam,
                      eps, feedback_clip, adv_clip, std_eps, advantages, num_sequences,
                      validate) -> GROPDArgs:
    """The checks of ``gr_opd_loss`` (shared by the fused path); returns the normalised args."""
    info = check_policy(policy)
    batch, device = info.shape[0], info.device
    mask = check_token_tensors(mask, {"old_logprobs": old_logprobs,
                                      "teacher_logprobs": teacher_logprobs},
                               shape=info.shape, device=device, validate=validate)
    m, gamma, lam, feedback_clip, adv_clip, std_eps = check_advantage_args(
        group_size, batch, gamma, lam, feedback_clip, adv_clip, std_eps)
    eps = check_positive("eps", eps)
    if advantages is not None:
        check_sequence_tensor("advantages", advantages, batch=batch, device=device,
                              validate=validate)
    if num_sequences is not None:
        num_sequences = check_positive("num_sequences", num_sequences)
    check_logits_targets(policy, mask, validate)
    if validate:
        check_actor_tokens(mask, 1, what="sequence")
    return GROPDArgs(info, mask, m, gamma, lam, eps, feedback_clip, adv_clip, std_eps,
                     num_sequences)


def gr_opd_loss(policy, old_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                mask: torch.Tensor, *, group_size: int, gamma: float = 0.99, lam: float = 0.25,
                eps: float = 0.2, feedback_clip: float = 5.0, adv_clip: float = 5.0,
                std_eps: float = 1e-6, advantages: Optional[torch.Tensor] = None,
                num_sequences: Optional[float] = None, validate: bool = True) -> LossOutput:
    """GR-OPD loss: PPO on the student's tokens with the group-relative teacher credit ``A_i``.

    ``policy``: learner log-probs ``lp`` [B, T] (with grad) or ``rlfuse.Logits``;
    ``old_logprobs`` (sampling student) and ``teacher_logprobs`` (frozen teacher replayed on the
    student's tokens) [B, T], detached. ``A_i`` as in :func:`gr_opd_advantages`, or the
    precomputed ``advantages`` [B] (``teacher_logprobs`` is then checked but unused)::

        ρ_it = exp(lp_it − old_lp_it)
        L    = −(1/B) Σ_i (1/T_i) Σ_t M_it min(ρ_it A_i, clip(ρ_it, 1−ε, 1+ε) A_i)
        ∂L/∂lp_it = −A_i ρ_it 1[active_it] M_it / (B T_i)

    Per-response token mean first, then the mean over responses (never a global token mean);
    ``B`` is ``num_sequences`` (the global count; default the local B). The PPO branch is chosen
    in log-ratio space and only the selected branch is exponentiated; when it is the unclipped
    negative-advantage branch and ``ρ A`` overflows the compute dtype (fp32 for bf16/fp16/fp32
    inputs, fp64 for fp64) this raises ``ValueError`` rather than returning inf/NaN.

    Metrics (detached): ``clip_frac`` share of actor tokens where the clipped branch is
    selected; ``adv_mean`` / ``adv_abs_mean`` mean of A_i / |A_i| over the responses;
    ``feedback_mean`` mean of the clamped feedback r_it over actor tokens (computed from
    ``teacher_logprobs`` also when ``advantages`` are given).
    """
    a = check_gr_opd_args(policy, old_logprobs, teacher_logprobs, mask, group_size=group_size,
                          gamma=gamma, lam=lam, eps=eps, feedback_clip=feedback_clip,
                          adv_clip=adv_clip, std_eps=std_eps, advantages=advantages,
                          num_sequences=num_sequences, validate=validate)
    info, mask, m, gamma, lam, eps, feedback_clip, adv_clip, std_eps, num_sequences = a
    batch = info.shape[0]

    cdt = info.compute_dtype
    lp = torch.where(mask, policy_logprobs(policy, mask).to(cdt), 0.0)
    old = torch.where(mask, old_logprobs.detach().to(cdt), 0.0)
    with torch.no_grad():
        feedback = clamped_feedback(old, teacher_logprobs.to(cdt), mask, feedback_clip)
        if advantages is None:
            adv_seq = _advantages(feedback, mask, m, gamma, lam, adv_clip, std_eps)
        else:
            adv_seq = advantages.to(cdt)
        feedback_mean = masked_mean(feedback, mask)
        adv = torch.where(mask, adv_seq.unsqueeze(-1).expand(info.shape), 0.0)
        lo = torch.full_like(lp, max(1.0 - eps, 0.0))
        hi = torch.full_like(lp, 1.0 + eps)
    sur = clipped_surrogate(lp - old, adv, lo, hi, mask)
    loss = -aggregate(sur.value, mask, "seq-mean-token-mean", num_sequences=num_sequences)

    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean((sur.clipped_low | sur.clipped_high).to(cdt), mask),
            "adv_mean": adv_seq.mean() if batch else adv_seq.new_zeros(()),
            "adv_abs_mean": adv_seq.abs().mean() if batch else adv_seq.new_zeros(()),
            "feedback_mean": feedback_mean,
        }
    return LossOutput(loss, metrics)
