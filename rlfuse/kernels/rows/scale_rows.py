"""The single pass's backward (``surrogate.surrogate_logits_fwd`` writes ``dlogits`` for an
upstream gradient of 1): the actor rows of that buffer multiplied in place by the upstream
gradient, read on the device, so that a gradient of 1 costs no pass over them and no host
sync; and a ``LinearHead``'s weight and bias gradients, accumulated in fp32 by the forward,
scaled by it and cast to the parameters' dtype in the same pass (``scale_cast``)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..lib.row_functions import at, program_token
from ..lib.utils import mask_args, tl_compute_dtype, vocab_launch_config


@triton.jit
def _scale_rows_kernel(
    # pointers
    x_ptr, mask_ptr, scale_ptr,  # [B, S, V] in and out, [B, T] uint8, 0-dim
    # strides
    stride_xb, stride_xt, stride_mb, stride_mt,
    # sizes
    T, S, offset, V,
    BLOCK_V: tl.constexpr, ACC: tl.constexpr,
):
    # x[b, s] *= scale at actor rows (the others hold zeros), in the compute dtype; the scale is
    # read on the device, and when it is 1 no row is read or written.
    _, b, s, _, _, is_actor = program_token(tl.program_id(0), mask_ptr, T, S, offset, stride_mb,
                                            stride_mt, True)
    scale = tl.load(scale_ptr).to(ACC)
    if (scale != 1.0) & is_actor:
        row_ptr = x_ptr + at(b, stride_xb, s, stride_xt)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            x = tl.load(row_ptr + cols, mask=cols < V).to(ACC)
            tl.store(row_ptr + cols, (x * scale).to(x_ptr.dtype.element_ty), mask=cols < V)


def scale_rows(dlogits: torch.Tensor, mask: torch.Tensor, grad: torch.Tensor,
               offset: int = 0) -> None:
    """Multiplies the actor rows of the single pass's ``dlogits [B, S, V]``
    (``stride(-1) == 1``; rows ``[offset, offset + T)`` go with ``mask [B, T]``) by the 0-dim
    upstream ``grad`` in place, without reading it on the host: a gradient of 1 costs no pass
    over ``dlogits``."""
    B, S, V = dlogits.shape
    T = mask.shape[1]
    if B * S == 0:
        return
    block_v, num_warps = vocab_launch_config(V, dlogits.element_size())
    mask_u8, stride_mb, stride_mt = mask_args(mask)
    _scale_rows_kernel[(B * S,)](
        dlogits, mask_u8, grad,
        dlogits.stride(0), dlogits.stride(1), stride_mb, stride_mt,
        T, S, offset, V,
        BLOCK_V=block_v, ACC=tl_compute_dtype(dlogits.dtype), num_warps=num_warps,
    )


@triton.jit
def _scale_cast_kernel(
    # pointers
    x_ptr, scale_ptr, out_ptr,  # [n] fp32 / fp64 in, 0-dim, [n] out in its dtype
    # sizes
    n,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    x = tl.load(x_ptr + offs, mask=inside)
    scale = tl.load(scale_ptr).to(x.dtype)
    tl.store(out_ptr + offs, (x * scale).to(out_ptr.dtype.element_ty), mask=inside)


def scale_cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(x * scale).to(dtype)`` in one pass, rounded once: a head's fp32 gradient accumulator
    (contiguous) times the 0-dim upstream gradient, read on the device, into a new tensor of
    the parameter's dtype."""
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    n = x.numel()
    if n:
        block = 1024
        _scale_cast_kernel[(triton.cdiv(n, block),)](x, scale, out, n, BLOCK=block)
    return out
