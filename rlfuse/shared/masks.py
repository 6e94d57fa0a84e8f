"""The ``[B, T]`` steps of ``policy_loss`` around its objective, shared by both implementations:
the masks that read the current policy (TRL's top-entropy quantile and off-policy sequence
mask), the ratio TRL's importance-weighted KL multiplies by, and the entropy bonus's row
weights."""
from __future__ import annotations

from typing import Optional

import torch

from .aggregation import aggregation_weights

Tensor = torch.Tensor


# --------------------------------------------------------------------------------------------
# The masks that read the current policy, and the ratio of the importance-weighted KL
# --------------------------------------------------------------------------------------------

def top_entropy_mask(entropy: Tensor, mask: Tensor, quantile: float, gather=None) -> Tensor:
    """TRL's ``get_high_entropy_mask`` at ``1 - quantile``: the actor tokens whose entropy is at
    least that quantile of the actor tokens' entropies (``gather``: a function that returns the
    entropies of every process, 1-D)."""
    with torch.no_grad():
        values = entropy[mask].float()
        if gather is not None:
            values = gather(values)
        if values.numel() == 0:
            return torch.zeros_like(mask)
        threshold = torch.quantile(values, 1.0 - quantile)
        return (torch.where(mask, entropy, 0.0) >= threshold) & mask


def off_policy_mask(lp: Tensor, sampling: Tensor, adv: Tensor, mask: Tensor,
                    threshold: float) -> Tensor:
    """TRL's ``get_off_policy_mask``: keeps a token if its advantage is >= 0 or its sequence's
    mean of ``sampling - lp`` (NaN counted as 0) is at most ``threshold``."""
    with torch.no_grad():
        kl = torch.nan_to_num(sampling - lp.detach(), nan=0.0)
        seq = torch.where(mask, kl, 0.0).sum(-1, keepdim=True) / \
            mask.sum(-1, keepdim=True).clamp(min=1.0)
        return ((adv >= 0) | (seq <= threshold)) & mask


def term_ratio(lp: Tensor, old: Tensor, mask: Tensor, ratio: str) -> Tensor:
    """The objective's ratio ``[B, T]`` (or ``[B, 1]``), differentiable: what TRL's
    importance-weighted KL multiplies by (``ratio``: a name of ``_names.RATIO_MODES``)."""
    log_ratio = torch.where(mask, lp - old, 0.0)
    if ratio == "token":
        return torch.exp(log_ratio)
    seq = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    if ratio == "sequence":
        return torch.exp(seq)
    return torch.exp(lp - lp.detach() + seq.detach().clamp(max=10.0))


def gather_entropies(group: Optional[object]):
    """The ``gather`` of ``top_entropy_mask`` over a process group (None: none)."""
    if group is None:
        return None
    from ..scaleout.data_parallel import gather_values

    return lambda values: gather_values(values, group)


# --------------------------------------------------------------------------------------------
# policy_loss's shared steps: the masks into the weights, the entropy bonus's row weights
# --------------------------------------------------------------------------------------------

def apply_masks(args, lp: Tensor, entropy: Optional[Tensor], old: Optional[Tensor],
                weights: Optional[Tensor]):
    """``(weights, entropy mask, metrics)``: the objective's weights times the masks of
    ``args`` (``api.policy_loss.PolicyLossArgs``) that read the current policy, the actor tokens the
    entropy bonus covers, and the share of actor tokens each mask keeps (and the entropy mask's
    mean entropy, ``entropy_kept``)."""
    mask = args.mask
    dtype = lp.dtype
    tokens = mask.sum().clamp_min(1)
    keep = mask
    entropy_mask = mask
    metrics = {}
    if args.entropy_mask is not None:
        group = gather_entropies(args.entropy_mask.process_group)
        entropy_mask = top_entropy_mask(entropy.detach(), mask, args.entropy_mask.quantile,
                                        group)
        keep = keep & entropy_mask
        metrics["entropy_mask_frac"] = entropy_mask.sum().to(dtype) / tokens
        kept = entropy_mask.sum().clamp_min(1)   # the mean entropy over the tokens it keeps
        metrics["entropy_kept"] = torch.where(entropy_mask, entropy.detach(), 0.0).sum() / kept
    if args.off_policy_mask is not None:
        sampling = args.off_policy_mask.sampling_logprobs
        sampling = (lp.detach() if old is None else old) if sampling is None else sampling
        adv = args.advantages
        adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv
        kept = off_policy_mask(lp, sampling.to(dtype), adv, mask,
                               args.off_policy_mask.threshold)
        keep = keep & kept
        metrics["off_policy_mask_frac"] = kept.sum().to(dtype) / tokens
    if keep is not mask:
        weights = keep.to(dtype) if weights is None else weights.to(dtype) * keep
    return weights, entropy_mask, metrics


def _term_weights(term, args, mask: Tensor, dtype: torch.dtype) -> Optional[Tensor]:
    """A term's row weights ``[B]`` over ``mask`` (its coefficient and the loss scale included)
    by its own aggregation, or the objective's when it names none; None without the term."""
    if term is None:
        return None
    own = term if term.agg is not None else args
    return term.coef * args.loss_scale * aggregation_weights(
        mask, own.agg, dtype, num_tokens=own.num_tokens, num_sequences=own.num_sequences,
        counts=args.counts)


def entropy_weights(args, mask: Tensor, dtype: torch.dtype) -> Optional[Tensor]:
    """The entropy bonus's row weights ``[B]`` over ``mask``, None without one."""
    return _term_weights(args.entropy, args, mask, dtype)


def kl_weights(args, mask: Tensor, dtype: torch.dtype) -> Optional[Tensor]:
    """The KL penalty's row weights ``[B]`` over ``mask``, None without one."""
    return _term_weights(args.kl, args, mask, dtype)
