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
from ..kernels.head import HeadParams
from ..kernels.logprobs import STAT_COLUMNS, token_logprobs_bwd, token_logprobs_fwd
from ..shared.head import scaled_logits
from ._op import custom_op, register_autograd
from .head_matmuls import HeadGradients, chunk_logits
from .linear_head import Rows, head_gradients, head_gradients_fake


def _at_ids(rows: Tensor, ids: Tensor, stats: Tensor, head: HeadParams) -> Tensor:
    """The log-probs ``[..., k]`` at ``ids [..., k]`` of the raw logits ``rows [..., V]`` whose
    statistics (``STAT_COLUMNS``, in the units of ``HeadParams.inv_temp``) are ``stats [...,
    2]``."""
    x = rows.gather(-1, ids)
    x = scaled_logits(x, head.logit_scale, head.softcap) if head.softcap \
        else x.to(stats.dtype)
    m, log_s = stats[..., :1], stats[..., 1:]
    return (x - m) * head.inv_temp - log_s


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


def _upstream(dlogp: Tensor, mask: Tensor, dtype: torch.dtype) -> Tensor:
    """The upstream gradient, 0 in masked rows (whatever the teacher's log-probs held there)."""
    return torch.where(mask.unsqueeze(-1), dlogp.to(dtype), 0.0)


# --------------------------------------------------------------------------------------------
# A Logits student
# --------------------------------------------------------------------------------------------

@custom_op("logprobs_at")
def logprobs_at_op(logits: Tensor, ids: Tensor, mask: Tensor, temperature: float,
                   offset: int) -> Tuple[Tensor, Tensor, Tensor]:
    """``(log-probs [B, T, k], entropy [B, T], stats [B T, 2])``: each window row's log-probs
    at its ``ids [B, T, k]`` (int64) under the whole softmax of ``logits [B, S, V]`` (rows
    ``[offset, offset + T)``) at ``temperature``."""
    head = HeadParams(temperature)
    _, stats, entropy = token_logprobs_fwd(logits, ids[..., 0], mask, head, True, offset)
    window = logits[:, offset:offset + mask.shape[1]]
    return _at_ids(window, ids, stats.view(*mask.shape, 2), head), entropy, stats


@logprobs_at_op.register_fake
def _(logits, ids, mask, temperature, offset):
    return _stats_fake(logits, ids, mask)


@custom_op("logprobs_at_backward")
def logprobs_at_backward_op(logits: Tensor, ids: Tensor, mask: Tensor, stats: Tensor,
                            dlogp: Tensor, temperature: float, offset: int) -> Tensor:
    """The gradient of ``logprobs_at_op``'s whole ``logits`` for ``dlogp [B, T, k]``:
    ``Σ_k g_k (1[v = id_k] − p_v) ∂z/∂x``, the row kernel writing the ``p_v`` term (no
    target) in one read and one write of the row, then the k terms added at the ids."""
    head = HeadParams(temperature)
    dlogp = _upstream(dlogp, mask, stats.dtype)
    no_target = torch.full(mask.shape, -1, dtype=torch.long, device=mask.device)
    dlogits = token_logprobs_bwd(logits, no_target, mask, head, stats, None, dlogp.sum(-1),
                                 None, offset=offset)
    _add_at_ids(dlogits[:, offset:offset + mask.shape[1]], None, ids, dlogp, head)
    return dlogits


@logprobs_at_backward_op.register_fake
def _(logits, ids, mask, stats, dlogp, temperature, offset):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _logprobs_at_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs.logits, inputs.ids, inputs.mask, output[2])
    ctx.fields = (inputs.temperature, inputs.offset)
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.set_materialize_grads(False)


def _logprobs_at_backward(ctx, dlogp, _dentropy, _dstats):
    if dlogp is None:
        return None
    return {"logits": logprobs_at_backward_op(*ctx.saved_tensors, dlogp, *ctx.fields)}


register_autograd(logprobs_at_op, _logprobs_at_backward, _logprobs_at_setup)


# --------------------------------------------------------------------------------------------
# A LinearHead student, chunk by chunk
# --------------------------------------------------------------------------------------------

@custom_op("linear_logprobs_at")
def linear_logprobs_at_op(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], ids: Tensor,
                          mask: Tensor, temperature: float, logit_scale: float, softcap: float,
                          offset: int, chunk_tokens: int, gather: bool,
                          batch_invariant: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """``logprobs_at_op``'s outputs for a head (``hidden [B, S, H]``, ``weight [V, H]``,
    ``bias``; its logit scale and softcap, 0: none) over chunks of ``chunk_tokens`` positions
    (with ``gather``: the actor positions only); ``batch_invariant``: the fixed-order
    matmul."""
    acc = compute_dtype(hidden.dtype)
    B, T, k = ids.shape
    logp = torch.zeros((B * T, k), dtype=acc, device=hidden.device)
    entropy = torch.zeros(B * T, dtype=acc, device=hidden.device)
    stats = torch.zeros((B * T, len(STAT_COLUMNS)), dtype=acc, device=hidden.device)
    h_flat, ids_flat, m_flat = hidden.reshape(-1, hidden.shape[-1]), ids.view(-1, k), \
        mask.reshape(-1)
    head = HeadParams(temperature, logit_scale, softcap)
    for tokens, rows in Rows(hidden, mask, mask, offset, gather).chunks(chunk_tokens):
        logits = chunk_logits(h_flat[rows], weight, bias, batch_invariant, fp32=True)
        ids_c = ids_flat[tokens]
        _, stats_c, entropy_c = token_logprobs_fwd(logits, ids_c[:, :1], m_flat[tokens, None],
                                                   head, True)
        logp[tokens] = _at_ids(logits[:, 0], ids_c, stats_c, head)
        stats[tokens], entropy[tokens] = stats_c, entropy_c[:, 0]
    return logp.view(B, T, k), entropy.view(B, T), stats


@linear_logprobs_at_op.register_fake
def _(hidden, weight, bias, ids, mask, *args):
    return _stats_fake(hidden, ids, mask)


@custom_op("linear_logprobs_at_backward")
def linear_logprobs_at_backward_op(hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
                                   ids: Tensor, mask: Tensor, stats: Tensor, dlogp: Tensor,
                                   temperature: float, logit_scale: float, softcap: float,
                                   offset: int, chunk_tokens: int, gather: bool,
                                   batch_invariant: bool, needs: List[bool]
                                   ) -> Tuple[Tensor, Tensor, Tensor]:
    """``(dhidden, dweight, dbias)`` (empty where not needed) of ``linear_logprobs_at_op`` for
    ``dlogp [B, T, k]``: each chunk's logits formed again, their gradient written in place."""
    grads = HeadGradients(hidden, weight, bias, tuple(needs), batch_invariant=batch_invariant)
    k = ids.shape[-1]
    h_flat, ids_flat, m_flat = hidden.reshape(-1, hidden.shape[-1]), ids.view(-1, k), \
        mask.reshape(-1)
    dlogp = _upstream(dlogp, mask, stats.dtype).view(-1, k)
    head = HeadParams(temperature, logit_scale, softcap)
    for tokens, rows in Rows(hidden, mask, mask, offset, gather).chunks(chunk_tokens):
        h_rows = h_flat[rows]
        logits = chunk_logits(h_rows, weight, bias, batch_invariant, fp32=True)
        ids_c, g = ids_flat[tokens], dlogp[tokens]
        raw = logits[:, 0].gather(-1, ids_c) if softcap else None
        no_target = torch.full((len(tokens), 1), -1, dtype=torch.long, device=mask.device)
        token_logprobs_bwd(logits, no_target, m_flat[tokens, None], head, stats[tokens], None,
                           g.sum(-1, keepdim=True), None, logits)
        _add_at_ids(logits[:, 0], raw, ids_c, g, head)
        grads.add(logits.to(weight.dtype), h_rows, rows)
    return grads.results(hidden, weight)


@linear_logprobs_at_backward_op.register_fake
def _(hidden, weight, bias, ids, mask, stats, dlogp, *args):
    return head_gradients_fake(hidden, weight, bias, args[-1])


_LINEAR_FIELDS = ("temperature", "logit_scale", "softcap", "offset", "chunk_tokens", "gather",
                  "batch_invariant")


def _linear_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs.hidden, inputs.weight, inputs.bias, inputs.ids, inputs.mask,
                          output[2])
    ctx.fields = tuple(getattr(inputs, name) for name in _LINEAR_FIELDS)
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.set_materialize_grads(False)


def _linear_backward(ctx, dlogp, _dentropy, _dstats):
    needs = [bool(n) for n in ctx.needs_input_grad[:3]]
    if dlogp is None or not any(needs):
        return None
    saved = ctx.saved_tensors
    dh, dw, db = linear_logprobs_at_backward_op(*saved, dlogp, *ctx.fields, needs)
    return head_gradients(needs, saved[2] is not None, dh, dw, db)


register_autograd(linear_logprobs_at_op, _linear_backward, _linear_setup)
