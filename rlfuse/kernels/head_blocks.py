"""A batch-invariant head's block statistics straight from its hidden states and weight: each
program forms the logits of ``BLOCK_M`` rows and one vocabulary block of ``VOCAB_BLOCK`` ids
(two tiles of the fixed-order matmul, ``matmul.fixed_tile``, rounded to the logits' dtype as
``matmul.fixed_matmul`` stores them), reduces them to the block's statistics
(``vocab_blocks.block_statistics``) and keeps the target's logit where the block holds it. The
tiles never leave the chip: no ``[C, V]`` tensor, only ``[C, V / VOCAB_BLOCK, 3]`` statistics,
which ``vocab_blocks.combine_blocks`` combines in order. The same bits as the statistics of
``fixed_matmul``'s logits (``vocab_blocks.block_stats``), by construction: the same tiles, the
same rounding, the same reduction.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .head import softcap
from .matmul import BLOCK_K, BLOCK_M, BLOCK_N, NUM_WARPS, dot_modes, fixed_tile
from .utils import empty, fp64_values, tl_compute_dtype
from .vocab_blocks import (BLOCK_COLUMNS, BLOCK_IDS, HALF_BLOCK, VOCAB_BLOCK, block_statistics,
                           half_statistics, store_block)

# a vocabulary block is two of the matmul's column tiles
assert VOCAB_BLOCK == 2 * BLOCK_N


@triton.jit
def _half(h_ptr, w_ptr, bias_ptr, rows, start, C, V, H, stride_hm, stride_hk, stride_wv,
          stride_wk, y, xy_ptr, live, head, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
          WITH_ENTROPY: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
          ACC: tl.constexpr, LOGITS: tl.constexpr, BLOCK_K: tl.constexpr):
    """``half_statistics`` of the logits of ``rows`` and the ``HALF_BLOCK`` columns from
    ``start`` as ``fixed_matmul`` gives them (``LOGITS``: their dtype), through the head's
    softcap, -inf past ``V``; the raw logit of each row whose target ``y`` lies there stored at
    ``xy_ptr + row``."""
    cols = start + tl.arange(0, HALF_BLOCK)
    acc = fixed_tile(h_ptr, w_ptr, rows, cols, C, V, H, stride_hm, stride_hk, stride_wk,
                     stride_wv, IEEE, UPCAST, ACC, BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < V, other=0.0).to(ACC)[None, :]
    logits = acc.to(LOGITS)
    at_target = cols[None, :] == y[:, None]
    hit = live & (y >= start) & (y < start + HALF_BLOCK)
    # one logit of the row where the target lies, zeros elsewhere: the sum is that logit
    x_y = tl.sum(tl.where(at_target, logits.to(ACC), 0.0), axis=1)
    tl.store(xy_ptr + rows, x_y.to(LOGITS), mask=hit)
    x = logits.to(ACC)
    if SOFTCAP:
        x, _ = softcap(x, head[1], head[2], ACC)
    return half_statistics(tl.where(cols[None, :] < V, x, float("-inf")), head[0],
                           WITH_ENTROPY, ACC)


@triton.jit
def _head_blocks_kernel(h_ptr, w_ptr, bias_ptr, y_ptr, blocks_ptr, xy_ptr, C, V, H, NB,
                        stride_hm, stride_hk, stride_wv, stride_wk, head_args,
                        HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
                        WITH_ENTROPY: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                        ACC: tl.constexpr, LOGITS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    # one program per BLOCK_M rows and vocabulary block; blocks [C, NB, 3], xy [C]
    head = fp64_values(head_args, ACC)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    block = tl.program_id(1)
    live = rows < C
    y = tl.load(y_ptr + rows, mask=live, other=-1)
    start = block * BLOCK_IDS
    first = _half(h_ptr, w_ptr, bias_ptr, rows, start, C, V, H, stride_hm, stride_hk,
                  stride_wv, stride_wk, y, xy_ptr, live, head, HAS_BIAS, SOFTCAP, WITH_ENTROPY,
                  IEEE, UPCAST, ACC, LOGITS, BLOCK_K)
    second = _half(h_ptr, w_ptr, bias_ptr, rows, start + HALF_BLOCK, C, V, H, stride_hm,
                   stride_hk, stride_wv, stride_wk, y, xy_ptr, live, head, HAS_BIAS, SOFTCAP,
                   WITH_ENTROPY, IEEE, UPCAST, ACC, LOGITS, BLOCK_K)
    store_block(blocks_ptr + block * 3, rows * NB, live,
                block_statistics(first, second, head[0], WITH_ENTROPY, ACC))


_LOGITS = {torch.float32: tl.float32, torch.float64: tl.float64, torch.bfloat16: tl.bfloat16,
           torch.float16: tl.float16}


def head_blocks(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                targets: torch.Tensor, head_args, softcapped: bool, with_entropy: bool
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(blocks [C, NB, BLOCK_COLUMNS], x_y [C])`` of the logits ``hidden [C, H] @ weight.T
    (+ bias)`` (``weight [V, H]``, any strides), never formed whole: the statistics of each
    block of ``VOCAB_BLOCK`` ids (the entropy 0 without ``with_entropy``) and the raw logit at
    each row's ``targets [C]`` (in ``[0, V)``), in the weight's dtype, as ``block_stats`` and a
    gather give them from ``fixed_matmul``'s logits; ``head_args``, ``softcapped``:
    ``HeadParams.kernel_args()``."""
    C, H = hidden.shape
    V = weight.shape[0]
    NB = triton.cdiv(V, VOCAB_BLOCK)
    acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
    blocks = empty((C, NB, len(BLOCK_COLUMNS)), dtype=acc, device=hidden.device)
    x_y = empty((C,), dtype=weight.dtype, device=hidden.device)
    if C and NB:
        ieee, upcast = dot_modes(hidden.dtype)
        _head_blocks_kernel[(triton.cdiv(C, BLOCK_M), NB)](
            hidden, weight, weight if bias is None else bias, targets.contiguous(), blocks, x_y,
            C, V, H, NB, hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
            head_args, HAS_BIAS=bias is not None, SOFTCAP=softcapped,
            WITH_ENTROPY=with_entropy, IEEE=ieee, UPCAST=upcast,
            ACC=tl_compute_dtype(weight.dtype), LOGITS=_LOGITS[weight.dtype], BLOCK_M=BLOCK_M,
            BLOCK_K=BLOCK_K, num_warps=NUM_WARPS)
    return blocks, x_y
