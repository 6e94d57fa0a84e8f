"""Reference GR-OPD: group-relative on-policy distillation with a per-response PPO mean."""
from __future__ import annotations

from typing import Optional

import torch

from .._contract import (check_advantage_inputs, check_gr_opd_args, clamped_feedback,
                         masked_mean)
from .._types import LossOutput, compute_dtype
from .gppo import aggregate, clipped_surrogate, overflow_metric
from .logprobs import learner_logprobs


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
                      mask: torch.Tensor, *, group_size: int, gamma: float = 0.99,
                      lam: float = 0.25, feedback_clip: float = 5.0, adv_clip: float = 5.0,
                      std_eps: float = 1e-6, validate: bool = True) -> torch.Tensor:
    """GR-OPD's group-relative sequence credit, one advantage per response (``[B]``, detached)::

        r_it = clamp(teacher_lp_it − old_lp_it, −feedback_clip, feedback_clip)
        S_i  = Σ_k γ^{k−1} r_{i,t_k} / Σ_k γ^{k−1}
               (t_k = k-th actor token of response i, k = 1..T_i)
        μ_g, σ_g = mean and POPULATION std (ddof=0) of S over the group
        A_i  = clamp( (S_i − μ_g + λ μ_g) / (σ_g + std_eps), −adv_clip, adv_clip )

    The discount counts actor tokens only: it restarts at every response and skips masked
    positions. A group of equal scores (σ = 0) gives ``clamp(λ μ_g / std_eps)``, finite.
    Computed in fp32 (fp64 for fp64 ``old_logprobs``); every response needs an actor token.
    ``gamma`` in (0, 1], clips >= 0, ``std_eps`` > 0. ``validate=False`` skips the value checks
    (finite inputs at actor tokens, a token in every response; host syncs): a response without
    one then scores 0. Call it once per rollout on the whole batch and pass ``advantages=`` to
    ``gr_opd_loss`` for every micro-batch (fused: one kernel, one program per group).
    """
    mask, (m, gamma, lam, feedback_clip, adv_clip, std_eps) = check_advantage_inputs(
        old_logprobs, teacher_logprobs, mask, group_size=group_size, gamma=gamma, lam=lam,
        feedback_clip=feedback_clip, adv_clip=adv_clip, std_eps=std_eps, validate=validate)
    cdt = compute_dtype(old_logprobs.dtype, teacher_logprobs.dtype)
    with torch.no_grad():
        feedback = clamped_feedback(old_logprobs.to(cdt), teacher_logprobs.to(cdt), mask,
                                    feedback_clip)
        return _advantages(feedback, mask, m, gamma, lam, adv_clip, std_eps)


def gr_opd_loss(policy, old_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                mask: torch.Tensor, *, group_size: int, gamma: float = 0.99, lam: float = 0.25,
                eps: float = 0.2, feedback_clip: float = 5.0, adv_clip: float = 5.0,
                std_eps: float = 1e-6, advantages: Optional[torch.Tensor] = None,
                loss_scale: float = 1.0, num_sequences: Optional[float] = None,
                validate: bool = True) -> LossOutput:
    """GR-OPD: PPO on the student's tokens with the group-relative teacher credit ``A_i``.

    Args:
        policy: learner log-probs ``[B, T]`` (requires grad) or ``rlfuse.Logits``.
        old_logprobs: ``[B, T]`` log-probs of the sampling student (detached).
        teacher_logprobs: ``[B, T]`` log-probs of the frozen teacher replayed on the student's
            tokens (detached).
        mask: ``[B, T]`` bool (or 0/1): the response tokens; every response needs one.
        group_size: responses per prompt; rows ``[g m, (g + 1) m)`` form group ``g``.
        gamma, lam, feedback_clip, adv_clip, std_eps: the advantage (see
            :func:`gr_opd_advantages`); all runtime kernel arguments.
        eps: PPO clip range ``[1 − eps, 1 + eps]``, or ``(eps_low, eps_high)`` for
            ``[1 − eps_low, 1 + eps_high]``.
        advantages: precomputed ``[B]`` (or ``[B, 1]``) advantages (from
            ``gr_opd_advantages`` on the whole rollout); ``teacher_logprobs`` then only feeds
            the ``feedback_mean`` metric.
        loss_scale: multiplies the loss and every gradient, inside the kernels (e.g.
            ``1 / gradient_accumulation_steps``): no pass over a gradient to rescale it.
        num_sequences: the global number of responses ``B`` (default: the local one).
        validate: check the values of the ``[B, T]`` inputs and refuse an overflowing ``ρ A``
            (host syncs); shapes, dtypes and devices are always checked.

    ::

        ρ_it = exp(lp_it − old_lp_it)
        L    = −(1/B) Σ_i (1/T_i) Σ_t M_it min(ρ_it A_i, clip(ρ_it, 1−ε, 1+ε) A_i)
        ∂L/∂lp_it = −A_i ρ_it 1[active_it] M_it / (B T_i)

    Per-response token mean first, then the mean over responses (never a global token mean);
    ``B`` is ``num_sequences``. The PPO branch is chosen in log-ratio space and only the selected
    branch is exponentiated; when it is the unclipped negative-advantage branch and ``ρ A``
    overflows the compute dtype (fp32 for bf16/fp16/fp32 inputs, fp64 for fp64) this raises
    ``ValueError`` rather than returning inf/NaN (``validate=False``: the ``overflow`` metric).

    Metrics (detached): ``clip_frac`` share of actor tokens where the clipped branch is
    selected; ``adv_mean`` / ``adv_abs_mean`` mean of A_i / |A_i| over the responses;
    ``feedback_mean`` mean of the clamped feedback r_it over actor tokens (computed from
    ``teacher_logprobs`` also when ``advantages`` are given); ``overflow`` as in GPPO.

    Fused (``rlfuse.gr_opd_loss``): the advantage kernel, then GPPO's surrogate kernels with the
    fixed region ``[1 − ε, 1 + ε]``; from ``Logits`` one single pass over the logits.
    """
    info, mask, hyper, (eps_low, eps_high), advantages, loss_scale, num_sequences = \
        check_gr_opd_args(
            policy, old_logprobs, teacher_logprobs, mask, group_size=group_size, gamma=gamma,
            lam=lam, eps=eps, feedback_clip=feedback_clip, adv_clip=adv_clip, std_eps=std_eps,
            advantages=advantages, loss_scale=loss_scale, num_sequences=num_sequences,
            validate=validate)
    batch = info.shape[0]

    cdt = info.compute_dtype
    acc = compute_dtype(cdt, old_logprobs.dtype, teacher_logprobs.dtype)  # widest input
    lp = torch.where(mask, learner_logprobs(policy, mask).to(cdt), 0.0)
    old = torch.where(mask, old_logprobs.detach().to(cdt), 0.0)
    with torch.no_grad():
        feedback = clamped_feedback(old_logprobs.to(acc), teacher_logprobs.to(acc), mask,
                                    hyper.feedback_clip)
        if advantages is None:
            adv_seq = _advantages(feedback, mask, hyper.group_size, hyper.gamma, hyper.lam,
                                  hyper.adv_clip, hyper.std_eps)
        else:
            adv_seq = advantages.to(acc)
        feedback_mean = masked_mean(feedback, mask)
        adv = torch.where(mask, adv_seq.unsqueeze(-1).expand(info.shape), 0.0).to(cdt)
        lo = torch.full_like(lp, max(1.0 - eps_low, 0.0))
        hi = torch.full_like(lp, 1.0 + eps_high)
    sur = clipped_surrogate(lp - old, adv, lo, hi, mask)
    loss = -loss_scale * aggregate(sur.value, mask, "seq-mean-token-mean",
                                   num_sequences=num_sequences)

    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean((sur.clipped_low | sur.clipped_high).to(cdt), mask),
            "adv_mean": adv_seq.mean() if batch else adv_seq.new_zeros(()),
            "adv_abs_mean": adv_seq.abs().mean() if batch else adv_seq.new_zeros(()),
            "feedback_mean": feedback_mean,
            "overflow": overflow_metric(sur, validate),
        }
    return LossOutput(loss, metrics)
