"""What data parallelism gathers: the global counts, and values of every rank."""
from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist
from torch import Tensor


def global_counts(mask: Tensor, group=None) -> Tuple[Tensor, Tensor]:
    """``(num_tokens, num_sequences)`` of ``mask [B, T]`` summed over the data-parallel
    ``group`` in one all-reduce: what each rank passes to a loss so that the micro-batches of
    all ranks average as one batch. Sequences count when they have an actor token.

    Args:
        mask: ``[B, T]`` bool (or 0/1): this rank's response tokens.
        group: the data-parallel process group (None: the whole world; without an initialised
            ``torch.distributed``, the local counts).
    """

    mask = mask.bool()
    counts = torch.stack([mask.sum(), mask.any(-1).sum()]).to(torch.float64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts, group=group)
    return counts[0], counts[1]


def gather_values(values: Tensor, group) -> Tensor:
    """The 1-D ``values`` of every rank of ``group``, concatenated in rank order (ranks may hold
    different counts: one all-gather of the counts, one of the values padded to the largest)."""
    if not (dist.is_available() and dist.is_initialized()):
        return values
    size = dist.get_world_size(group)
    count = torch.tensor([values.numel()], device=values.device)
    counts = [torch.empty_like(count) for _ in range(size)]
    dist.all_gather(counts, count, group=group)
    counts = [int(c) for c in counts]
    padded = values.new_zeros(max(counts))
    padded[:values.numel()] = values
    gathered = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(gathered, padded, group=group)
    return torch.cat([g[:n] for g, n in zip(gathered, counts)])
