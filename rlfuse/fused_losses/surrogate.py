"""Autograd Functions of the clipped surrogate shared by GPPO and GR-OPD, and the aggregation
weights they share with the reference."""
from __future__ import annotations

from typing import Optional

import torch

from .._types import Logits
from .logprobs import as_rows


def row_scales(mask: torch.Tensor, agg: str, dtype: torch.dtype, *,
               num_tokens: Optional[float] = None,
               num_sequences: Optional[float] = None) -> torch.Tensor:
    """The loss weight of every token of each row ``[B]``: the aggregation ``agg`` (verl's
    names) as ``loss = -sum_bt M_bt J_bt scale_b``; see ``rlfuse.reference.gppo_loss``."""
    B, T = mask.shape
    tokens = mask.sum(-1, dtype=dtype)
    n_seq = float(num_sequences) if num_sequences is not None else max(B, 1)
    if agg == "token-mean":
        n_tok = tokens.sum().clamp_min(1) if num_tokens is None else float(num_tokens)
        return (torch.ones_like(tokens) / n_tok)
    if agg == "seq-mean-token-mean":
        return 1.0 / (tokens.clamp_min(1) * n_seq)
    if agg == "seq-mean-token-sum":
        return torch.full_like(tokens, 1.0 / n_seq)
    return torch.full_like(tokens, 1.0 / (T * n_seq))  # seq-mean-token-sum-norm


def _raise_on_overflow(sums: torch.Tensor, column: int) -> None:
    # One host sync: the only way to refuse an inf/NaN loss rather than return it.
    n = int(sums[..., column].sum().item())
    if n:
        raise ValueError(
            f"policy: the unclipped surrogate r*A overflows the compute dtype at {n} actor "
            f"token(s) (log-ratio lp - old_lp too large); the importance ratio is not "
            f"representable, refusing to return inf/NaN")


class SurrogateFunction(torch.autograd.Function):
    """``(loss, sums [B, N_SUM_COLS])`` from learner log-probs ``lp [B, T]``."""

    @staticmethod
    def forward(ctx, lp, old_lp, adv, mask, row_scale, geometry_code, topology_code, delta):
        from ..kernels import surrogate as k

        region = dict(geometry_code=geometry_code, topology_code=topology_code, delta=delta)
        sums = k.surrogate_fwd(lp.detach(), old_lp, adv, mask, row_scale, **region)
        _raise_on_overflow(sums, k.SUM_OVERFLOW)
        ctx.save_for_backward(lp.detach(), old_lp, adv, mask, row_scale)
        ctx.region = region
        ctx.mark_non_differentiable(sums)
        return -sums[:, k.SUM_LOSS].sum(), sums

    @staticmethod
    def backward(ctx, grad_loss, _grad_sums):
        from ..kernels.surrogate import surrogate_bwd

        lp, old_lp, adv, mask, row_scale = ctx.saved_tensors
        dlp = surrogate_bwd(lp, old_lp, adv, mask, row_scale, grad_loss.to(row_scale.dtype),
                            **ctx.region)
        return dlp, None, None, None, None, None, None, None


class SurrogateLogitsFunction(torch.autograd.Function):
    """``(loss, sums [B*T, N_SUM_COLS])`` straight from logits, in one pass that also writes
    ``dlogits`` (kept until the backward, or written into the logits when ``inplace``)."""

    @staticmethod
    def forward(ctx, logits, targets, mask, old_lp, adv, row_scale, temperature, geometry_code,
                topology_code, delta, inplace):
        from ..kernels import surrogate as k

        logits3, targets3, mask3 = as_rows(logits, targets, mask)
        write = ctx.needs_input_grad[0]
        dlogits, sums = k.surrogate_logits(
            logits3.detach(), targets3, mask3, old_lp, adv, row_scale, temperature=temperature,
            geometry_code=geometry_code, topology_code=topology_code, delta=delta,
            write_dlogits=write, dlogits=logits3.detach() if inplace and write else None)
        _raise_on_overflow(sums, k.SUM_OVERFLOW)
        ctx.save_for_backward(dlogits)
        ctx.logits_shape = logits.shape
        ctx.mark_non_differentiable(sums)
        return -sums[:, k.SUM_LOSS].sum(), sums

    @staticmethod
    def backward(ctx, grad_loss, _grad_sums):
        (dlogits,) = ctx.saved_tensors
        # dlogits was written for an upstream gradient of 1; rescaling costs one more pass.
        if not torch.equal(grad_loss, torch.ones_like(grad_loss)):
            dlogits.mul_(grad_loss)
        return (dlogits.view(ctx.logits_shape),) + (None,) * 10


def surrogate_loss(policy, old_lp, adv, mask, row_scale, *, geometry_code, topology_code,
                   delta):
    """``(loss, column totals [N_SUM_COLS])`` of the clipped surrogate for either policy form."""
    region = (geometry_code, topology_code, float(delta))
    if isinstance(policy, Logits):
        loss, sums = SurrogateLogitsFunction.apply(
            policy.logits, policy.targets, mask, old_lp, adv, row_scale,
            float(policy.temperature), *region, bool(policy.inplace_backward))
    else:
        loss, sums = SurrogateFunction.apply(policy, old_lp, adv, mask, row_scale, *region)
    return loss, sums.sum(0)
