"""Context parallelism (Megatron's): each rank of a ``context_parallel_group`` of ``cp`` ranks
holds two of the ``2 cp`` equal chunks of every sequence, rank r the chunks r and ``2 cp - 1 -
r`` back to back (``megatron.core.utils.get_batch_on_this_cp_rank``'s load-balanced layout):
its ``[B, T]`` loss inputs are ``[B, 2 c]`` of sequences of ``2 cp c`` positions.

A loss under context parallelism forms this rank's log-probs (and entropies) as it would
alone: from ``[B, T]`` log-probs, logits or a head, nothing larger than ``[B, T]`` crosses
ranks. A token-local objective runs in place on the fused path (``in_place``): the whole
sequences' counts (``sequence_counts``, one all-reduce of ``[B]``) give the aggregation's
weights, and the metrics' sums are summed over the group (``group_sums``). Otherwise those
log-probs and the other ``[B, T]`` inputs are gathered over the group into whole sequences
(``whole_sequences``: one all-gather of the log-probs and entropies, one of every other input),
and the loss of whole sequences runs on every rank as on one process: every sequence- and
batch-level quantity (per-sequence ratios, group statistics, quantiles) is exact, and every
rank gets the same metrics. Each rank returns ``loss / cp`` (``share``): the ranks' losses sum
to one process's loss, and the gather's backward (an all-reduce of the ``[B, T]`` gradient,
this rank's positions kept) gives each rank that loss's gradient at its own positions.
Per-chunk values (GR-OPD's discounted sums) travel as ``[B, 2]`` (``gather_chunks``).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Dict, List, Optional

import torch
from torch import Tensor

from .._types import LossOutput, SequenceCounts


def context_size(group) -> int:
    """The number of ranks of ``group`` (ValueError without an initialised
    ``torch.distributed``)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("context_parallel_group: torch.distributed is not initialised")
    return dist.get_world_size(group)


def _flag_device(group, device: Optional[torch.device]) -> torch.device:
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu") if device is None else device


@contextlib.contextmanager
def agreed(group, mask):
    """Runs the checks of its block on every rank of ``group``, then one all-gather of each
    rank's verdict and ``[B, T]``: a rank whose checks raised raises its error, every other rank
    a ValueError naming it; ranks of different ``[B, T]`` or an odd ``T`` (not two equal chunks)
    raise on every rank. Nothing of the loss's own collectives starts before."""
    import torch.distributed as dist

    cp = context_size(group)
    shape = tuple(mask.shape) if isinstance(mask, Tensor) and mask.dim() == 2 else (-1, -1)
    error = None
    try:
        yield
    except (ValueError, TypeError) as exc:
        error = exc
    device = _flag_device(group, mask.device if isinstance(mask, Tensor) else None)
    mine = torch.tensor([error is not None, *shape], dtype=torch.int64, device=device)
    verdicts = [torch.empty_like(mine) for _ in range(cp)]
    dist.all_gather(verdicts, mine, group=group)
    verdicts = [tuple(int(v) for v in verdict.tolist()) for verdict in verdicts]
    if error is not None:
        raise error
    failed = [rank for rank, verdict in enumerate(verdicts) if verdict[0]]
    if failed:
        raise ValueError(f"context_parallel_group: the arguments of rank(s) {failed} of the "
                         f"group were refused (their error names them)")
    shapes = [verdict[1:] for verdict in verdicts]
    if len(set(shapes)) != 1:
        raise ValueError(f"mask: under context parallelism every rank holds the same [B, T] "
                         f"(its two chunks of the same B sequences); got {shapes} over the "
                         f"ranks of context_parallel_group")
    if shape[1] % 2:
        raise ValueError(f"mask: under context parallelism each rank holds two equal chunks "
                         f"of every sequence (Megatron's layout: a sequence of 2 cp chunks), "
                         f"so T is even; got T = {shape[1]}")


def _sequences(parts: List[Tensor]) -> Tensor:
    """Every rank's ``[B, 2c, ...]`` (rank order) as the whole ``[B, 2 cp c, ...]``."""
    cp, c = len(parts), parts[0].shape[1] // 2
    chunks: List[Optional[Tensor]] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        chunks[rank], chunks[2 * cp - 1 - rank] = part[:, :c], part[:, c:]
    return torch.cat(chunks, 1)


def own_positions(whole: Tensor, rank: int, cp: int) -> Tensor:
    """Rank ``rank``'s two chunks of the whole ``[B, 2 cp c, ...]`` (its ``[B, 2c, ...]``)."""
    c = whole.shape[1] // (2 * cp)
    return torch.cat([whole[:, rank * c:(rank + 1) * c],
                      whole[:, (2 * cp - 1 - rank) * c:(2 * cp - rank) * c]], 1)


def _all_gather(x: Tensor, group) -> List[Tensor]:
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


class GatherSequences(torch.autograd.Function):
    """``[B, 2c, ...]`` of every rank as whole sequences; backward: the gradient summed over
    the group (one all-reduce), this rank's positions of it."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return _sequences(_all_gather(x, group))

    @staticmethod
    def backward(ctx, grad: Tensor):
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return own_positions(grad, dist.get_rank(ctx.group),
                             dist.get_world_size(ctx.group)), None


def _gather_detached(tensors: Dict[str, Optional[Tensor]], group) -> Dict[str, Tensor]:
    """The ``[B, T]`` tensors of ``tensors`` (None and others left as they are) as whole
    sequences, in one all-gather (each as fp64, exact for every dtype, then its own)."""
    names = [k for k, v in tensors.items() if v is not None]
    if not names:
        return dict(tensors)
    packed = torch.stack([tensors[k].detach().to(torch.float64) for k in names], -1)
    whole = _sequences(_all_gather(packed, group))
    out = dict(tensors)
    for i, name in enumerate(names):
        out[name] = whole[..., i].to(tensors[name].dtype)
    return out


@dataclasses.dataclass
class WholeSequences:
    """A loss's inputs over whole sequences: the learner log-probs (differentiable), their
    entropies (or None), the mask and the other ``[B, T]`` inputs by name."""

    logprobs: Tensor
    entropy: Optional[Tensor]
    mask: Tensor
    tensors: Dict[str, Optional[Tensor]]


def whole_sequences(impl, group, policy, mask: Tensor, tensors: Dict[str, Optional[Tensor]], *,
                    validate: bool, return_entropy: bool = False) -> WholeSequences:
    """This rank's log-probs (and entropies) of ``policy`` (checked: ``[B, T]`` log-probs,
    ``Logits`` or ``LinearHead``) by ``impl``, and ``mask`` and ``tensors`` (``[B, T]`` ones
    gathered, any other shape kept), as whole sequences over ``group``."""
    if isinstance(policy, Tensor):
        logp, entropy = policy, None
    else:
        logp, entropy = impl.window_logprobs(policy, mask, validate=validate,
                                             return_entropy=return_entropy)
    if return_entropy:
        both = GatherSequences.apply(torch.stack([logp, entropy.to(logp.dtype)], -1), group)
        logp, entropy = both[..., 0], both[..., 1].to(entropy.dtype)
    else:
        logp, entropy = GatherSequences.apply(logp, group), None
    shape = tuple(mask.shape)
    token_level = {k: v for k, v in tensors.items()
                   if isinstance(v, Tensor) and tuple(v.shape) == shape}
    gathered = _gather_detached({"mask": mask, **token_level}, group)
    return WholeSequences(logp, entropy, gathered.pop("mask"), {**tensors, **gathered})


def with_sampling(off_policy_mask, sampling: Optional[Tensor]):
    """``off_policy_mask`` (an ``rlfuse.terms.OffPolicyMask`` or None) with its sampling
    log-probs replaced."""
    if off_policy_mask is None or off_policy_mask.sampling_logprobs is None:
        return off_policy_mask
    return dataclasses.replace(off_policy_mask, sampling_logprobs=sampling)


def gather_chunks(x: Tensor, group) -> Tensor:
    """Per-chunk values ``[B, 2, ...]`` of this rank's two chunks, every rank's, in the
    sequences' order: ``[B, 2 cp, ...]`` (one all-gather)."""
    return _sequences(_all_gather(x, group))


def in_place(args) -> bool:
    """Whether a loss of ``args`` (``api.policy_loss.PolicyLossArgs``) may run on this rank's chunks
    alone: a token-local objective without the masks that read the whole batch, whose
    sequence-level parts are the aggregation's weights (``sequence_counts``) and the metrics'
    sums (``group_sums``)."""
    return args.objective.ratio == "token" and args.entropy_mask is None and \
        args.off_policy_mask is None


def sequence_counts(mask: Tensor, group) -> SequenceCounts:
    """The whole sequences' counts of this rank's chunks: each sequence's actor tokens summed
    over ``group`` (one all-reduce of ``[B]``), their length ``2 cp c``."""
    import torch.distributed as dist

    tokens = mask.sum(-1, dtype=torch.float64)
    dist.all_reduce(tokens, group=group)
    return SequenceCounts(tokens, mask.shape[-1] * context_size(group))


def group_sums(totals: Dict[str, Tensor], sums: Tensor, group):
    """``(totals, sums)`` (column totals by name, per-sequence sums ``[B, C]``) summed over
    ``group``, in one all-reduce."""
    import torch.distributed as dist

    names = list(totals)
    flat = torch.cat([torch.stack([totals[k].to(sums.dtype) for k in names]), sums.flatten()])
    dist.all_reduce(flat, group=group)
    return dict(zip(names, flat[:len(names)].unbind())), flat[len(names):].view_as(sums)


def share(out: LossOutput, group) -> LossOutput:
    """This rank's share of the loss of whole sequences: ``loss / cp`` (metrics as they are:
    the same on every rank)."""
    return LossOutput(out.loss / context_size(group), out.metrics)
