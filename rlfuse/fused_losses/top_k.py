"""A ``TopK`` teacher's side of distillation: the student's log-probs at the teacher's ids
under the student's whole softmax, ``[B, T, k]``, with their gradient (verl's top-k forward
KL is then ``[B, T, k]`` arithmetic, ``reference.distill.top_k_divergence``).

- ``rlfuse::logprobs_at``, a ``Logits`` student: ``token_logprobs``' row kernel gives each
  row's max, log-sum and entropy from one read of the row, the k logits are gathered; the
  backward reads the row once and writes it once, then adds the k terms at the ids;
- ``rlfuse::linear_logprobs_at``, a ``LinearHead`` student: the same on each chunk of
  tokens' logits, formed in fp32 by one matmul (as ``linear_distill``'s), the backward
  forming the chunk again and writing its gradient in place, then turning it into the
  gradients of the hidden states, weight and bias at once. No ``[N, V]`` tensor exists.

Masked rows' ids are never read (the callers pass 0 there) and get a zero gradient.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .._types import compute_dtype
from ..kernels.lib.head_functions import HeadParams
from ..kernels.rows.logprobs import STAT_COLUMNS, token_logprobs_bwd, token_logprobs_fwd
from ..scaleout.vocab import combine_shards, group_of, group_sum, shard_targets
from ..shared.head import scaled_logits
from ._op import custom_op, register_backward_op
from .head.head_matmuls import HeadChunks
from .head.linear_head import head_gradients_fake, register_head_autograd


def _logits_at(rows: Tensor, ids: Tensor, head: HeadParams, dtype: torch.dtype) -> Tensor:
    """The logits ``[..., k]`` at ``ids [..., k]`` of the raw logits ``rows [..., V]`` in the
    units the row statistics keep them in (``HeadParams.inv_temp``: a head's softcap applied),
    in ``dtype``."""
    x = rows.gather(-1, ids)
    return scaled_logits(x, head.logit_scale, head.softcap) if head.softcap else x.to(dtype)


def _log_probs_at(x: Tensor, stats: Tensor, head: HeadParams) -> Tensor:
    """The log-probs of the logits ``x [..., k]`` (``_logits_at``) of rows whose statistics
    (``STAT_COLUMNS``) are ``stats [..., 2]``."""
    return (x - stats[..., :1]) * head.inv_temp - stats[..., 1:]


def _add_at_ids(dlogits: Tensor, raw: Optional[Tensor], ids: Tensor, dlogp: Tensor,
                head: HeadParams) -> None:
    """``dlogits [..., V] += dlogp ∂z/∂x`` at ``ids [..., k]``, ``z = softcap(logit_scale x) /
    temperature`` (``raw [..., k]``: the raw logits there, read only by a softcap)."""
    factor = dlogp * head.inv_temp
    if head.softcap:
        t = torch.tanh(raw.to(factor.dtype) * (head.logit_scale / head.softcap))
        factor = factor * head.logit_scale * (1.0 - t * t)
    dlogits.scatter_add_(-1, ids, factor.to(dlogits.dtype))


def _stats_fake(like: Tensor, ids: Tensor, mask: Tensor):
    acc = compute_dtype(like.dtype)
    return (like.new_empty(ids.shape, dtype=acc), like.new_empty(mask.shape, dtype=acc),
            like.new_empty((mask.numel(), len(STAT_COLUMNS)), dtype=acc))


def _owned_ids(ids: Tensor, vocab_local: int, group_name: str) -> Tuple[Tensor, Optional[Tensor]]:
    """``(the ids within this rank's shard, 0 for another rank's; which ids are this rank's, or
    None for the whole vocabulary)`` (``scaleout.vocab``'s split)."""
    if not group_name:
        return ids, None
    local, _ = shard_targets(ids, vocab_local, group_name)
    return local.clamp_min(0), local >= 0


def whole_rows(stats: Tensor, entropy: Tensor, head: HeadParams, group_name: str
                ) -> Tuple[Tensor, Tensor]:
    """``(stats [N, 2], entropy [N])`` of the whole rows from this shard's (one all-gather,
    ``vocab.combine_shards``); unchanged without a group."""
    if not group_name:
        return stats, entropy
    shard = torch.stack([torch.zeros_like(stats[:, 0]), stats[:, 0], stats[:, 1],
                         entropy.reshape(-1)], -1)
    no_owner = torch.zeros(stats.shape[0], dtype=torch.long, device=stats.device)
    _, m, log_s, whole = combine_shards(shard, no_owner, head.inv_temp, group_of(group_name))
    return torch.stack([m, log_s], -1), whole


def _at_owned_ids(x: Tensor, owned: Optional[Tensor], group_name: str) -> Tensor:
    """The log-probs at the ids from their owners' shards (0 elsewhere), summed over the group
    (one all-reduce); unchanged without a group."""
    if owned is None:
        return x
    x = torch.where(owned, x, 0.0)
    group_sum(x, group_name)
    return x


def _upstream(dlogp: Tensor, mask: Tensor, dtype: torch.dtype) -> Tensor:
    """The upstream gradient, 0 in masked rows (whatever the teacher's log-probs held there)."""
    return torch.where(mask.unsqueeze(-1), dlogp.to(dtype), 0.0)


# --------------------------------------------------------------------------------------------
# A Logits student
# --------------------------------------------------------------------------------------------

@custom_op("logprobs_at")
def logprobs_at_op(logits: Tensor, ids: Tensor, mask: Tensor, temperature: float, offset: int,
                   group_name: str = "") -> Tuple[Tensor, Tensor, Tensor]:
    """``(log-probs [B, T, k], entropy [B, T], stats [B T, 2])``: each window row's log-probs
    at its ``ids [B, T, k]`` (int64) under the whole softmax of ``logits [B, S, V]`` (rows
    ``[offset, offset + T)``) at ``temperature``; ``group_name``: ``logits`` is this rank's
    shard of a vocabulary split over that group (``ids`` global; the statistics all-gathered,
    the log-probs all-reduced from the ids' owners)."""
    head = HeadParams(temperature)
    local, owned = _owned_ids(ids, logits.shape[-1], group_name)
    _, stats, entropy = token_logprobs_fwd(logits, local[..., 0], mask, head, True, offset)
    stats, entropy = whole_rows(stats, entropy, head, group_name)
    window = logits[:, offset:offset + mask.shape[1]]
    x = _logits_at(window, local, head, stats.dtype)
    logp = _at_owned_ids(_log_probs_at(x, stats.view(*mask.shape, 2), head), owned, group_name)
    return logp, torch.where(mask, entropy.view(mask.shape), 0.0), stats


@logprobs_at_op.register_fake
def _(logits, ids, mask, temperature, offset, group_name=""):
    return _stats_fake(logits, ids, mask)


@custom_op("logprobs_at_backward")
def logprobs_at_backward_op(logits: Tensor, ids: Tensor, mask: Tensor, stats: Tensor,
                            dlogp: Tensor, temperature: float, offset: int,
                            group_name: str = "") -> Tensor:
    """The gradient of ``logprobs_at_op``'s whole ``logits`` (a shard's, with ``group_name``:
    no collective) for ``dlogp [B, T, k]``: ``Σ_k g_k (1[v = id_k] − p_v) ∂z/∂x``, the row
    kernel writing the ``p_v`` term (no target) in one read and one write of the row, then the
    k terms added at the ids (this shard's)."""
    head = HeadParams(temperature)
    dlogp = _upstream(dlogp, mask, stats.dtype)
    local, owned = _owned_ids(ids, logits.shape[-1], group_name)
    no_target = torch.full(mask.shape, -1, dtype=torch.long, device=mask.device)
    dlogits = token_logprobs_bwd(logits, no_target, mask, head, stats, None, dlogp.sum(-1),
                                 None, offset=offset)
    _add_at_ids(dlogits[:, offset:offset + mask.shape[1]], None, local,
                dlogp if owned is None else torch.where(owned, dlogp, 0.0), head)
    return dlogits


@logprobs_at_backward_op.register_fake
def _(logits, ids, mask, stats, dlogp, temperature, offset, group_name=""):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


register_backward_op(logprobs_at_op, logprobs_at_backward_op, ("logits", "ids", "mask"),
                     ("temperature", "offset", "group_name"),
                     lambda ctx, call: {"logits": call()})


# --------------------------------------------------------------------------------------------
# A LinearHead student, chunk by chunk
# --------------------------------------------------------------------------------------------

@custom_op("linear_logprobs_at")
def linear_logprobs_at_op(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], ids: Tensor,
                          mask: Tensor, temperature: float, logit_scale: float, softcap: float,
                          offset: int, chunk_tokens: int, gather: bool, batch_invariant: bool,
                          group_name: str = "") -> Tuple[Tensor, Tensor, Tensor]:
    """``logprobs_at_op``'s outputs for a head (``hidden [B, S, H]``, ``weight [V, H]``,
    ``bias``; its logit scale and softcap, 0: none) over chunks of ``chunk_tokens`` positions
    (with ``gather``: the actor positions only); ``batch_invariant``: the fixed-order matmul;
    ``group_name``: ``weight`` is this rank's shard of a vocabulary split over that group (the
    chunks' statistics combined once after them)."""
    acc = compute_dtype(hidden.dtype)
    B, T, k = ids.shape
    x = torch.zeros((B * T, k), dtype=acc, device=hidden.device)
    entropy = torch.zeros(B * T, dtype=acc, device=hidden.device)
    stats = torch.zeros((B * T, len(STAT_COLUMNS)), dtype=acc, device=hidden.device)
    local, owned = _owned_ids(ids, weight.shape[0], group_name)
    ids_flat, m_flat = local.view(-1, k), mask.reshape(-1)
    head = HeadParams(temperature, logit_scale, softcap)
    chunks = HeadChunks(hidden, weight, bias, mask, mask, offset, chunk_tokens, gather,
                        batch_invariant=batch_invariant, fp32=True)
    for chunk in chunks:
        tokens = chunk.tokens
        logits = chunks.logits(chunk)
        ids_c = ids_flat[tokens]
        _, stats_c, entropy_c = token_logprobs_fwd(logits, ids_c[:, :1], m_flat[tokens, None],
                                                   head, True)
        x[tokens] = _logits_at(logits[:, 0], ids_c, head, acc)
        stats[tokens], entropy[tokens] = stats_c, entropy_c[:, 0]
    stats, entropy = whole_rows(stats, entropy, head, group_name)
    logp = _at_owned_ids(_log_probs_at(x, stats, head).view(B, T, k), owned, group_name)
    return logp, torch.where(mask, entropy.view(B, T), 0.0), stats


@linear_logprobs_at_op.register_fake
def _(hidden, weight, bias, ids, mask, *args):
    return _stats_fake(hidden, ids, mask)


@custom_op("linear_logprobs_at_backward")
def linear_logprobs_at_backward_op(hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
                                   ids: Tensor, mask: Tensor, stats: Tensor, dlogp: Tensor,
                                   temperature: float, logit_scale: float, softcap: float,
                                   offset: int, chunk_tokens: int, gather: bool,
                                   batch_invariant: bool, group_name: str, needs: List[bool]
                                   ) -> Tuple[Tensor, Tensor, Tensor]:
    """``(dhidden, dweight, dbias)`` (empty where not needed) of ``linear_logprobs_at_op`` for
    ``dlogp [B, T, k]``: each chunk's logits formed again, their gradient written in place
    (with ``group_name``: this shard's, the hidden states' summed over the group)."""
    chunks = HeadChunks(hidden, weight, bias, mask, mask, offset, chunk_tokens, gather,
                        batch_invariant=batch_invariant, fp32=True, needs=needs,
                        group_name=group_name)
    k = ids.shape[-1]
    local, owned = _owned_ids(ids, weight.shape[0], group_name)
    ids_flat, m_flat = local.view(-1, k), mask.reshape(-1)
    dlogp = _upstream(dlogp, mask, stats.dtype)
    totals = dlogp.sum(-1).view(-1)        # the p_v term: every id's, whichever rank owns it
    dlogp = (dlogp if owned is None else torch.where(owned, dlogp, 0.0)).view(-1, k)
    head = HeadParams(temperature, logit_scale, softcap)
    for chunk in chunks:
        tokens = chunk.tokens
        logits = chunks.logits(chunk)
        ids_c = ids_flat[tokens]
        raw = logits[:, 0].gather(-1, ids_c) if softcap else None
        no_target = torch.full((len(tokens), 1), -1, dtype=torch.long, device=mask.device)
        token_logprobs_bwd(logits, no_target, m_flat[tokens, None], head, stats[tokens], None,
                           totals[tokens, None], None, logits)
        _add_at_ids(logits[:, 0], raw, ids_c, dlogp[tokens], head)
        chunks.add(chunk, logits.to(weight.dtype))
    return chunks.gradients()


@linear_logprobs_at_backward_op.register_fake
def _(hidden, weight, bias, ids, mask, stats, dlogp, *args):
    return head_gradients_fake(hidden, weight, bias, args[-1])


_LINEAR_FIELDS = ("temperature", "logit_scale", "softcap", "offset", "chunk_tokens", "gather",
                  "batch_invariant", "group_name")


register_head_autograd(linear_logprobs_at_op, linear_logprobs_at_backward_op,
                       ("hidden", "weight", "bias", "ids", "mask"), _LINEAR_FIELDS)
