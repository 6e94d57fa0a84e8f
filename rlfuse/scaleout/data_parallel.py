"""What data parallelism gathers: the global counts, and values of every rank."""
from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist
from torch import Tensor


def global_counts(mask: Tensor, group=None,
                  context_parallel_group=None) -> Tuple[Tensor, Tensor]:
    """``(num_tokens, num_sequences)`` of ``mask [B, T]`` summed over the data-parallel
    ``group``: what each rank passes to a loss so that the micro-batches of all ranks average as
    one batch. Sequences count when they have an actor token.

    Under context parallelism each rank of ``context_parallel_group`` holds chunks of the same
    ``B`` sequences (Megatron's ``get_batch_on_this_cp_rank``: any chunks, any layout): the
    sequences' tokens are summed over that group first (one all-reduce of ``[B]``), so that a
    sequence counts once whichever ranks hold its actor tokens; every rank of both groups then
    gets the same counts.

    Args:
        mask: ``[B, T]`` bool (or 0/1): this rank's response tokens (under context
            parallelism: of its chunks of the sequences).
        group: the data-parallel process group, whose ranks hold other sequences (Megatron's
            ``get_data_parallel_group()``; None: the whole world, or without an initialised
            ``torch.distributed`` the local counts; given whenever
            ``context_parallel_group`` is).
        context_parallel_group: the ranks that hold chunks of the same sequences (None: none).
    """
    initialised = dist.is_available() and dist.is_initialized()
    if context_parallel_group is not None and not initialised:
        raise ValueError("context_parallel_group: torch.distributed is not initialised")
    if context_parallel_group is not None and group is None:
        raise ValueError("group: with a context_parallel_group, pass the data-parallel group "
                         "(the ranks that hold other sequences; the whole world would count "
                         "every sequence once per context-parallel rank)")
    per_sequence = mask.bool().sum(-1).to(torch.float64)
    if context_parallel_group is not None:
        dist.all_reduce(per_sequence, group=context_parallel_group)
    counts = torch.stack([per_sequence.sum(), (per_sequence > 0).sum().to(torch.float64)])
    if initialised:
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
