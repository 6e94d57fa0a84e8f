"""The batch-level objectives of ``policy_loss``, which need every log-prob of a sequence or of
the batch first (GMPO's ``geo_mean``, TRL's ``vespo`` and sequence-level CISPO, verl's
``clip_cov`` and ``kl_cov``, written as those trainers write them): ``[B, T]`` math shared by
both implementations, each of which forms the log-probs its own way, then calls this.
"""
from __future__ import annotations

import math
from typing import Dict, Tuple

import torch

from ..checks.values import check_clip, check_positive, check_sides

Tensor = torch.Tensor


def verl_masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """verl's ``masked_mean``: ``sum(x M) / (sum M + 1e-8)``."""
    return torch.where(mask, x, torch.zeros_like(x)).sum() / (mask.sum() + 1e-8)


def _token_sum(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, x, torch.zeros_like(x)).sum(-1)


# --------------------------------------------------------------------------------------------
# The batch-level objectives: (loss, metrics) of [B, T] learner log-probs ``lp`` (with grad),
# ``old`` ([B, T], 0 off the mask), ``adv`` ([B] or [B, T]), ``weights`` (None or [B, T]), the
# aggregation's row weights ``row_scale`` [B] (its loss_scale included)
# --------------------------------------------------------------------------------------------

def geo_mean(objective, lp, old, adv, mask, weights, row_scale, *, loss_scale, num_sequences,
             generator) -> Tuple[Tensor, Dict[str, Tensor]]:
    """GMPO as verl's ``compute_policy_loss_geo_mean`` computes it; the loss is the mean over
    the ``num_sequences`` (default B) sequences, whatever the aggregation."""
    low, high = check_sides("clip", objective.clip, check_positive)
    adv = _per_token(adv, mask)
    log_ratio = torch.where(mask, lp - old, 0.0)
    sign = torch.sign(adv)
    clamped = log_ratio.clamp(-low, high)
    chosen = sign * torch.minimum(sign * log_ratio, sign * clamped)
    tokens = mask.sum(-1)
    ratio = torch.exp(_token_sum(chosen, mask) / (tokens + 1e-8))
    seq_adv = _token_sum(adv, mask) / (tokens + 1e-8)
    losses = -seq_adv * ratio
    if weights is not None:
        log_w = torch.log(weights + 1e-10)
        losses = losses * torch.exp(_token_sum(log_w, mask) / (tokens + 1e-8))
    rows = max(lp.shape[0], 1) if num_sequences is None else num_sequences
    loss = loss_scale * losses.sum() / rows
    with torch.no_grad():
        clipped = log_ratio != clamped
        metrics = {"clip_frac_high": verl_masked_mean((clipped & (adv > 0)).to(lp.dtype), mask),
                   "clip_frac_low": verl_masked_mean((clipped & (adv < 0)).to(lp.dtype), mask),
                   "approx_kl": verl_masked_mean(-log_ratio, mask)}
    return loss, metrics


# TRL's VESPO clamps its log-weights to [log 1e-8, 20]
_VESPO_LOG_MIN, _VESPO_LOG_MAX = math.log(1e-8), 20.0


def vespo(objective, lp, old, adv, mask, weights, row_scale, *, loss_scale, num_sequences,
          generator) -> Tuple[Tensor, Dict[str, Tensor]]:
    """TRL's VESPO (``GRPOTrainer.get_gamma_weights``): ``J = sg(phi) A lp`` with
    ``log phi = lambda + k log w - lambda w``, ``log w`` the sequence's sum of log-ratios
    (clamped to +-20 each) plus its log importance ratios (``weights``, clamped to
    [log 1e-8, 20]), clamped to [log 1e-8, 20]; k and lambda by the sign of A (A >= 0:
    positive)."""
    with torch.no_grad():
        log_ratio = torch.where(mask, (lp - old).clamp(-20.0, 20.0), 0.0)
        seq = log_ratio.sum(-1, keepdim=True)
        if weights is not None:
            log_is = torch.log(weights).clamp(_VESPO_LOG_MIN, _VESPO_LOG_MAX)
            seq = seq + torch.where(mask, log_is, 0.0).sum(-1, keepdim=True)
        log_w = seq.clamp(_VESPO_LOG_MIN, _VESPO_LOG_MAX)
        per_row = adv.dim() == 1
        adv = _per_token(adv, mask)
        nonneg = adv >= 0
        full = torch.full_like
        k = torch.where(nonneg, full(adv, objective.k_pos), full(adv, objective.k_neg))
        lam = torch.where(nonneg, full(adv, objective.lambda_pos),
                          full(adv, objective.lambda_neg)).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(0.0, 0.0, 0.0)
    values = torch.where(mask, -phi * adv * lp, 0.0)
    loss = (values.sum(-1) * row_scale).sum()
    tokens = mask.sum().clamp_min(1)
    with torch.no_grad():   # TRL's phi_seq_mean: over the sequences (per-row advantages)
        phi_mean = phi[:, 0].mean() if per_row and len(phi) else \
            torch.where(mask, phi, 0.0).sum() / tokens
        metrics = {"phi_mean": phi_mean,
                   "approx_kl": torch.where(mask, old - lp.detach(), 0.0).sum() / tokens}
    return loss, metrics


def _per_token(adv: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, adv.unsqueeze(-1).expand(mask.shape) if adv.dim() == 1 else adv,
                       0.0)


def _ppo_terms(objective, lp, old, adv):
    low, high = check_clip("clip", objective.clip)
    ratio = torch.exp(lp - old)
    return -adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high)


def _centred_product(adv, lp, mask):
    return (adv - verl_masked_mean(adv, mask)) * (lp - verl_masked_mean(lp.detach(), mask))


def clip_cov(objective, lp, old, adv, mask, weights, row_scale, *, loss_scale, num_sequences,
             generator) -> Tuple[Tensor, Dict[str, Tensor]]:
    """Clip-Cov as verl's ``compute_policy_loss_clip_cov``: among the unclipped actor tokens
    with ``clip_cov_lb < cov < clip_cov_ub``, ``max(1, int(clip_cov_ratio N))`` chosen by
    ``torch.randperm(n, generator=generator)`` (the default generator: verl's own draw) lose
    their gradient and value."""
    adv = _per_token(adv, mask)
    pg1, pg2 = _ppo_terms(objective, lp, old, adv)
    with torch.no_grad():
        clipped = (pg2 > pg1) & mask
        cov = _centred_product(adv, lp.detach(), mask)
        cov = cov.masked_fill(~mask | clipped, -math.inf)
        n_cut = max(int(objective.clip_cov_ratio * mask.sum().item()), 1)
        candidates = torch.nonzero((cov < objective.clip_cov_ub) &
                                   (cov > objective.clip_cov_lb) & mask)
        keep = torch.ones_like(adv)
        if len(candidates):
            chosen = torch.randperm(len(candidates), generator=generator)
            cut = candidates[chosen[:min(n_cut, len(candidates))].to(candidates.device)]
            keep[cut[:, 0], cut[:, 1]] = 0
    values = torch.maximum(pg1, pg2) * keep
    if weights is not None:
        values = values * weights
    loss = (torch.where(mask, values, 0.0).sum(-1) * row_scale).sum()
    with torch.no_grad():
        metrics = {"cut_frac": verl_masked_mean((keep == 0).to(lp.dtype), mask),
                   "approx_kl": verl_masked_mean(old - lp.detach(), mask)}
    return loss, metrics


def kl_cov(objective, lp, old, adv, mask, weights, row_scale, *, loss_scale, num_sequences,
           generator) -> Tuple[Tensor, Dict[str, Tensor]]:
    """KL-Cov as verl's ``compute_policy_loss_kl_cov``: ``-r A`` everywhere, plus
    ``ppo_kl_coef |lp - old|`` at the ``max(1, int(kl_cov_ratio N))`` actor tokens of largest
    centred product of advantage and log-prob (``torch.topk`` on the CPU, as verl)."""
    adv = _per_token(adv, mask)
    log_ratio = lp - old
    ratio = torch.exp(log_ratio)
    values = -adv * ratio
    with torch.no_grad():
        flat = torch.nonzero(mask.reshape(-1), as_tuple=True)[0]
        adv_v = adv[mask].detach().reshape(-1).cpu()
        lp_v = lp[mask].detach().reshape(-1).cpu()
        chosen = torch.zeros_like(mask)
        if len(adv_v):
            cov = (adv_v - adv_v.mean()) * (lp_v - lp_v.mean())
            n = max(1, int(len(cov) * objective.kl_cov_ratio))
            top = flat[torch.topk(cov, n, largest=True).indices.to(flat.device)]
            chosen.view(-1)[top] = True
    values = torch.where(chosen, values + objective.ppo_kl_coef * log_ratio.abs(), values)
    if weights is not None:
        values = values * weights
    loss = (torch.where(mask, values, 0.0).sum(-1) * row_scale).sum()
    with torch.no_grad():
        metrics = {"approx_kl": verl_masked_mean(log_ratio.detach().abs(), mask)}
    return loss, metrics


def cispo_trl(objective, lp, old, adv, mask, weights, row_scale, *, loss_scale, num_sequences,
              generator) -> Tuple[Tensor, Dict[str, Tensor]]:
    """TRL's CISPO at the sequence level: ``J = sg(min(s, epsilon_high)) A lp`` with the
    sequence ratio ``s = exp(mean_t (lp - old))``."""
    adv = _per_token(adv, mask)
    log_ratio = torch.where(mask, lp - old, 0.0).detach()
    seq = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    coef = torch.exp(seq).clamp(max=objective.epsilon_high)
    values = -coef * adv * lp
    if weights is not None:
        values = values * weights
    loss = (torch.where(mask, values, 0.0).sum(-1) * row_scale).sum()
    tokens = mask.sum().clamp_min(1)
    with torch.no_grad():
        high = ((seq > math.log(objective.epsilon_high)) & (adv > 0) & mask).to(lp.dtype)
        metrics = {"clip_frac_high": high.sum() / tokens,
                   # the mean over the sequences (TRL's cispo_clip_ratio at this level)
                   "clip_frac_high_seq_mean": (high.sum(-1) / mask.sum(-1).clamp_min(1)).mean()
                   if high.shape[0] else high.new_zeros(()),
                   "approx_kl": -log_ratio.sum() / tokens}
    return loss, metrics


BATCH_OBJECTIVES = {"geo_mean": geo_mean, "vespo": vespo, "clip_cov": clip_cov,
                    "kl_cov": kl_cov, "cispo_trl": cispo_trl}
