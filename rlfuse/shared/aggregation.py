"""The ``[B, T]`` sums and means both implementations share: broadcasts, the aggregation
weights (written once, used by the reference's sums and the kernels' row weights alike),
masked means, the per-sequence shares and the KL metric, GR-OPD's clamped feedback, discounted
sums and group credit.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch

from .._types import SequenceCounts


def per_token(x: torch.Tensor, shape) -> torch.Tensor:
    """A ``[B]`` (per sequence) or ``[B, T]`` tensor as ``[B, T]`` (a broadcast view)."""
    return x.unsqueeze(-1).expand(shape) if x.dim() == 1 else x


def aggregation_weights(mask: torch.Tensor, agg: str, dtype: torch.dtype, *,
                        num_tokens: Optional[float] = None,
                        num_sequences: Optional[float] = None,
                        counts: Optional[SequenceCounts] = None) -> torch.Tensor:
    """The weight ``w_b`` of every token of row ``b`` (``[B]``) under the aggregation ``agg``
    (verl's ``agg_loss`` names): ``agg(x) = sum_bt M_bt x_bt w_b`` with

        token-mean               w = 1 / N_tok
        seq-mean-token-mean      w = 1 / (T_b N_seq)
        seq-mean-token-sum       w = 1 / N_seq
        seq-mean-token-sum-norm  w = 1 / (T N_seq)       (Dr. GRPO; T = mask.shape[-1])
        token-sum                w = 1

    ``N_tok = num_tokens`` (default: the local ``sum M``), ``N_seq = num_sequences`` (default:
    the local ``B``, empty rows included), ``T_b = sum_t M_bt``; the counts may be numbers or
    0-dim tensors. A zero local count is replaced by 1 (the sum it divides is then 0). With
    ``counts`` (chunks of whole sequences), ``T_b``, the default ``N_tok`` and ``T`` are the
    whole sequences'.
    """
    B, T = mask.shape
    tokens = mask.sum(-1, dtype=dtype)
    if counts is not None:
        tokens, T = counts.tokens.to(dtype), counts.length
    ones = torch.ones_like(tokens)
    if agg == "token-sum":
        return ones
    if agg == "token-mean":
        return ones / (tokens.sum().clamp_min(1) if num_tokens is None else num_tokens)
    n_seq = num_sequences if num_sequences is not None else max(B, 1)
    if agg == "seq-mean-token-mean":
        return ones / (tokens.clamp_min(1) * n_seq)
    if agg == "seq-mean-token-sum":
        return ones / n_seq
    return ones / (T * n_seq)  # seq-mean-token-sum-norm


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the actor positions (0 when there are none); ``x`` may be garbage off
    the mask."""
    return torch.where(mask, x, torch.zeros_like(x)).sum() / mask.sum().clamp_min(1)


# The flags whose per-sequence shares are metrics too: their extremes (TRL's clip_ratio/low_min,
# /high_max) and their mean over the sequences (TRL's clip_ratio/*_mean of a sequence-level
# ratio): flag -> (the extreme, its reduction, what a sequence without tokens counts as there;
# the mean)
SEQUENCE_SHARES = {
    "clip_frac_low": ("clip_frac_low_seq_min", torch.amin, math.inf, "clip_frac_low_seq_mean"),
    "clip_frac_high": ("clip_frac_high_seq_max", torch.amax, -math.inf,
                       "clip_frac_high_seq_mean")}


def sequence_shares(flag_sums: Dict[str, torch.Tensor],
                    tokens: torch.Tensor) -> Dict[str, torch.Tensor]:
    """For each flag of ``SEQUENCE_SHARES`` in ``flag_sums`` (``[B]``: a flag's count per
    sequence, ``tokens [B]`` its actor tokens), the least / greatest share over the sequences
    with tokens (0 when there are none) and the mean share over every sequence (one without
    tokens: 0); no host sync."""
    out = {}
    has = tokens > 0
    for flag, (name, pick, empty, mean_name) in SEQUENCE_SHARES.items():
        if flag not in flag_sums:
            continue
        share = flag_sums[flag] / tokens.clamp_min(1)
        if share.numel() == 0:
            out[name] = out[mean_name] = share.new_zeros(())
            continue
        value = pick(torch.where(has, share, empty))
        out[name] = torch.where(has.any(), value, 0.0)
        out[mean_name] = share.mean()
    return out


def k3_kl_mean(lp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean over actor tokens of the k3 estimate of KL(pi || pi_ref), ``e^d - d - 1`` with
    ``d = ref - lp`` (TRL's ``kl`` metric) clamped to +-20 (as ``approx_kl``: finite in fp32),
    detached; garbage off the mask never enters, and the sum's order is the layout's own."""
    with torch.no_grad():
        lp, ref, mask = lp.contiguous(), ref.contiguous(), mask.contiguous()
        d = torch.where(mask, ref.to(lp.dtype) - lp, torch.zeros_like(lp)).clamp(-20.0, 20.0)
        return masked_mean(torch.expm1(d) - d, mask)


def discounted_sums(feedback: torch.Tensor, mask: torch.Tensor,
                    gamma: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """GR-OPD's discounted sums over the actor tokens of each row of ``[..., T]``:
    ``(sum_k gamma^(k-1) r_k, sum_k gamma^(k-1))``, ``k`` the 1-based index of an actor token
    within its row (``feedback`` 0 off the mask)."""
    k = mask.to(feedback.dtype).cumsum(-1)
    weight = torch.where(mask, torch.pow(gamma, k - 1.0), 0.0)   # γ^{k−1}, restarts per row
    return (weight * feedback).sum(-1), weight.sum(-1)


def group_credit(score: torch.Tensor, group_size: int, lam: float, adv_clip: float,
                 std_eps: float) -> torch.Tensor:
    """GR-OPD's advantages ``[B]`` of the sequences' scores: ``clamp((S - mu + lam mu) /
    (sigma + std_eps), +-adv_clip)`` with the group's mean and population std."""
    score = score.reshape(-1, group_size)
    mu = score.mean(-1, keepdim=True)
    sigma = (score - mu).square().mean(-1, keepdim=True).sqrt()   # population std (ddof = 0)
    return ((score - mu + lam * mu) / (sigma + std_eps)).clamp(-adv_clip, adv_clip).reshape(-1)


def clamped_feedback(old: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor,
                     feedback_clip: float) -> torch.Tensor:
    """GR-OPD's ``r_it = clamp(teacher_lp - old_lp, +-feedback_clip)`` at actor tokens, 0
    elsewhere."""
    return torch.where(mask, (teacher - old).clamp(-feedback_clip, feedback_clip), 0.0)
