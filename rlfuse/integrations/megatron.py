"""rlfuse in Megatron-core: the output layer's log-probs and entropy, and any rlfuse loss, from
the last hidden state and the output layer's vocabulary shard, without ``[s, b, V / tp]``
logits.

    from rlfuse.integrations import megatron as rlfuse_megatron

    # in a forward_step, in place of output_layer(hidden) and the cross entropy
    head = rlfuse_megatron.output_head(hidden, model.output_layer.weight, labels,
                                       sequence_parallel=config.sequence_parallel)
    out = rlfuse.policy_loss(head, old_logprobs, advantages, loss_mask, "clip")
    logp, entropy = rlfuse_megatron.logprobs_and_entropy(hidden, weight, labels, ...)

Megatron's layouts: ``hidden [s, b, h]`` (with sequence parallelism ``[s / tp, b, h]``, this
rank's contiguous slice of the rows), ``weight [V / tp, h]`` (``output_layer.weight``, or the
tied embedding's ``shared_embedding_or_output_weight()``), ``labels [b, s]`` (global ids), the
tensor-parallel group from ``parallel_state`` unless given. Rank r's shard holds the ids ``[r V
/ tp, (r + 1) V / tp)``; Megatron's padded vocabulary (a multiple of
``make_vocab_size_divisible_by x tp``) takes part in the softmax as in Megatron's own
``vocab_parallel_cross_entropy``, whose padding columns are not masked either. Every rank of
the group gets every row's results (``[b, s]``, fp32) and the same loss; the gradients are those
of one process: the hidden states' at this rank's rows (summed over the group in fp32), the
weight's and the bias's at its shard. The losses' ``[b, s]`` inputs (``old_logprobs``,
``advantages``, the mask) are those of every row.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

import rlfuse

__all__ = ["logprobs_and_entropy", "output_head"]


def _tensor_parallel_group(tp_group):
    """``tp_group``, else Megatron's tensor-parallel group (None: no model parallelism set up,
    or a group of one)."""
    if tp_group is None:
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            return None
        tp_group = parallel_state.get_tensor_model_parallel_group()
    import torch.distributed as dist

    return tp_group if dist.get_world_size(tp_group) > 1 else None


def output_head(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                bias: Optional[torch.Tensor] = None, temperature: float = 1.0,
                sequence_parallel: bool = False, tp_group=None,
                chunk_tokens: Optional[int] = None) -> rlfuse.LinearHead:
    """The policy of Megatron's output layer as an ``rlfuse.LinearHead`` for any rlfuse loss
    (the module's layouts): ``hidden [s, b, h]`` (``[s / tp, b, h]`` with
    ``sequence_parallel``), ``weight [V / tp, h]``, ``labels [b, s]``; the loss positions are
    ``[b, s]``."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        raise ValueError(f"hidden: expected Megatron's [s, b, h] (or [s / tp, b, h] with "
                         f"sequence_parallel), got "
                         f"{tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else hidden}")
    group = _tensor_parallel_group(tp_group)
    parts = 1 if group is None or not sequence_parallel else \
        torch.distributed.get_world_size(group)
    expected = (hidden.shape[1], hidden.shape[0] * parts)
    if not isinstance(labels, torch.Tensor) or tuple(labels.shape) != expected:
        got = tuple(labels.shape) if isinstance(labels, torch.Tensor) else labels
        raise ValueError(f"labels: expected [b, s] = {expected} for hidden "
                         f"{tuple(hidden.shape)} over {parts} sequence-parallel rank(s), got "
                         f"{got}")
    return rlfuse.LinearHead(hidden.transpose(0, 1), weight, labels, bias,
                             temperature=temperature, chunk_tokens=chunk_tokens,
                             vocab_parallel_group=group,
                             sequence_parallel=bool(sequence_parallel) and group is not None)


def logprobs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         bias: Optional[torch.Tensor] = None, temperature: float = 1.0,
                         sequence_parallel: bool = False, tp_group=None,
                         validate: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(log-probs, entropy)`` ``[b, s]`` (fp32, differentiable) of ``labels`` under Megatron's
    output layer (``output_head``'s arguments)."""
    head = output_head(hidden, weight, labels, bias=bias, temperature=temperature,
                       sequence_parallel=sequence_parallel, tp_group=tp_group)
    return rlfuse.policy_logprobs(head, return_entropy=True, validate=validate)
