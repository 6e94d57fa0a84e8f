"""Reference PPO family: GRPO, DAPO (clip-higher), Dr. GRPO, GSPO — the clipped surrogate that
trainers run today, over the same kernels as GPPO."""
from __future__ import annotations

from typing import Optional

import torch

from .._contract import check_ppo_args
from .._types import LossOutput
from .gppo import surrogate_loss


def ppo_loss(policy, old_logprobs: Optional[torch.Tensor], advantages: torch.Tensor,
             mask: torch.Tensor, *, clip=0.2, dual_clip: Optional[float] = None,
             ratio_level: str = "token", agg: str = "token-mean",
             weights: Optional[torch.Tensor] = None, loss_scale: float = 1.0,
             num_tokens: Optional[float] = None, num_sequences: Optional[float] = None,
             validate: bool = True) -> LossOutput:
    """The PPO clipped surrogate, as GRPO / DAPO / Dr. GRPO / GSPO trainers run it.

    Args:
        policy: learner log-probs ``[B, T]`` (requires grad), ``rlfuse.Logits`` or
            ``rlfuse.LinearHead``.
        old_logprobs: ``[B, T]`` log-probs of the policy that sampled the tokens (detached), or
            None on policy (``old = lp.detach()``: ratio 1; from logits or a head the kernel
            forms it itself, no extra pass).
        advantages: ``[B]`` / ``[B, 1]`` (per sequence) or ``[B, T]`` (per token).
        mask: ``[B, T]`` bool (or 0/1): the response tokens.
        clip: ``eps`` or ``(eps_low, eps_high)``, each in (0, 1): the region
            ``[1 − eps_low, 1 + eps_high]`` (DAPO's clip-higher, TRL's ``epsilon_high``,
            verl's ``clip_ratio_low`` / ``clip_ratio_high``).
        dual_clip: ``c > 1``: for ``A < 0`` the token objective is
            ``max(min(r A, clip(r) A), c A)`` (verl's ``clip_ratio_c``); None: no dual clip.
        ratio_level: ``"token"`` (r per token) or ``"sequence"`` (GSPO: every token of row i
            takes ``s_i = exp(mean over its actor tokens of lp − old)``, clipped as r is; the
            gradient flows through the mean, ``∂s_i/∂lp_it = s_i / T_i``; TRL's
            ``importance_sampling_level="sequence"``).
        agg: ``token-mean`` (default), ``seq-mean-token-mean``, ``seq-mean-token-sum``,
            ``seq-mean-token-sum-norm``, ``token-sum`` (verl's names; see
            ``rlfuse.reference.gppo.aggregate``).
            A response without actor tokens contributes 0 and counts in the default
            ``num_sequences``. TRL's loss types: ``grpo`` = ``seq-mean-token-mean``, ``bnpo`` =
            ``token-mean``, ``dr_grpo`` = ``token-mean`` with ``num_tokens = B ·
            max_completion_length``, ``dapo`` = ``token-mean`` with the global token count.
        weights: optional ``[B, T]`` non-negative per-token multipliers of J (vLLM's
            importance-sampling correction, an entropy or off-policy mask); detached.
        loss_scale: multiplies the loss and every gradient inside the kernels (e.g.
            ``1 / gradient_accumulation_steps``).
        num_tokens, num_sequences: global counts, numbers or 0-dim tensors (default: the
            local ones).
        validate: check the values of the ``[B, T]`` inputs and refuse an overflowing ``r A``
            (host syncs); shapes, dtypes and devices are always checked.

    Per actor token, ``r = exp(lp − old)`` (or ``s_i``)::

        J_t = w_t min(r A, clip(r, 1 − eps_low, 1 + eps_high) A)   (A < 0, dual: max(…, c A))
        loss = −loss_scale · agg(J)

    decided in log space as in ``gppo_loss`` (only the selected branch is exponentiated; an
    overflowing unclipped ``r A`` raises, or is the ``overflow`` metric without validation).
    Metrics: ``clip_frac_low``, ``clip_frac_high``, ``dual_clip_frac``, ``ratio_mean``,
    ``approx_kl``, ``overflow`` (as GPPO's).

    Fused (``rlfuse.ppo_loss``): GPPO's kernels with PPO's region — from ``Logits`` /
    ``LinearHead`` one pass for the token-level ratio; the sequence-level ratio needs every
    log-prob of a row first, so it runs the log-prob pass and the surrogate on ``[B, T]``.
    """
    args = check_ppo_args(
        policy, old_logprobs, advantages, mask, clip=clip, dual_clip=dual_clip,
        ratio_level=ratio_level, agg=agg, weights=weights, loss_scale=loss_scale,
        num_tokens=num_tokens, num_sequences=num_sequences, validate=validate)
    eps_low, eps_high = args.delta

    def bounds(old: torch.Tensor):
        return (torch.full_like(old, 1.0 - eps_low, dtype=torch.float64),
                torch.full_like(old, 1.0 + eps_high, dtype=torch.float64))

    return LossOutput(*surrogate_loss(policy, old_logprobs, args, bounds, agg=agg,
                                      validate=validate, sequence=ratio_level == "sequence"))
