"""A batch-invariant head's block statistics straight from its hidden states and weight: each
program forms the logits of ``BLOCK_M`` rows and one vocabulary block of ``VOCAB_BLOCK`` ids
(two tiles of the fixed-order matmul, ``matmul.fixed_tile``, rounded to the logits' dtype as
``matmul.fixed_matmul`` stores them), reduces them to the block's statistics
(``tile_stats.block_statistics``) and keeps the target's logit where the block holds it. The
tiles never leave the chip: no ``[C, V]`` tensor, only ``[C, V / VOCAB_BLOCK, 3]`` statistics,
which ``tile_stats.combine_blocks`` combines in order. The same bits as the statistics of
``fixed_matmul``'s logits (``tile_stats.block_stats``), by construction: the same tiles, the
same rounding, the same reduction. The backward (``head_backward``) forms the tiles again,
turns each into its gradient and adds it, in fixed orders, into the gradients of the hidden
states and of the weight.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..lib.head_functions import softcap
from ..lib.row_functions import dlogits_coefficients, dlogits_of
from .matmul import BLOCK_K, BLOCK_M, BLOCK_N, NUM_WARPS, dot_modes, fixed_dot, fixed_tile
from ..lib.utils import Flags, empty, fp64_values, tl_compute_dtype
from .tile_stats import (BLOCK_COLUMNS, BLOCK_IDS, HALF_BLOCK, VOCAB_BLOCK, block_statistics,
                         half_statistics, store_block)

# a vocabulary block is two of the matmul's column tiles
assert VOCAB_BLOCK == 2 * BLOCK_N
# Columns of the hidden states (dhidden) or of the weight (dweight) per product in the backward
BLOCK_H = 32
# The backward kernels' FLAGS: the head's bias and softcap, the entropy's gradient, the matmul
# modes (``matmul.dot_modes``), the gradients the weight's kernel adds
HEAD_GRAD_FLAGS = Flags("HAS_BIAS", "SOFTCAP", "WITH_ENTROPY", "IEEE", "UPCAST", "NEED_WEIGHT",
                        "NEED_BIAS")
_HAS_BIAS, _SOFTCAP, _WITH_ENTROPY, _IEEE, _UPCAST, _NEED_WEIGHT, _NEED_BIAS = \
    HEAD_GRAD_FLAGS.bits()


@triton.jit
def head_tile(h_ptr, w_ptr, bias_ptr, rows, cols, C, V, H, stride_hm, stride_hk, stride_wv,
              stride_wk, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
              ACC: tl.constexpr, LOGITS: tl.constexpr, BLOCK_K: tl.constexpr):
    """The logits of ``rows`` and ``cols`` as ``fixed_matmul`` stores them: the fixed-order
    tile (``fixed_tile``) plus the bias, rounded once to ``LOGITS``."""
    acc = fixed_tile(h_ptr, w_ptr, rows, cols, C, V, H, stride_hm, stride_hk, stride_wk,
                     stride_wv, IEEE, UPCAST, ACC, BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < V, other=0.0).to(ACC)[None, :]
    return acc.to(LOGITS)


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
    logits = head_tile(h_ptr, w_ptr, bias_ptr, rows, cols, C, V, H, stride_hm, stride_hk,
                       stride_wv, stride_wk, HAS_BIAS, IEEE, UPCAST, ACC, LOGITS, BLOCK_K)
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


@triton.jit(do_not_specialize=["C"])   # one binary for any row count
def _head_blocks_kernel(
    h_ptr, w_ptr, bias_ptr, y_ptr, blocks_ptr, xy_ptr,     # pointers: the head; out
    C, V, H, NB,                                            # sizes
    stride_hm, stride_hk, stride_wv, stride_wk,             # strides
    head_args,                                              # scalars (HeadParams)
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, WITH_ENTROPY: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr, ACC: tl.constexpr, LOGITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
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


# the Triton dtype of a head's logits (the weight's)
LOGITS_DTYPE = {torch.float32: tl.float32, torch.float64: tl.float64,
                torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def head_blocks(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                targets: torch.Tensor, head_args, softcapped: bool, with_entropy: bool,
                logits_dtype: Optional[torch.dtype] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(blocks [C, NB, BLOCK_COLUMNS], x_y [C])`` of the logits ``hidden [C, H] @ weight.T
    (+ bias)`` (``weight [V, H]``, any strides), never formed whole: the statistics of each
    block of ``VOCAB_BLOCK`` ids (the entropy 0 without ``with_entropy``) and the raw logit at
    each row's ``targets [C]`` (in ``[0, V)``), in the weight's dtype (or ``logits_dtype``:
    the compute dtype's, never rounded to a bf16 weight's), as ``block_stats`` and a gather
    give them from ``fixed_matmul``'s logits; ``head_args``, ``softcapped``:
    ``HeadParams.kernel_args()``."""
    C, H = hidden.shape
    V = weight.shape[0]
    NB = triton.cdiv(V, VOCAB_BLOCK)
    acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
    blocks = empty((C, NB, len(BLOCK_COLUMNS)), dtype=acc, device=hidden.device)
    logits_dtype = logits_dtype or weight.dtype
    x_y = empty((C,), dtype=logits_dtype, device=hidden.device)
    if C and NB:
        ieee, upcast = dot_modes(hidden.dtype)
        _head_blocks_kernel[(triton.cdiv(C, BLOCK_M), NB)](
            hidden, weight, weight if bias is None else bias, targets.contiguous(), blocks, x_y,
            C, V, H, NB, hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
            head_args, HAS_BIAS=bias is not None, SOFTCAP=softcapped,
            WITH_ENTROPY=with_entropy, IEEE=ieee, UPCAST=upcast,
            ACC=tl_compute_dtype(weight.dtype), LOGITS=LOGITS_DTYPE[logits_dtype],
            BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS)
    return blocks, x_y


@triton.jit
def kept_rows(rows, C, keep_ptr):
    """The rows of the ``C`` whose gradient is taken (``keep``: 1)."""
    return (rows < C) & (tl.load(keep_ptr + rows, mask=rows < C, other=0) != 0)


@triton.jit
def _row_coefficients(rows, live, stats_ptr, entropy_ptr, g_ptr, dent_ptr, head,
                      FLAGS: tl.constexpr, ACC: tl.constexpr):
    """Each row's ``(m, c, log2 s, a, b, g_y)`` of ``row_functions.row_write_dlogits``' formula
    (``FLAGS``: ``HEAD_GRAD_FLAGS``)."""
    SOFTCAP: tl.constexpr = (_SOFTCAP & FLAGS) != 0
    WITH_ENTROPY: tl.constexpr = (_WITH_ENTROPY & FLAGS) != 0
    m = tl.load(stats_ptr + rows * 2, mask=live, other=0.0).to(ACC)
    log_s = tl.load(stats_ptr + rows * 2 + 1, mask=live, other=0.0).to(ACC)
    g = tl.load(g_ptr + rows, mask=live, other=0.0).to(ACC)
    h = tl.zeros_like(g)
    entropy = tl.zeros_like(g)
    if WITH_ENTROPY:
        h = tl.load(dent_ptr + rows, mask=live, other=0.0).to(ACC)
        entropy = tl.load(entropy_ptr + rows, mask=live, other=0.0).to(ACC)
    c, log_s2, a, b, g_y = dlogits_coefficients(head[0], head[1], head[2], log_s, entropy, g,
                                                h, SOFTCAP, ACC)
    return m, c, log_s2, a, b, g_y


@triton.jit
def _dlogits_half(h_ptr, w_ptr, bias_ptr, rows, live, start, C, V, H, stride_hm, stride_hk,
                  stride_wv, stride_wk, y, row, head, FLAGS: tl.constexpr, ACC: tl.constexpr,
                  LOGITS: tl.constexpr, BLOCK_K: tl.constexpr):
    """The gradient of the logits of ``rows`` and the ``HALF_BLOCK`` columns from ``start``
    (0 past ``V`` and at rows not ``live``, whatever their hidden states), rounded to
    ``LOGITS`` as the stored one is: the tile formed again as the forward formed it, then
    ``row_functions.row_write_dlogits``' formula with each row's coefficients ``row``
    (``_row_coefficients``)."""
    HAS_BIAS: tl.constexpr = (_HAS_BIAS & FLAGS) != 0
    SOFTCAP: tl.constexpr = (_SOFTCAP & FLAGS) != 0
    WITH_ENTROPY: tl.constexpr = (_WITH_ENTROPY & FLAGS) != 0
    IEEE: tl.constexpr = (_IEEE & FLAGS) != 0
    UPCAST: tl.constexpr = (_UPCAST & FLAGS) != 0
    cols = start + tl.arange(0, HALF_BLOCK)
    x = head_tile(h_ptr, w_ptr, bias_ptr, rows, cols, C, V, H, stride_hm, stride_hk, stride_wv,
                  stride_wk, HAS_BIAS, IEEE, UPCAST, ACC, LOGITS, BLOCK_K).to(ACC)
    dcap = 1.0
    if SOFTCAP:
        x, dcap = softcap(x, head[1], head[2], ACC)
    m, c, log_s2, a, b, g_y = row
    d = dlogits_of(x, m[:, None], c, log_s2[:, None], a[:, None], b[:, None], WITH_ENTROPY)
    d = tl.where(cols[None, :] == y[:, None], d + g_y[:, None], d) * dcap
    return tl.where(live[:, None] & (cols[None, :] < V), d, 0.0).to(LOGITS), cols


@triton.jit
def add_tile_product(acc_ptr, stride_acc, out_rows, live, d, b_ptr, b_rows, b_live, stride_br,
                 stride_bh, H, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                 BLOCK_H: tl.constexpr):
    """``acc[out_rows, :] += d @ B[b_rows, :]`` (``acc`` fp32 in memory, H columns), a
    ``BLOCK_H`` of columns at a time."""
    for hs in range(0, H, BLOCK_H):
        cols = hs + tl.arange(0, BLOCK_H)
        b = tl.load(b_ptr + b_rows[:, None].to(tl.int64) * stride_br + cols[None, :] * stride_bh,
                    mask=b_live[:, None] & (cols[None, :] < H), other=0.0)
        at = acc_ptr + out_rows[:, None].to(tl.int64) * stride_acc + cols[None, :]
        inside = live[:, None] & (cols[None, :] < H)
        acc = tl.load(at, mask=inside, other=0.0)
        acc += fixed_dot(d, b, IEEE, UPCAST)
        tl.store(at, acc, mask=inside)


@triton.jit(do_not_specialize=["C"])   # one binary for any row count
def _head_dhidden_kernel(
    h_ptr, w_ptr, bias_ptr, y_ptr, keep_ptr,                # pointers: the head, its rows
    stats_ptr, entropy_ptr, g_ptr, dent_ptr, dh_ptr,        # the forward's; upstream; out
    C, V, H, NB,                                            # sizes
    stride_hm, stride_hk, stride_wv, stride_wk,             # strides
    head_args,                                              # scalars (HeadParams)
    FLAGS: tl.constexpr, ACC: tl.constexpr, LOGITS: tl.constexpr,    # HEAD_GRAD_FLAGS
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # one program per BLOCK_M rows: dh [C, H] (fp32, zeros) += their gradient's tiles times the
    # weight, the vocabulary blocks in order
    IEEE: tl.constexpr = (_IEEE & FLAGS) != 0
    UPCAST: tl.constexpr = (_UPCAST & FLAGS) != 0
    head = fp64_values(head_args, ACC)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = kept_rows(rows, C, keep_ptr)
    y = tl.load(y_ptr + rows, mask=live, other=-1)
    row = _row_coefficients(rows, live, stats_ptr, entropy_ptr, g_ptr, dent_ptr, head, FLAGS,
                            ACC)
    for block in range(NB):
        for half in tl.static_range(2):
            d, cols = _dlogits_half(h_ptr, w_ptr, bias_ptr, rows, live, block * BLOCK_IDS +
                                    half * HALF_BLOCK, C, V, H, stride_hm, stride_hk,
                                    stride_wv, stride_wk, y, row, head, FLAGS, ACC, LOGITS,
                                    BLOCK_K)
            add_tile_product(dh_ptr, H, rows, live, d, w_ptr, cols, cols < V, stride_wv,
                         stride_wk, H, IEEE, UPCAST, BLOCK_H)


@triton.jit(do_not_specialize=["C"])   # one binary for any row count
def _head_dweight_kernel(
    h_ptr, w_ptr, bias_ptr, y_ptr, keep_ptr,                # pointers: the head, its rows
    stats_ptr, entropy_ptr, g_ptr, dent_ptr, dw_ptr, db_ptr,   # the forward's; upstream; out
    C, V, H,                                                # sizes
    stride_hm, stride_hk, stride_wv, stride_wk,             # strides
    head_args,                                              # scalars (HeadParams)
    FLAGS: tl.constexpr, ACC: tl.constexpr, LOGITS: tl.constexpr,    # HEAD_GRAD_FLAGS
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # one program per half block of HALF_BLOCK ids: dw [V, H] (fp32) += the gradient's tiles
    # transposed times the hidden rows, the rows in order (no atomics); db [V] += their sums
    IEEE: tl.constexpr = (_IEEE & FLAGS) != 0
    UPCAST: tl.constexpr = (_UPCAST & FLAGS) != 0
    NEED_BIAS: tl.constexpr = (_NEED_BIAS & FLAGS) != 0
    head = fp64_values(head_args, ACC)
    start = tl.program_id(0) * HALF_BLOCK
    cols = start + tl.arange(0, HALF_BLOCK)
    dbias = tl.zeros((HALF_BLOCK,), ACC)
    for tile in range(0, C, BLOCK_M):
        rows = tile + tl.arange(0, BLOCK_M)
        live = kept_rows(rows, C, keep_ptr)
        y = tl.load(y_ptr + rows, mask=live, other=-1)
        row = _row_coefficients(rows, live, stats_ptr, entropy_ptr, g_ptr, dent_ptr, head,
                                FLAGS, ACC)
        d, _ = _dlogits_half(h_ptr, w_ptr, bias_ptr, rows, live, start, C, V, H, stride_hm,
                             stride_hk, stride_wv, stride_wk, y, row, head, FLAGS, ACC, LOGITS,
                             BLOCK_K)
        if _NEED_WEIGHT & FLAGS:
            add_tile_product(dw_ptr, H, cols, cols < V, tl.trans(d), h_ptr, rows, live,
                         stride_hm, stride_hk, H, IEEE, UPCAST, BLOCK_H)
        if NEED_BIAS:
            dbias += tl.sum(d.to(ACC), axis=0)
    if NEED_BIAS:
        at = db_ptr + cols
        tl.store(at, tl.load(at, mask=cols < V, other=0.0) + dbias, mask=cols < V)


def head_backward(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  targets: torch.Tensor, keep: torch.Tensor, stats: torch.Tensor,
                  entropy: Optional[torch.Tensor], dlogp: torch.Tensor,
                  dentropy: Optional[torch.Tensor], head_args, softcapped: bool,
                  dhidden: Optional[torch.Tensor], dweight: Optional[torch.Tensor],
                  dbias: Optional[torch.Tensor]) -> None:
    """The gradients of ``head_blocks``' rows' log-probs (and entropies) for ``dlogp`` (and
    ``dentropy``) ``[C]``, the forward's ``stats [C, 2]`` (max, log-sum) and ``entropy [C]``,
    added into ``dhidden [C, H]``, ``dweight [V, H]`` and ``dbias [V]`` (contiguous, in the
    compute dtype; None: not wanted) from the logits' tiles formed again on the chip, their
    gradient rounded to the weight's dtype as a stored one would be
    (``row_functions.row_write_dlogits``' formula); rows not ``keep`` (and their targets outside
    ``[0, V)``) count for nothing, whatever their hidden states. ``dhidden``: each row's over
    the vocabulary blocks in order (its bits its own); ``dweight``, ``dbias``: over the rows in
    order (no atomics)."""
    C, H = hidden.shape
    V = weight.shape[0]
    with_entropy = dentropy is not None
    ieee, upcast = dot_modes(hidden.dtype)
    common = (hidden, weight, weight if bias is None else bias, targets.contiguous(),
              keep.to(torch.uint8), stats.contiguous(),
              entropy.contiguous() if with_entropy else dlogp, dlogp.contiguous(),
              dentropy.contiguous() if with_entropy else dlogp)
    flags = dict(HAS_BIAS=bias is not None, SOFTCAP=softcapped, WITH_ENTROPY=with_entropy,
                 IEEE=ieee, UPCAST=upcast)
    constexprs = dict(ACC=tl_compute_dtype(weight.dtype), LOGITS=LOGITS_DTYPE[weight.dtype],
                      BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, BLOCK_H=BLOCK_H, num_warps=NUM_WARPS)
    strides = (hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1))
    if dhidden is not None:
        _head_dhidden_kernel[(triton.cdiv(C, BLOCK_M),)](
            *common, dhidden, C, V, H, triton.cdiv(V, VOCAB_BLOCK), *strides, head_args,
            FLAGS=HEAD_GRAD_FLAGS.word(**flags, NEED_WEIGHT=False, NEED_BIAS=False),
            **constexprs)
    if dweight is not None or dbias is not None:
        _head_dweight_kernel[(triton.cdiv(V, HALF_BLOCK),)](
            *common, dweight, dbias, C, V, H, *strides, head_args,
            FLAGS=HEAD_GRAD_FLAGS.word(**flags, NEED_WEIGHT=dweight is not None,
                                       NEED_BIAS=dbias is not None),
            **constexprs)
