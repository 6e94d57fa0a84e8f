"""The global counts of data parallelism."""
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
