"""A row's statistics from those of its fixed vocabulary blocks, combined in one order.

A batch-invariant head (``LinearHead(..., batch_invariant=True)``) reduces each block of
``VOCAB_BLOCK`` ids of a row on its own (``block_statistics``, from logits in memory by
``block_stats``, or from the head's tiles as they are formed: ``kernels.tiles.head_tiles``) and
combines the blocks here, always first to last over the global block index: the same bits
whatever the other rows, and whether the blocks come from one rank or from the shards of a split
vocabulary. A block's sums are taken by an explicit tree of pairwise additions
(``tree_sum``), so their bits are the program's, not those of the order a compiler gives a
reduction over the layout it picked for the block (which differs between a tile loaded from
memory and one formed by ``tl.dot``). With ``m_b``, ``log s_b``, ``H_b`` a block's max (before
the temperature), log-sum and entropy:

    M = max_b m_b,   S = sum_b exp((m_b - M) / tau + log s_b),
    H = sum_b pi_b (H_b - log pi_b),   log pi_b = (m_b - M) / tau + log s_b - log S
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..lib.head_functions import softcap
from ..lib.row_functions import LOG_TINY
from ..lib.utils import LN2, LOG2E, empty, exp_accurate, fp64_args, fp64_values, tl_compute_dtype

# The ids a block holds: Megatron pads a vocabulary to a multiple of 128 per tensor-parallel rank
# (``make_vocab_size_divisible_by``), so every shard of a padded split is whole blocks.
VOCAB_BLOCK = 128
# Block columns: max, log-sum, entropy (the row kernels' statistics and entropy of a block).
BLOCK_COLUMNS = ("max", "log_sum", "entropy")
_ROWS = 64
BLOCK_IDS = tl.constexpr(VOCAB_BLOCK)      # VOCAB_BLOCK in a kernel
HALF_BLOCK = tl.constexpr(VOCAB_BLOCK // 2)
_HALF_STEPS = tl.constexpr(6)      # log2(HALF_BLOCK)


@triton.jit
def tree_sum(v, STEPS: tl.constexpr):
    """The sum over axis 1 of ``v [R, 2^STEPS]`` by a fixed tree: element j added to j + 1 for
    every even j, the same over what is left, and so on (each step one elementwise addition)."""
    for _ in tl.static_range(STEPS):
        a, b = tl.split(tl.reshape(v, [v.shape[0], v.shape[1] // 2, 2]))
        v = a + b
    return tl.reshape(v, [v.shape[0]])


@triton.jit
def half_statistics(x, inv_temp, WITH_ENTROPY: tl.constexpr, ACC: tl.constexpr):
    """``(m, s, w)`` of each row of half a block ``x [R, HALF_BLOCK]`` (logits in the compute
    dtype, -inf past the row's end) in the row kernels' units
    (``row_functions.row_logsumexp``: ``m`` the max before the temperature): with
    ``u = (x - m) log2(e) / tau``, ``s = sum 2^u`` and ``w = sum 2^u u`` (0 without
    ``WITH_ENTROPY``), each by ``tree_sum``. A row of -inf gets
    the lowest finite ``m`` and ``s = 0``."""
    if ACC == tl.float64:
        lowest = -1.7976931348623157e308
    else:
        lowest = -3.4028234663852886e38
    c = tl.cast(inv_temp, ACC) * LOG2E
    m = tl.maximum(tl.max(x, axis=1), lowest)
    u = (x - m[:, None]) * c
    if WITH_ENTROPY:     # 2^u is 0 below LOG_TINY: the clamp keeps 0 * -inf out of w
        u = tl.maximum(u, LOG_TINY)
    e = tl.math.exp2(u)
    w = tl.zeros_like(m)
    if WITH_ENTROPY:
        w = tree_sum(e * u, _HALF_STEPS)
    return m, tree_sum(e, _HALF_STEPS), w


@triton.jit
def block_statistics(first, second, inv_temp, WITH_ENTROPY: tl.constexpr, ACC: tl.constexpr):
    """(max, log-sum, entropy) of each row of a block of ``VOCAB_BLOCK`` logits from the
    ``half_statistics`` of its two halves (ids 0..63 and 64..127), in the row kernels' units:
    each half's sums moved to the block's max ``m`` (``s' = a s``, ``w' = a (w + d s)``, ``d =
    (m_h - m) log2(e) / tau``, ``a = 2^d``), ``entropy = log s - ln 2 w / s``; a block of -inf
    gets max and log-sum -inf, entropy 0."""
    m0, s0, w0 = first
    m1, s1, w1 = second
    c = tl.cast(inv_temp, ACC) * LOG2E
    m = tl.maximum(m0, m1)
    d0 = tl.maximum((m0 - m) * c, LOG_TINY)
    d1 = tl.maximum((m1 - m) * c, LOG_TINY)
    a0 = tl.math.exp2(d0)
    a1 = tl.math.exp2(d1)
    s = tl.fma(a0, s0, a1 * s1)
    log_s = tl.log(s)
    entropy = tl.zeros_like(s)
    if WITH_ENTROPY:
        w = tl.fma(a0, tl.fma(d0, s0, w0), a1 * tl.fma(d1, s1, w1))
        entropy = tl.where(s > 0, log_s - LN2 * w / s, 0.0)
    return tl.where(s > 0, m, float("-inf")), log_s, entropy


@triton.jit
def store_block(out_ptr, rows, live, stats):
    """A block's ``(max, log-sum, entropy)`` of each row at ``out_ptr + 3 rows`` (``live``
    rows)."""
    m, log_s, entropy = stats
    at = out_ptr + rows.to(tl.int64) * 3
    tl.store(at, m, mask=live)
    tl.store(at + 1, log_s, mask=live)
    tl.store(at + 2, entropy, mask=live)


@triton.jit
def _load_half(logits_ptr, row_at, live, start, V, cap, cap_in, SOFTCAP: tl.constexpr,
               ACC: tl.constexpr):
    """The logits ``[start, start + HALF_BLOCK)`` of the rows at ``row_at`` through the head's
    softcap, -inf past ``V`` and at rows not ``live``."""
    cols = start + tl.arange(0, HALF_BLOCK)
    inside = live[:, None] & (cols[None, :] < V)
    x = tl.load(logits_ptr + row_at[:, None] + cols[None, :], mask=inside,
                other=float("-inf")).to(ACC)
    if SOFTCAP:
        x, _ = softcap(x, cap, cap_in, ACC)
        x = tl.where(inside, x, float("-inf"))
    return x


@triton.jit(do_not_specialize=["R", "T"])   # one binary for any row count
def _block_stats_kernel(logits_ptr, out_ptr, R, T, NB, V, stride_b, stride_t, head_args,
                        SOFTCAP: tl.constexpr, WITH_ENTROPY: tl.constexpr,
                        BLOCK_R: tl.constexpr, ACC: tl.constexpr):
    # out [R, NB, 3]: one program per BLOCK_R rows (r = b T + t of logits [B, T, V]) and block
    inv_temp, cap, cap_in = fp64_values(head_args, ACC)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    block = tl.program_id(1)
    live = rows < R
    row_at = (rows // T).to(tl.int64) * stride_b + (rows % T).to(tl.int64) * stride_t
    start = block * BLOCK_IDS
    first = half_statistics(_load_half(logits_ptr, row_at, live, start, V, cap, cap_in,
                                       SOFTCAP, ACC), inv_temp, WITH_ENTROPY, ACC)
    second = half_statistics(_load_half(logits_ptr, row_at, live, start + HALF_BLOCK, V, cap,
                                        cap_in, SOFTCAP, ACC), inv_temp, WITH_ENTROPY, ACC)
    stats = block_statistics(first, second, inv_temp, WITH_ENTROPY, ACC)
    store_block(out_ptr + block * 3, rows * NB, live, stats)


def block_stats(logits: torch.Tensor, head_args, softcapped: bool,
                with_entropy: bool) -> torch.Tensor:
    """``[B T, NB, BLOCK_COLUMNS]``: the statistics of each block of ``VOCAB_BLOCK`` ids of
    each row of ``logits [B, T, V]`` (``stride(-1) == 1``; the last block partial when ``V`` is
    not a multiple), the entropy 0 without ``with_entropy``; ``head_args``, ``softcapped``:
    ``HeadParams.kernel_args()``."""
    B, T, V = logits.shape
    NB = triton.cdiv(V, VOCAB_BLOCK)
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    out = empty((B * T, NB, len(BLOCK_COLUMNS)), dtype=acc, device=logits.device)
    if B * T and NB:
        _block_stats_kernel[(triton.cdiv(B * T, _ROWS), NB)](
            logits, out, B * T, T, NB, V, logits.stride(0), logits.stride(1), head_args,
            SOFTCAP=softcapped, WITH_ENTROPY=with_entropy, BLOCK_R=_ROWS,
            ACC=tl_compute_dtype(logits.dtype))
    return out


@triton.jit(do_not_specialize=["R"])   # one binary for any row count
def _combine_blocks_kernel(blocks_ptr, out_ptr, R, NB, scalars,
                           WITH_ENTROPY: tl.constexpr, BLOCK_R: tl.constexpr,
                           ACC: tl.constexpr):
    # blocks [R, NB, 3] and out [R, 3] contiguous: one program per BLOCK_R rows, each row's
    # blocks in order (the rows apart: nothing depends on R or on the row's neighbours).
    (inv_temp,) = fp64_values(scalars, ACC)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < R
    row_ptr = blocks_ptr + rows.to(tl.int64) * NB * 3
    M = tl.full([BLOCK_R], float("-inf"), ACC)
    for b in range(NB):
        M = tl.maximum(M, tl.load(row_ptr + b * 3, mask=live, other=0.0).to(ACC))
    M = tl.where(tl.abs(M) < float("inf"), M, 0.0)                # every logit -inf
    S = tl.zeros([BLOCK_R], ACC)
    for b in range(NB):
        m = tl.load(row_ptr + b * 3, mask=live, other=0.0).to(ACC)
        log_s = tl.load(row_ptr + b * 3 + 1, mask=live, other=0.0).to(ACC)
        S += exp_accurate((m - M) * inv_temp + log_s)
    log_S = tl.log(S)
    H = tl.zeros([BLOCK_R], ACC)
    if WITH_ENTROPY:
        for b in range(NB):
            m = tl.load(row_ptr + b * 3, mask=live, other=0.0).to(ACC)
            log_s = tl.load(row_ptr + b * 3 + 1, mask=live, other=0.0).to(ACC)
            h = tl.load(row_ptr + b * 3 + 2, mask=live, other=0.0).to(ACC)
            log_pi = (m - M) * inv_temp + log_s - log_S
            pi = exp_accurate(log_pi)
            H += tl.where(pi > 0, pi * (h - log_pi), 0.0)
    out = out_ptr + rows.to(tl.int64) * 3
    tl.store(out, M, mask=live)
    tl.store(out + 1, log_S, mask=live)
    tl.store(out + 2, H, mask=live)


def combine_blocks(blocks: torch.Tensor, inv_temp: float, with_entropy: bool) -> torch.Tensor:
    """``[R, 3]`` (``BLOCK_COLUMNS``: max, log-sum, entropy, 0 without ``with_entropy``) of
    whole rows from their blocks' ``blocks [R, NB, 3]`` in order (``inv_temp``: what turns the
    statistics' logits into z, ``kernels.lib.head_functions.HeadParams.inv_temp``)."""
    blocks = blocks.contiguous()
    R, NB = blocks.shape[:2]
    out = empty((R, 3), dtype=blocks.dtype, device=blocks.device)
    if R:
        _combine_blocks_kernel[(triton.cdiv(R, _ROWS),)](
            blocks, out, R, NB, fp64_args((inv_temp,)), WITH_ENTROPY=with_entropy,
            BLOCK_R=_ROWS, ACC=tl_compute_dtype(blocks.dtype))
    return out


@triton.jit(do_not_specialize=["R"])   # one binary for any row count
def _sum_blocks_kernel(blocks_ptr, out_ptr, R, NB, K: tl.constexpr, BLOCK_R: tl.constexpr):
    # blocks [R, NB, K] and out [R, K] contiguous: one program per BLOCK_R rows, each row's
    # blocks added first to last
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < R
    row_ptr = blocks_ptr + rows.to(tl.int64) * NB * K
    for k in tl.static_range(K):
        total = tl.zeros([BLOCK_R], blocks_ptr.dtype.element_ty)
        for b in range(NB):
            total += tl.load(row_ptr + b * K + k, mask=live, other=0.0)
        tl.store(out_ptr + rows.to(tl.int64) * K + k, total, mask=live)


def sum_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """``[R, K]``: each row's sums ``blocks [R, NB, K]`` added over its blocks first to last
    (the same bits whatever ``R``)."""
    blocks = blocks.contiguous()
    R, NB, K = blocks.shape
    out = empty((R, K), dtype=blocks.dtype, device=blocks.device)
    if R:
        _sum_blocks_kernel[(triton.cdiv(R, _ROWS),)](blocks, out, R, NB, K=K, BLOCK_R=_ROWS)
    return out
