"""What rlfuse's losses in verl share (``rlfuse.integrations.verl``): verl's loss aggregation
as rlfuse's arguments, its clip, a row's value from its tokens, and the metric that says whether
the fused kernels ran."""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

import rlfuse


def verl_aggregation(loss_agg_mode: str, response_mask: torch.Tensor,
                     global_batch_info: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """rlfuse's ``agg``, ``num_tokens``, ``num_sequences`` and ``loss_scale`` that reproduce
    verl's ``agg_loss(loss_mat, loss_mask, loss_agg_mode, **global_batch_info)``.

    verl multiplies by the data-parallel size what it divides by a global count; rlfuse divides
    by the count over ``dp_size``. Without a global count, verl's ``seq-mean-*`` modes divide by
    the rows that hold a token (rlfuse's default is every row), and ``token-mean`` by the local
    tokens; ``seq-mean-token-sum-norm`` divides by ``loss_scale_factor`` (default: the padded
    length, rlfuse's own divisor).
    """
    info = dict(global_batch_info or {})
    dp_size = info.get("dp_size", 1) or 1
    out: Dict[str, Any] = {"agg": loss_agg_mode, "loss_scale": 1.0}
    if loss_agg_mode == "token-sum":
        out["loss_scale"] = float(dp_size)
    elif loss_agg_mode == "token-mean":
        tokens = info.get("batch_num_tokens")
        if tokens is None and dp_size > 1:
            raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
        out["num_tokens"] = None if tokens is None else tokens / dp_size
    else:
        rows = info.get("global_batch_size")
        if rows is None and dp_size > 1:
            raise ValueError("global_batch_size is required when dp_size > 1")
        if rows is None:   # verl: the rows that hold a token
            rows = (response_mask.sum(-1) > 0).sum().to(torch.float32)
        out["num_sequences"] = rows / dp_size
        factor = info.get("loss_scale_factor")
        if loss_agg_mode == "seq-mean-token-sum-norm" and factor is not None:
            out["loss_scale"] = response_mask.shape[-1] / factor
    return out


def verl_clip(config) -> Tuple[float, float]:
    """``(low, high)`` of verl's actor config: ``clip_ratio_low`` / ``clip_ratio_high``, each
    ``clip_ratio`` where unset."""
    eps = config.clip_ratio
    low = config.clip_ratio_low if config.clip_ratio_low is not None else eps
    high = config.clip_ratio_high if config.clip_ratio_high is not None else eps
    return low, high


def row_values(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]``: the value a row's tokens carry, from verl's ``[B, T]`` broadcast of a per-row
    quantity (an estimator's advantages) read at the row's first token of ``mask`` (bool)."""
    first = mask.to(torch.int8).argmax(-1, keepdim=True)
    return per_token.gather(-1, first).squeeze(-1)


def fused_metric(x: torch.Tensor) -> Dict[str, float]:
    """``actor/rlfuse_fused``: 1.0 where rlfuse's kernels ran on ``x``'s device, 0.0 where its
    plain-torch reference did (``rlfuse.use_kernels``), in the step's metrics."""
    return {"actor/rlfuse_fused": float(rlfuse.use_kernels(x.device))}
