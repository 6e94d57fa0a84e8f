"""A matmul whose every output element is reduced in one fixed order, whatever the shapes:
``C = A @ B (+ bias) (+ C)`` over tiles of a fixed size (no split-K, no choice by the number of
rows), each element's sum over K taken block by block in increasing K. A row of ``C`` then
depends on its row of ``A`` alone, bit for bit, whatever the other rows (their number, their
values, the row's position): the batch-invariant head's logits and hidden-state gradient
(``LinearHead(..., batch_invariant=True)``), and, summing over the rows in a fixed order, its
weight gradient, the same run to run (no atomics).

fp32 inputs are multiplied in full fp32 (``input_precision="ieee"``: no TF32), bf16 / fp16 on
the tensor cores, fp64 without them (``fixed_dot``); the sums are fp32 (fp64 for fp64 inputs),
rounded once to the output's dtype.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..lib.utils import INTERPRET, tl_compute_dtype

# One tile configuration for every shape (the invariance: a row's order of operations may not
# depend on how many rows there are).
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32
NUM_WARPS = 8


@triton.jit
def fixed_tile(a_ptr, b_ptr, rm, rn, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
               IEEE: tl.constexpr, UPCAST: tl.constexpr, ACC: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """The tile ``A[rm, :] @ B[:, rn]`` of fp32 (``ACC``) sums, over K block by block in
    increasing order (rows and columns outside ``M`` / ``N`` give 0): every kernel that forms
    the batch-invariant head's products forms its tiles here, so they are the same bits."""
    acc = tl.zeros((rm.shape[0], rn.shape[0]), dtype=ACC)
    for start in range(0, K, BLOCK_K):
        rk = start + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rm[:, None].to(tl.int64) * stride_am + rk[None, :] * stride_ak,
                    mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + rk[:, None].to(tl.int64) * stride_bk + rn[None, :] * stride_bn,
                    mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc += fixed_dot(a, b, IEEE, UPCAST)
    return acc


@triton.jit
def fixed_dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` as the fixed-order matmul multiplies (``dot_modes``): fp32 in full precision,
    16-bit floats on the tensor cores, fp64 as the sum over K of the broadcast products, in one
    fixed tree order (no fp64 ``tl.dot``: Triton 3.3 and 3.4 have none, and 3.6 cannot lower
    one whose operand is another product's result, "fp64 don't support largeK MMA"; fp64 is
    the testing dtype)."""
    if a.dtype == tl.float64:
        product = tl.sum(a[:, :, None] * b[None, :, :], axis=1)
    elif UPCAST:   # the interpreter multiplies no 16-bit floats: the exact products in fp32
        product = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        product = tl.dot(a, b, input_precision="ieee")
    else:
        product = tl.dot(a, b)
    return product


@triton.jit(do_not_specialize=["M", "K"])   # one binary for any row count
def _matmul_kernel(
    a_ptr, b_ptr, bias_ptr, c_ptr,                                       # pointers
    M, N, K,                                                             # sizes
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,    # strides
    HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = fixed_tile(a_ptr, b_ptr, rm, rn, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                     IEEE, UPCAST, ACC, BLOCK_K)
    inside = (rm[:, None] < M) & (rn[None, :] < N)
    c_at = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :] * stride_cn
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(ACC)[None, :]
    if ACCUMULATE:
        acc += tl.load(c_at, mask=inside, other=0.0).to(ACC)
    tl.store(c_at, acc.to(c_ptr.dtype.element_ty), mask=inside)


def dot_modes(dtype: torch.dtype):
    """``(IEEE, UPCAST)`` of ``fixed_tile`` for inputs of ``dtype``: fp32 / fp64 in full
    precision (no TF32), 16-bit floats on the tensor cores (in the interpreter: cast to fp32,
    whose products of them are exact)."""
    sixteen = dtype in (torch.bfloat16, torch.float16)
    return not sixteen, INTERPRET and sixteen


def fixed_matmul(a: torch.Tensor, b: torch.Tensor, *, bias: Optional[torch.Tensor] = None,
                 out: Optional[torch.Tensor] = None, dtype: Optional[torch.dtype] = None,
                 accumulate: bool = False) -> torch.Tensor:
    """``a [M, K] @ b [K, N]`` (+ ``bias [N]``) in the fixed order of this module, into ``out``
    (added to it with ``accumulate``) or a new ``[M, N]`` tensor of ``dtype`` (default:
    ``a``'s); any strides. ``a`` and ``b`` share a dtype."""
    M, K = a.shape
    N = b.shape[1]
    if out is None:
        out = torch.empty((M, N), dtype=dtype or a.dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _matmul_kernel[grid](
        a, b, out if bias is None else bias, out,
        M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, ACCUMULATE=accumulate, IEEE=dot_modes(a.dtype)[0],
        UPCAST=dot_modes(a.dtype)[1], ACC=tl_compute_dtype(a.dtype),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS,
    )
    return out
