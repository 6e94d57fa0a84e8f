"""Reference GGPO: the stable Gibbs (log-mean-exp) gap of KL-adjusted rewards."""
from __future__ import annotations

import math

import torch

from .._types import LossOutput
from ..shared.aggregation import k3_kl_mean, masked_mean
from .logprobs import learner_logprobs


def ggpo(policy, args, ref_logprobs: torch.Tensor, rewards: torch.Tensor,
         validate: bool) -> LossOutput:
    """GGPO's loss and metrics (``rlfuse.ggpo_loss``) of checked ``args``
    (``api.ggpo.GGPOArgs``)."""
    mask, m, beta, rho = args.mask, args.group_size, args.beta, args.clip_radius
    loss_scale, num_tokens = args.loss_scale, args.num_tokens
    batch, device, cdt = args.info.shape[0], args.info.device, args.info.compute_dtype
    lp = torch.where(mask, learner_logprobs(policy, mask, validate=validate).to(cdt), 0.0)
    ref = torch.where(mask, ref_logprobs.to(cdt), 0.0)
    t_tok = num_tokens if num_tokens is not None else mask.sum().clamp_min(1).to(cdt)

    def centred(x: torch.Tensor) -> torch.Tensor:        # [B] -> [G, m], minus the group mean
        x = x.reshape(-1, m)
        return x - x.mean(-1, keepdim=True)

    s, s_ref = lp.sum(-1), ref.sum(-1)
    reward_z = centred(rewards.to(cdt)) / beta
    z = reward_z - centred(s - s_ref)                    # (R_i − mean_g R) / β
    gap = torch.logsumexp(z, -1) - math.log(m)           # J_g / β
    norm = math.sqrt(m - 1)

    if rho is None:
        loss = loss_scale * m * gap.sum() / (norm * t_tok)
        q = torch.softmax(z.detach(), -1)
        clip_frac = torch.zeros((), dtype=cdt, device=device)
    else:
        with torch.no_grad():
            log_ratio = lp - ref
            d = torch.where(mask, log_ratio.clamp(-rho, rho), 0.0)
            q = torch.softmax(reward_z - centred(d.sum(-1)), -1)
            c = ((m * q - 1.0) / norm).reshape(-1)
            clip_frac = masked_mean((log_ratio.abs() > rho).to(cdt), mask)
        loss = -loss_scale * (c * s).sum() / t_tok

    with torch.no_grad():
        metrics = {
            "gap": gap.mean() if gap.numel() else gap.new_zeros(()),
            "q_max": q.max() if q.numel() else q.new_zeros(()),
            "clip_frac": clip_frac,
            "seq_logratio_mean": (s - s_ref).mean() if batch else s.new_zeros(()),
            "kl": k3_kl_mean(lp.detach(), ref, mask),
        }
    return LossOutput(loss, metrics)
