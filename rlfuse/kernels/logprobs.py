"""Per-token log-probs (and entropy) from logits: the row kernels every loss builds on.

One program handles one (b, t) row of ``[B, T, V]`` logits and streams the vocabulary in blocks
of ``BLOCK_V``. The forward reads the row once (online logsumexp) and saves the fp32 row max ``m``
and ``log s`` (``lse = m + log s``: kept apart, since rounding their sum would cost the log-probs
their accuracy when the logits are large); the backward reads the row once more and writes
``dlogits`` once.

The row helpers ``row_logsumexp`` and ``row_write_dlogits`` are shared with the fused losses that
work straight from logits. Their cache and loop switches (``EVICT``, ``NUM_STAGES``, ``ORDER``)
serve the single pass, which reads each row twice (``single_pass.SinglePassConfig``); the kernels
here read a row once per launch and pass the defaults.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .._types import compute_dtype
from .utils import constexpr_codes, empty, tl_compute_dtype, vocab_launch_config

# Columns of the per-row statistics the forward saves for the backward (lse = m + log s).
STAT_COLUMNS = ("max", "log_sum")
STAT_MAX, STAT_LOG_SUM = constexpr_codes(STAT_COLUMNS, *STAT_COLUMNS)
N_STAT_COLS = tl.constexpr(len(STAT_COLUMNS))

# Below this, exp() is 0 in fp32 and fp64 alike.
_LOG_TINY = tl.constexpr(-1.0e4)

# Block order of ``row_write_dlogits``: last to first (right after a logsumexp pass over the same
# row, the blocks read last are the likeliest to be still in L2), or first to last.
BLOCK_ORDERS = ("backward", "forward")
ORDER_BACKWARD, ORDER_FORWARD = constexpr_codes(BLOCK_ORDERS, *BLOCK_ORDERS)
# NUM_STAGES of the vocabulary loops that leaves their pipelining to the compiler; any other value
# is the loop's ``tl.range(num_stages=...)``.
COMPILER_STAGES = tl.constexpr(0)
# Eviction policies with EVICT: the first read of a row asks L2 to keep it for the second read;
# the second read and the dlogits stores (used once) go first.
_KEEP = tl.constexpr("evict_last")
_STREAM = tl.constexpr("evict_first")
_NO_HINT = tl.constexpr("")


@triton.jit
def _logsumexp_block(row_ptr, start, V, inv_temp, m, s, w, BLOCK_V: tl.constexpr,
                     WITH_ENTROPY: tl.constexpr, ACC: tl.constexpr, EVICT: tl.constexpr):
    """(m, s, w) after the block of columns ``[start, start + BLOCK_V)`` (``row_logsumexp``)."""
    cols = start + tl.arange(0, BLOCK_V)
    z = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf"),
                eviction_policy=_KEEP if EVICT else _NO_HINT).to(ACC) * inv_temp
    m_new = tl.maximum(m, tl.max(z, axis=0))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - shift)
    e = tl.exp(z - shift)
    if WITH_ENTROPY:
        # e == 0 wherever z - m_new is below _LOG_TINY, so the clamp changes nothing but
        # keeps 0 * -inf (a -inf logit or a padding lane) out of the sum.
        moved = tl.where(alpha > 0, alpha * (m - shift), 0.0) * s
        w = alpha * w + moved + tl.sum(e * tl.maximum(z - shift, _LOG_TINY), axis=0)
    s = alpha * s + tl.sum(e, axis=0)
    return m_new, s, w


@triton.jit
def row_logsumexp(row_ptr, V, inv_temp, BLOCK_V: tl.constexpr, WITH_ENTROPY: tl.constexpr,
                  ACC: tl.constexpr, EVICT: tl.constexpr, NUM_STAGES: tl.constexpr):
    """(m, log s, entropy) of ``z = row * inv_temp``, ``lse = m + log s``; entropy is 0 unless
    ``WITH_ENTROPY``. ``EVICT``: the loads ask L2 to keep the row (it is read again);
    ``NUM_STAGES``: ``COMPILER_STAGES`` or the pipelining depth of the loop.

    Online over vocab blocks with running max ``m``, ``s = sum exp(z - m)`` and
    ``w = sum exp(z - m) (z - m)``; moving the max from m to m' rescales
    ``s' = a s`` and ``w' = a (w + (m - m') s)`` with ``a = exp(m - m')``. At the end
    ``entropy = lse - sum p z = log s - w / s``. Log-probs are then formed as
    ``(z - m) - log s``: no large number is rounded on the way, as in torch's log_softmax.

    ``m`` starts at -inf, so logits of any size count (a finite stand-in would lose rows below
    it). While every logit so far is -inf the shift is 0, not -inf - -inf. ``a (m - m')`` is
    taken as 0 where ``a`` underflows: its limit, and it keeps ``0 * inf`` out when ``m - m'``
    overflows (logits of +-1e38).
    """
    m = tl.full((), float("-inf"), ACC)
    s = tl.zeros((), ACC)
    w = tl.zeros((), ACC)
    # Two spellings of one loop: a loop without a num_stages attribute is not the same loop as
    # any tl.range(num_stages=k) (and Triton 3.2 cannot take num_stages=None from a constexpr).
    if NUM_STAGES == COMPILER_STAGES:
        for start in range(0, V, BLOCK_V):
            m, s, w = _logsumexp_block(row_ptr, start, V, inv_temp, m, s, w, BLOCK_V,
                                       WITH_ENTROPY, ACC, EVICT)
    else:
        for start in tl.range(0, V, BLOCK_V, num_stages=NUM_STAGES):
            m, s, w = _logsumexp_block(row_ptr, start, V, inv_temp, m, s, w, BLOCK_V,
                                       WITH_ENTROPY, ACC, EVICT)
    log_s = tl.log(s)
    entropy = tl.zeros((), ACC)
    if WITH_ENTROPY:
        entropy = log_s - w / s
    return m, log_s, entropy


@triton.jit
def _dlogits_block(row_ptr, drow_ptr, i, n_blocks, V, target, inv_temp, m, log_s, entropy, g, h,
                   BLOCK_V: tl.constexpr, WITH_ENTROPY: tl.constexpr, ACC: tl.constexpr,
                   EVICT: tl.constexpr, ORDER: tl.constexpr):
    """dL/dlogits of the ``i``-th block of columns in ``ORDER`` (``row_write_dlogits``)."""
    block = i
    if ORDER == ORDER_BACKWARD:
        block = n_blocks - 1 - i
    cols = block * BLOCK_V + tl.arange(0, BLOCK_V)
    in_vocab = cols < V
    z = tl.load(row_ptr + cols, mask=in_vocab, other=float("-inf"),
                eviction_policy=_STREAM if EVICT else _NO_HINT).to(ACC) * inv_temp
    logp = (z - m) - log_s
    p = tl.exp(logp)
    d = tl.where(cols == target, g, 0.0) - g * p
    if WITH_ENTROPY:
        d -= h * p * (tl.maximum(logp, _LOG_TINY) + entropy)
    tl.store(drow_ptr + cols, (d * inv_temp).to(drow_ptr.dtype.element_ty), mask=in_vocab,
             eviction_policy=_STREAM if EVICT else _NO_HINT)


@triton.jit
def row_write_dlogits(row_ptr, drow_ptr, V, target, inv_temp, m, log_s, entropy, g, h,
                      BLOCK_V: tl.constexpr, WITH_ENTROPY: tl.constexpr, ACC: tl.constexpr,
                      EVICT: tl.constexpr, NUM_STAGES: tl.constexpr, ORDER: tl.constexpr):
    """Writes dL/dlogits of one row, given g = dL/dlogp and h = dL/dentropy.

    With z = x / tau, p = softmax(z), lse = m + log s, logp = z[y] - lse, H = lse - sum_u p_u z_u:
      dlogp/dz_v = 1[v = y] - p_v
      dH/dz_v    = -p_v (z_v - zbar),   zbar = sum_u p_u z_u = lse - H,
                   so z_v - zbar = (z_v - lse) + H = log p_v + H
      dL/dx_v    = ( g (1[v = y] - p_v) - h p_v (log p_v + H) ) / tau

    Blocks in ``ORDER`` (``BLOCK_ORDERS``); ``EVICT``: the loads and stores go first out of L2
    (the row has been read for the last time, dlogits is not read here again); ``NUM_STAGES``:
    ``COMPILER_STAGES`` or the pipelining depth of the loop.
    """
    n_blocks = tl.cdiv(V, BLOCK_V)
    if NUM_STAGES == COMPILER_STAGES:
        for i in range(0, n_blocks):
            _dlogits_block(row_ptr, drow_ptr, i, n_blocks, V, target, inv_temp, m, log_s,
                           entropy, g, h, BLOCK_V, WITH_ENTROPY, ACC, EVICT, ORDER)
    else:
        for i in tl.range(0, n_blocks, num_stages=NUM_STAGES):
            _dlogits_block(row_ptr, drow_ptr, i, n_blocks, V, target, inv_temp, m, log_s,
                           entropy, g, h, BLOCK_V, WITH_ENTROPY, ACC, EVICT, ORDER)


@triton.jit
def row_write_zeros(drow_ptr, V, BLOCK_V: tl.constexpr, EVICT: tl.constexpr):
    """Zeros over one row of dlogits (``EVICT``: the stores go first out of L2)."""
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        tl.store(drow_ptr + cols, tl.zeros([BLOCK_V], drow_ptr.dtype.element_ty), mask=cols < V,
                 eviction_policy=_STREAM if EVICT else _NO_HINT)


@triton.jit
def program_token(row, mask_ptr, T, S, offset, stride_mb, stride_mt, HAS_MASK: tl.constexpr):
    """(token, b, s, t, in_window, is_actor) of ``row``, the flat index b S + s of a row of
    ``[B, S, V]`` logits (one program per row: its program id, a 1-D grid with no
    grid-dimension limit). Row s predicts the token t = s - offset of the ``[B, T]`` inputs
    (``token = b T + t``); a row outside the window [offset, offset + T) is no actor (its t is
    clamped to 0 and must not be used), nor is a masked one."""
    # Rows number less than 2^31 (a grid dimension): divided in int32, then int64 for the
    # pointer arithmetic (tl.cast also takes the Python ints of the interpreter's row loops).
    b = tl.cast(row // S, tl.int64)
    s = tl.cast(row % S, tl.int64)
    t = s - offset
    in_window = (t >= 0) & (t < T)
    t = tl.where(in_window, t, 0)
    is_actor = in_window
    if HAS_MASK:
        is_actor = in_window & (tl.load(mask_ptr + b * stride_mb + t * stride_mt, mask=in_window,
                                        other=0) != 0)
    return b * T + t, b, s, t, in_window, is_actor


@triton.jit
def program_row(row, targets_ptr, mask_ptr, T, S, offset, stride_yb, stride_yt, stride_mb,
                stride_mt, HAS_MASK: tl.constexpr):
    """(token, b, s, target id, in_window, is_actor): ``program_token`` and the target of the
    row (read only for actor rows)."""
    token, b, s, t, in_window, is_actor = program_token(row, mask_ptr, T, S, offset, stride_mb,
                                                        stride_mt, HAS_MASK)
    y = tl.load(targets_ptr + b * stride_yb + t * stride_yt, mask=is_actor, other=0)
    return token, b, s, y.to(tl.int64), in_window, is_actor


@triton.jit
def load_target_logit(row_ptr, y, V, inv_temp, ACC: tl.constexpr):
    """z[y] of a row; NaN for a target outside [0, V) (possible only with validation off), which
    is never read."""
    in_range = (y >= 0) & (y < V)
    z_y = tl.load(row_ptr + tl.where(in_range, y, 0)).to(ACC) * inv_temp
    return tl.where(in_range, z_y, float("nan"))


@triton.jit
def _token_logprobs_fwd_kernel(
    # pointers
    logits_ptr, targets_ptr, mask_ptr,  # [B, T, V], [B, T], [B, T] (uint8) or None
    logp_ptr, stats_ptr, entropy_ptr,   # [B*T], [B*T, 2] (m, log s), [B*T] (if WITH_ENTROPY)
    # strides
    stride_lb, stride_lt, stride_yb, stride_yt, stride_mb, stride_mt,
    # sizes
    T, V,
    # scalars
    inv_temp,
    BLOCK_V: tl.constexpr, HAS_MASK: tl.constexpr, WITH_ENTROPY: tl.constexpr, ACC: tl.constexpr,
):
    row, b, t, y, _, is_actor = program_row(tl.program_id(0), targets_ptr, mask_ptr, T, T, 0,
                                            stride_yb, stride_yt, stride_mb, stride_mt, HAS_MASK)
    logp = tl.zeros((), ACC)
    m = tl.zeros((), ACC)
    log_s = tl.zeros((), ACC)
    entropy = tl.zeros((), ACC)
    if is_actor:
        row_ptr = logits_ptr + b * stride_lb + t * stride_lt
        m, log_s, entropy = row_logsumexp(row_ptr, V, inv_temp, BLOCK_V, WITH_ENTROPY, ACC,
                                          False, COMPILER_STAGES)
        logp = (load_target_logit(row_ptr, y, V, inv_temp, ACC) - m) - log_s
    tl.store(logp_ptr + row, logp)
    tl.store(stats_ptr + N_STAT_COLS * row + STAT_MAX, m)
    tl.store(stats_ptr + N_STAT_COLS * row + STAT_LOG_SUM, log_s)
    if WITH_ENTROPY:
        tl.store(entropy_ptr + row, entropy)


@triton.jit
def _token_logprobs_bwd_kernel(
    # pointers
    logits_ptr, targets_ptr, mask_ptr,  # [B, S, V], [B, T], [B, T] (uint8) or None
    stats_ptr, entropy_ptr,             # saved by the forward: [B*T, 2], [B*T] (if WITH_ENTROPY)
    dlogp_ptr, dentropy_ptr,            # [B*T] upstream gradients; dentropy only if WITH_ENTROPY
    dlogits_ptr,                        # [B, S, V] output (may alias logits)
    # strides
    stride_lb, stride_lt, stride_yb, stride_yt, stride_mb, stride_mt, stride_db, stride_dt,
    # sizes
    T, S, offset, V,
    # scalars
    inv_temp,
    BLOCK_V: tl.constexpr, HAS_MASK: tl.constexpr, WITH_ENTROPY: tl.constexpr, ACC: tl.constexpr,
):
    # One program per row of the whole [B, S] logits: rows outside the window get zeros.
    row, b, s, y, _, is_actor = program_row(tl.program_id(0), targets_ptr, mask_ptr, T, S,
                                            offset, stride_yb, stride_yt, stride_mb, stride_mt,
                                            HAS_MASK)
    drow_ptr = dlogits_ptr + b * stride_db + s * stride_dt
    if is_actor:
        g = tl.load(dlogp_ptr + row).to(ACC)
        h = tl.zeros((), ACC)
        entropy = tl.zeros((), ACC)
        if WITH_ENTROPY:
            h = tl.load(dentropy_ptr + row).to(ACC)
            entropy = tl.load(entropy_ptr + row).to(ACC)
        m = tl.load(stats_ptr + N_STAT_COLS * row + STAT_MAX).to(ACC)
        log_s = tl.load(stats_ptr + N_STAT_COLS * row + STAT_LOG_SUM).to(ACC)
        row_write_dlogits(logits_ptr + b * stride_lb + s * stride_lt, drow_ptr, V, y, inv_temp,
                          m, log_s, entropy, g, h, BLOCK_V, WITH_ENTROPY, ACC, False,
                          COMPILER_STAGES, ORDER_BACKWARD)
    else:
        row_write_zeros(drow_ptr, V, BLOCK_V, False)


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
        row_ptr = x_ptr + b * stride_xb + s * stride_xt
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            x = tl.load(row_ptr + cols, mask=cols < V).to(ACC)
            tl.store(row_ptr + cols, (x * scale).to(x_ptr.dtype.element_ty), mask=cols < V)


def mask_args(mask: Optional[torch.Tensor]):
    """(pointer tensor, stride_b, stride_t) of an optional bool mask, as uint8 without a copy."""
    if mask is None:
        return None, 0, 0
    mask = mask.view(torch.uint8)
    return mask, mask.stride(0), mask.stride(1)


def token_logprobs_fwd(logits: torch.Tensor, targets: torch.Tensor, mask: Optional[torch.Tensor],
                       temperature: float, with_entropy: bool, offset: int = 0):
    """Launches the forward on the rows ``[offset, offset + T)`` of ``logits [B, S, V]``
    (``stride(-1) == 1``), which predict ``targets [B, T]``; ``mask [B, T]`` bool or None.
    Returns ``(logp [B, T], stats [B*T, 2], entropy [B, T] or None)`` (``stats``: the row max
    and log-sum of each row, what the backward needs) in the compute dtype (fp32, or fp64 for
    fp64 logits)."""
    B, T = targets.shape
    logits = logits[:, offset:offset + T]     # the window: a view, read in place
    V = logits.shape[2]
    acc = compute_dtype(logits.dtype)
    logp = empty((B, T), dtype=acc, device=logits.device)
    stats = empty((B * T, len(STAT_COLUMNS)), dtype=acc, device=logits.device)
    entropy = empty((B, T), dtype=acc, device=logits.device) if with_entropy else None
    if B * T == 0:
        return logp, stats, entropy
    block_v, num_warps = vocab_launch_config(V, logits.element_size())
    mask_u8, stride_mb, stride_mt = mask_args(mask)
    _token_logprobs_fwd_kernel[(B * T,)](
        logits, targets, mask_u8,
        logp, stats, entropy,
        logits.stride(0), logits.stride(1), targets.stride(0), targets.stride(1),
        stride_mb, stride_mt,
        T, V,
        1.0 / temperature,
        BLOCK_V=block_v, HAS_MASK=mask is not None, WITH_ENTROPY=with_entropy,
        ACC=tl_compute_dtype(logits.dtype), num_warps=num_warps,
    )
    return logp, stats, entropy


def token_logprobs_bwd(logits: torch.Tensor, targets: torch.Tensor, mask: Optional[torch.Tensor],
                       temperature: float, stats: torch.Tensor, entropy: Optional[torch.Tensor],
                       dlogp: torch.Tensor, dentropy: Optional[torch.Tensor],
                       dlogits: Optional[torch.Tensor] = None, offset: int = 0) -> torch.Tensor:
    """Launches the backward over the whole ``logits [B, S, V]``, whose rows
    ``[offset, offset + T)`` predict ``targets [B, T]`` (the others get zeros); ``dlogp`` /
    ``dentropy`` are ``[B, T]`` (``dentropy`` None when the entropy gets no gradient). Writes
    into ``dlogits`` when given (it may be ``logits`` itself), else into a new tensor of the
    logits' dtype and shape."""
    B, S, V = logits.shape
    T = targets.shape[1]
    if dlogits is None:
        dlogits = empty((B, S, V), dtype=logits.dtype, device=logits.device)
    if B * S == 0:
        return dlogits
    with_entropy = dentropy is not None
    block_v, num_warps = vocab_launch_config(V, logits.element_size())
    mask_u8, stride_mb, stride_mt = mask_args(mask)
    _token_logprobs_bwd_kernel[(B * S,)](
        logits, targets, mask_u8,
        stats, entropy if with_entropy else None,
        dlogp.contiguous(), dentropy.contiguous() if with_entropy else None,
        dlogits,
        logits.stride(0), logits.stride(1), targets.stride(0), targets.stride(1),
        stride_mb, stride_mt, dlogits.stride(0), dlogits.stride(1),
        T, S, offset, V,
        1.0 / temperature,
        BLOCK_V=block_v, HAS_MASK=mask is not None, WITH_ENTROPY=with_entropy,
        ACC=tl_compute_dtype(logits.dtype), num_warps=num_warps,
    )
    return dlogits


def scale_rows_(x: torch.Tensor, mask: torch.Tensor, scale: torch.Tensor, offset: int = 0) -> None:
    """Multiplies the actor rows of ``x [B, S, V]`` (``stride(-1) == 1``; rows
    ``[offset, offset + T)`` go with ``mask [B, T]``) by the 0-dim ``scale`` in place, without
    reading ``scale`` on the host: a scale of 1 costs no pass over ``x``."""
    B, S, V = x.shape
    T = mask.shape[1]
    if B * S == 0:
        return
    block_v, num_warps = vocab_launch_config(V, x.element_size())
    mask_u8, stride_mb, stride_mt = mask_args(mask)
    _scale_rows_kernel[(B * S,)](
        x, mask_u8, scale,
        x.stride(0), x.stride(1), stride_mb, stride_mt,
        T, S, offset, V,
        BLOCK_V=block_v, ACC=tl_compute_dtype(x.dtype), num_warps=num_warps,
    )
