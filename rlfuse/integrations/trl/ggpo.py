"""GGPO's batches in ``rlfuse.integrations.trl``, as the paper trains: the rewards themselves
(whatever TRL's scaling), the groups whose rewards all agree left out, micro-batches of whole
groups, and the token count of each optimizer step's whole minibatch (every micro-batch of the
step, every process), the paper's normaliser whatever ``loss_type``."""
from __future__ import annotations

from typing import List, Tuple

import torch


def ggpo_rewards(per_func: torch.Tensor, weights: torch.Tensor, group_size: int,
                 mixed_only: bool, mine: slice) -> Tuple[torch.Tensor, torch.Tensor, float]:
    """``(rewards, kept, dropped)`` of this process's rows ``mine`` of TRL's gathered
    ``[N, functions]`` rewards: the weighted sum of the reward functions centred in each group
    (GGPO is invariant to a constant per group), an unscorable completion at its group's
    mean; ``kept``: the rows of the groups trained on (with ``mixed_only``: those whose
    rewards are not all equal); ``dropped``: the share of every process's groups left out."""
    rewards = (per_func * weights.to(per_func.device)).nansum(dim=1)
    rewards[torch.isnan(per_func).all(dim=1)] = torch.nan
    groups = rewards.view(-1, group_size)
    means = torch.nanmean(groups, dim=1, keepdim=True)
    filled = torch.where(torch.isnan(groups), means, groups)
    centred = torch.nan_to_num(filled - means, nan=0.0).reshape(-1)
    kept = torch.ones(groups.shape[0], dtype=torch.bool, device=groups.device)
    if mixed_only:      # all equal, or none scorable: the group is left out
        kept = filled.amax(1) > filled.amin(1)
    dropped = 1.0 - kept.float().mean().item()
    return centred[mine], kept.repeat_interleave(group_size)[mine], dropped


def shuffle_groups(batch: dict, group_size: int) -> dict:
    """The rows of a generation batch shuffled by whole groups of ``group_size`` rows."""
    n = next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim())
    groups = torch.randperm(n // group_size)
    order = (groups[:, None] * group_size + torch.arange(group_size)).reshape(-1)
    return {k: v[order.to(v.device)] if isinstance(v, torch.Tensor) and v.dim() and
            v.shape[0] == n else v for k, v in batch.items()}


STEP_TOKENS = "rlfuse_step_tokens"


def loss_mask(inputs: dict) -> torch.Tensor:
    """The tokens a loss takes: TRL's completion mask (and tool mask)."""
    mask = inputs["completion_mask"]
    if "tool_mask" in inputs:
        mask = mask * inputs["tool_mask"]
    return mask.bool()


def with_step_tokens(batches: List[dict], accumulation: int, mask_of, total) -> List[dict]:
    """The micro-batches of a generation batch, each with the token count of its optimizer
    step's whole minibatch (``STEP_TOKENS``: the ``accumulation`` micro-batches of the step,
    summed by ``total`` over the processes); ``mask_of(batch)``: its tokens' mask."""
    counts = total(torch.stack([mask_of(b).sum() for b in batches]).float())
    steps = counts.view(-1, accumulation).sum(1)
    return [dict(b, **{STEP_TOKENS: steps[i // accumulation]}) for i, b in enumerate(batches)]
