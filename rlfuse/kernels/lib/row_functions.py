"""The row helpers every kernel over logits builds on: one row of ``V`` logits streamed in
blocks of ``BLOCK_V`` by one program, its logsumexp (and entropy) in one read (``row_logsumexp``)
and its gradient in one read and one write (``row_write_dlogits``), and the indexing of a
program's row (``program_token``, ``program_row``).

The row max ``m`` and ``log s`` (``lse = m + log s``) are kept apart, since rounding their sum
would cost the log-probs their accuracy when the logits are large. The cache and loop switches
(``EVICT``, ``NUM_STAGES``, ``ORDER``) serve the single pass, which reads each row twice
(``single_pass.SinglePassConfig``); the log-prob kernels read a row once per launch and pass the
defaults.

Their loops are written to an instruction budget (a row kernel can be limited by instruction
issue before bandwidth on an H200; ``python -m bench --sass`` counts them from SASS and
``tests/sass_pins.json`` holds the counts): exponentials in base 2 (``tl.math.exp2`` is one
MUFU.EX2 in fp32) with log2(e) / tau folded into one scale, a running max and sum per thread
combined across threads once after the loop, full blocks without masks and the partial block
apart, the target column compared (in int32) only in the one block that holds it, bf16 pairs
unpacked by shift and mask, and fmas written as ``tl.fma``. The numerics argument of each is
beside it.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .head_functions import softcap
from .utils import LN2, LOG2E, constexpr_codes

# Below this (in the base-2 exponents of the row helpers), 2^x is 0 in fp32 and fp64 alike.
LOG_TINY = tl.constexpr(-1.0e4)
# The row helpers exponentiate in base 2 (``utils.LOG2E``, ``LN2``): ``tl.math.exp2`` is one
# MUFU.EX2 in fp32, where ``tl.exp`` adds a multiply and a subnormal fix-up around it.

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
def _half_columns(BLOCK_V: tl.constexpr, LANES: tl.constexpr):
    """The columns of the first half of a vocabulary block (the second half: + BLOCK_V / 2), as
    ``[BLOCK_V // (2 LANES), LANES]``: ``LANES`` adjacent logits (one 16-byte load) a row, whole
    rows to a thread. A thread's row of both halves is its *line* of ``2 LANES`` logits."""
    rows = tl.arange(0, BLOCK_V // (2 * LANES))[:, None] * LANES
    return rows + tl.arange(0, LANES)[None, :]


@triton.jit
def _load_logits(block_ptr, cols, n, MASKED: tl.constexpr, ACC: tl.constexpr,
                 HINT: tl.constexpr):
    """The logits at ``block_ptr + cols`` in the compute dtype; ``MASKED``: the row's last,
    partial block, of ``n`` logits (-inf past them). ``HINT``: the eviction policy."""
    if MASKED:
        x = tl.load(block_ptr + cols, mask=cols < n, other=float("-inf"), eviction_policy=HINT)
    else:
        x = tl.load(block_ptr + cols, eviction_policy=HINT)
    if x.dtype == tl.bfloat16:
        # the bits of a bf16 are the top half of its fp32: a pair of logits in one 32-bit word
        # unpacks as (word << 16, word & 0xffff0000)
        x = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(ACC)


@triton.jit
def _pairs(x, LANES: tl.constexpr):
    """The even and odd lanes of ``x [rows, LANES]`` (a thread's own registers)."""
    return tl.split(tl.reshape(x, [x.shape[0], LANES // 2, 2]))


@triton.jit
def _line_dot(x0, y0, x1, y1, LANES: tl.constexpr):
    """sum over each line (axis 1 of both halves) of x y, as chains of four fmas."""
    a0, b0 = _pairs(x0, LANES)
    c0, d0 = _pairs(y0, LANES)
    a1, b1 = _pairs(x1, LANES)
    c1, d1 = _pairs(y1, LANES)
    return tl.sum(tl.fma(b1, d1, tl.fma(a1, c1, tl.fma(b0, d0, a0 * c0))), axis=1)


@triton.jit
def _capped_logits(block_ptr, cols, n, cap, cap_in, MASKED: tl.constexpr,
                   SOFTCAP: tl.constexpr, ACC: tl.constexpr, HINT: tl.constexpr):
    """``_load_logits`` through the head's softcap when ``SOFTCAP`` (-inf past the row's end
    still: the padding of a partial block counts for nothing)."""
    x = _load_logits(block_ptr, cols, n, MASKED, ACC, HINT)
    if SOFTCAP:
        x, _ = softcap(x, cap, cap_in, ACC)
        if MASKED:
            x = tl.where(cols < n, x, float("-inf"))
    return x


@triton.jit
def _logsumexp_block(block_ptr, n, c, cap, cap_in, m, s, w, BLOCK_V: tl.constexpr,
                     LANES: tl.constexpr, MASKED: tl.constexpr, WITH_ENTROPY: tl.constexpr,
                     SOFTCAP: tl.constexpr, ACC: tl.constexpr, EVICT: tl.constexpr):
    """(m, s, w) of each line after the block of logits at ``block_ptr`` (``row_logsumexp``;
    ``n``: the logits left in the row, read only when ``MASKED``)."""
    cols = _half_columns(BLOCK_V, LANES)
    x0 = _capped_logits(block_ptr, cols, n, cap, cap_in, MASKED, SOFTCAP, ACC,
                        _KEEP if EVICT else _NO_HINT)
    x1 = _capped_logits(block_ptr + BLOCK_V // 2, cols, n - BLOCK_V // 2, cap, cap_in, MASKED,
                        SOFTCAP, ACC, _KEEP if EVICT else _NO_HINT)
    m_new = tl.maximum(m, tl.maximum(tl.max(x0, axis=1), tl.max(x1, axis=1)))
    moved = (m - m_new) * c              # <= 0; -inf only where m - m_new overflows
    u0 = (x0 - m_new[:, None]) * c       # -inf at a -inf logit or a padding lane
    u1 = (x1 - m_new[:, None]) * c
    if WITH_ENTROPY:
        # exp2 == 0 below LOG_TINY, so the clamps change nothing but keep 0 * -inf out of w
        moved = tl.maximum(moved, LOG_TINY)
        u0 = tl.maximum(u0, LOG_TINY)
        u1 = tl.maximum(u1, LOG_TINY)
    alpha = tl.math.exp2(moved)
    e0 = tl.math.exp2(u0)
    e1 = tl.math.exp2(u1)
    if WITH_ENTROPY:
        w = tl.fma(alpha, tl.fma(moved, s, w), _line_dot(e0, u0, e1, u1, LANES))
    s = tl.fma(alpha, s, tl.sum(e0 + e1, axis=1))
    return m_new, s, w


@triton.jit
def row_logsumexp(row_ptr, V, inv_temp, cap, cap_in, BLOCK_V: tl.constexpr,
                  WITH_ENTROPY: tl.constexpr, SOFTCAP: tl.constexpr, ACC: tl.constexpr,
                  EVICT: tl.constexpr, NUM_STAGES: tl.constexpr):
    """(m, log s, entropy) of ``z = x * inv_temp``: ``m`` the row's max logit x (before the
    temperature), ``log s`` = log sum e^((x - m) / tau), so that ``lse = m / tau + log s``, and
    the entropy (0 unless ``WITH_ENTROPY``), what the forward saves and the vocabulary-parallel
    combination reads. ``EVICT``: the loads ask L2 to keep the row (it is read again);
    ``NUM_STAGES``: ``COMPILER_STAGES`` or the pipelining depth of the loop.

    Each thread keeps, for each of its lines (``_half_columns``), a running max ``m`` of the
    logits x (before the temperature), ``s = sum 2^u`` and ``w = sum 2^u u`` over
    ``u = (x - m) c``, ``c = log2(e) / tau`` (bits): a block costs a thread one max over each
    line and no exchange with other threads; the lines are combined once after the loop. Moving
    a line's max from m to m' rescales ``s' = a s`` and ``w' = a (w + (m - m') c s)`` with
    ``a = 2^((m - m') c)``. The sum needs no change of units (sum 2^((x - m) c) = sum e^(z -
    m / tau)), w is in bits: ``entropy = lse - sum p z = log s - ln 2 w / s``. Each ``x - m`` is
    taken before it is scaled, so a large logit is never rounded into an exponent.

    Every consumer of (m, log s) takes its difference to m before the temperature, as the sum
    does: a log-prob is ``(x - m) / tau - log s`` (``target_logprob``), with no large number
    rounded into it (exactly 0 for a row of one logit), and no product x / tau is ever formed,
    so that logits up to the dtype's largest take any temperature without overflow.

    x is the row's logit, or with ``SOFTCAP`` its softcap ``cap tanh(logit cap_in)``
    (``head_functions.HeadParams``), formed as each block is read.

    Full blocks are read without a mask, the partial last block after them. A line's ``m``
    starts at the lowest finite value, so logits of any size count and a line that has seen only
    -inf has a finite shift (its s stays 0; a row of -inf gets m = log s = -inf). The clamps of
    the entropy at ``LOG_TINY`` (where 2^u is 0 already) keep ``0 * inf`` out of w, also where
    ``m - m'`` overflows (logits of +-1e38).

    exp2 in fp32 flushes results below 2^-126 to 0 (MUFU.EX2; the interpreter does not). A
    line's s holds its max's term 2^0 = 1; what the flush drops is at most V terms 2^u < 2^-126
    and rescales a s with a < 2^-126, s <= V (in w the same times |u| <= 149, as 2^u is 0 in
    fp32 below u = -149): less than 2^-80 in all for V < 2^20, so log s and the entropy move by
    less than 2^-80, far below their fp32 rounding. fp64 takes exp2 at full precision.
    """
    LANES: tl.constexpr = 128 // row_ptr.dtype.element_ty.primitive_bitwidth
    inv_temp = tl.cast(inv_temp, ACC)     # a float argument is fp32 on a GPU
    c = inv_temp * LOG2E
    if ACC == tl.float64:
        lowest = -1.7976931348623157e308
    else:
        lowest = -3.4028234663852886e38
    m = tl.full([BLOCK_V // (2 * LANES)], lowest, ACC)
    s = tl.zeros([BLOCK_V // (2 * LANES)], ACC)
    w = tl.zeros([BLOCK_V // (2 * LANES)], ACC)
    n_full = V // BLOCK_V
    # Two spellings of one loop: a loop without a num_stages attribute is not the same loop as
    # any tl.range(num_stages=k) (and older Tritons cannot take num_stages=None from a
    # constexpr).
    block_ptr = row_ptr
    if NUM_STAGES == COMPILER_STAGES:
        for _ in range(0, n_full):
            m, s, w = _logsumexp_block(block_ptr, V, c, cap, cap_in, m, s, w, BLOCK_V, LANES,
                                       False, WITH_ENTROPY, SOFTCAP, ACC, EVICT)
            block_ptr += BLOCK_V
    else:
        for _ in tl.range(0, n_full, num_stages=NUM_STAGES):
            m, s, w = _logsumexp_block(block_ptr, V, c, cap, cap_in, m, s, w, BLOCK_V, LANES,
                                       False, WITH_ENTROPY, SOFTCAP, ACC, EVICT)
            block_ptr += BLOCK_V
    if n_full * BLOCK_V < V:
        m, s, w = _logsumexp_block(row_ptr + n_full * BLOCK_V, V - n_full * BLOCK_V, c, cap,
                                   cap_in, m, s, w, BLOCK_V, LANES, True, WITH_ENTROPY,
                                   SOFTCAP, ACC, EVICT)
    # the lines combined: the row's max, each line rescaled to it
    row_max = tl.max(m, axis=0)
    moved = tl.maximum((m - row_max) * c, LOG_TINY)
    alpha = tl.math.exp2(moved)
    total = tl.sum(alpha * s, axis=0)
    log_s = tl.log(total)
    entropy = tl.zeros((), ACC)
    if WITH_ENTROPY:
        entropy = log_s - LN2 * tl.sum(alpha * tl.fma(moved, s, w), axis=0) / total
    # every logit -inf: no line left the finite start (total = 0, m = log s = -inf)
    return tl.where(total > 0, row_max, float("-inf")), log_s, entropy


@triton.jit
def dlogits_coefficients(inv_temp, cap, cap_in, log_s, entropy, g, h, SOFTCAP: tl.constexpr,
                         ACC: tl.constexpr):
    """``(c, log2 s, a, b, g_y)`` of ``row_write_dlogits``' formula, elementwise: of one row
    (scalars) or of a tile's rows (vectors); ``inv_temp`` in ``ACC``."""
    a = -(g + h * entropy) * inv_temp
    b = -(h * LN2) * inv_temp
    g_y = g * inv_temp
    if SOFTCAP:   # the scale of the softcap's derivative, once per row
        scale = tl.cast(cap, ACC) * tl.cast(cap_in, ACC)
        a *= scale
        b *= scale
        g_y *= scale
    return inv_temp * LOG2E, log_s * LOG2E, a, b, g_y


@triton.jit
def dlogits_of(x, m, c, log_s2, a, b, WITH_ENTROPY: tl.constexpr):
    """``p (a + b log2 p)`` of ``row_write_dlogits``' formula at the (softcapped) logits
    ``x``, the target's ``g_y`` and the softcap's derivative not yet applied."""
    q = tl.fma(x - m, c, -log_s2)     # log2 p
    if WITH_ENTROPY:
        q = tl.maximum(q, LOG_TINY)     # 2^q == 0 below: keeps 0 * -inf out of p (a + b q)
        d = tl.math.exp2(q) * tl.fma(b, q, a)
    else:
        d = tl.math.exp2(q) * a
    return d


@triton.jit
def _dlogits_half(x_ptr, d_ptr, cols, n, y, c, cap, cap_in, m, log_s2, a, b, g_y,
                  MASKED: tl.constexpr, TARGET: tl.constexpr, WITH_ENTROPY: tl.constexpr,
                  SOFTCAP: tl.constexpr, ACC: tl.constexpr, EVICT: tl.constexpr):
    """dL/dlogits at ``x_ptr + cols`` into ``d_ptr + cols`` (``_dlogits_block``): ``y`` and
    ``n`` (the logits left in the row) counted from ``x_ptr``."""
    x = _load_logits(x_ptr, cols, n, MASKED, ACC, _STREAM if EVICT else _NO_HINT)
    if SOFTCAP:
        x, dcap = softcap(x, cap, cap_in, ACC)
    d = dlogits_of(x, m, c, log_s2, a, b, WITH_ENTROPY)
    if TARGET:
        d = tl.where(cols == y, d + g_y, d)
    if SOFTCAP:
        d = d * dcap
    if MASKED:
        tl.store(d_ptr + cols, d.to(d_ptr.dtype.element_ty), mask=cols < n,
                 eviction_policy=_STREAM if EVICT else _NO_HINT)
    else:
        tl.store(d_ptr + cols, d.to(d_ptr.dtype.element_ty),
                 eviction_policy=_STREAM if EVICT else _NO_HINT)


@triton.jit
def _dlogits_block(row, block, BLOCK_V: tl.constexpr, LANES: tl.constexpr,
                   MASKED: tl.constexpr, TARGET: tl.constexpr, WITH_ENTROPY: tl.constexpr,
                   SOFTCAP: tl.constexpr, ACC: tl.constexpr, EVICT: tl.constexpr):
    """dL/dlogits of the logits of ``block`` (``row_write_dlogits``, whose ``row`` holds the
    row's pointers, size, target and coefficients), a half at a time (``_half_columns``);
    ``TARGET``: the block may hold the target column ``y``; ``MASKED``: the partial last
    block."""
    row_ptr, drow_ptr, V, y, c, cap, cap_in, m, log_s2, a, b, g_y = row
    start = block * BLOCK_V
    cols = _half_columns(BLOCK_V, LANES)
    for half in tl.static_range(2):
        offset = start + half * (BLOCK_V // 2)
        _dlogits_half(row_ptr + offset, drow_ptr + offset, cols, V - offset, y - offset,
                      c, cap, cap_in, m, log_s2, a, b, g_y, MASKED, TARGET, WITH_ENTROPY,
                      SOFTCAP, ACC, EVICT)


@triton.jit
def row_write_dlogits(row_ptr, drow_ptr, V, target, inv_temp, cap, cap_in, m, log_s, entropy, g,
                      h, BLOCK_V: tl.constexpr, WITH_ENTROPY: tl.constexpr,
                      SOFTCAP: tl.constexpr, ACC: tl.constexpr, EVICT: tl.constexpr,
                      NUM_STAGES: tl.constexpr, ORDER: tl.constexpr):
    """Writes dL/dlogits of one row, given g = dL/dlogp and h = dL/dentropy.

    With z = x / tau, p = softmax(z), lse = m + log s, logp = z[y] - lse, H = lse - sum_u p_u z_u:
      dlogp/dz_v = 1[v = y] - p_v
      dH/dz_v    = -p_v (z_v - zbar),   zbar = sum_u p_u z_u = lse - H,
                   so z_v - zbar = (z_v - lse) + H = log p_v + H
      dL/dx_v    = ( g (1[v = y] - p_v) - h p_v (log p_v + H) ) / tau
                 = 1[v = y] g / tau + p_v (a + b log2 p_v),
                   a = -(g + h H) / tau,  b = -h ln 2 / tau
    with log2 p_v = (x_v - m) log2(e) / tau - log s log2(e) (the statistics of
    ``row_logsumexp``), the difference taken before it is scaled, so that a large m or lse is
    never rounded into it. With ``SOFTCAP`` x_v is the softcap of the
    logit l_v and dL/dl_v = dL/dx_v cap cap_in (1 - tanh^2(l_v cap_in)) (``_tanh``).

    The loop writes the full blocks without a mask and without the target: the block that holds
    column y (when it is a full one) and the partial last block are written apart, the only
    ones that compare columns with y (in int32; a target outside [0, V) matches none). Blocks
    in ``ORDER`` (``BLOCK_ORDERS``; those two first when backward, last when forward);
    ``EVICT``: the loads and stores go first out of L2 (the row has been read for the last
    time, dlogits is not read here again); ``NUM_STAGES``: ``COMPILER_STAGES`` or the
    pipelining depth of the loop.

    exp2 in fp32 flushes p_v < 2^-126 to 0 (MUFU.EX2; the interpreter does not), which moves
    dL/dx_v by less than 2^-126 (|a| + 149 |b|) (|log2 p_v| < 149 wherever fp32 holds
    p_v > 0): 10^-38 of the row's scale |a| + |b|, below every tolerance a test holds dlogits
    to (fp32: 4e-7 of max(1, max |dL/dx|)).
    """
    LANES: tl.constexpr = 128 // row_ptr.dtype.element_ty.primitive_bitwidth
    c, log_s2, a, b, g_y = dlogits_coefficients(tl.cast(inv_temp, ACC), cap, cap_in, log_s,
                                                entropy, g, h, SOFTCAP, ACC)
    in_vocab = (target >= 0) & (target < V)
    y = tl.where(in_vocab, target, -1).to(tl.int32)
    n_full = V // BLOCK_V
    has_tail = n_full * BLOCK_V < V
    # the target's block; a target in the tail or outside the row counts as the tail's
    y_block = tl.where(in_vocab, y // BLOCK_V, n_full)
    apart = y_block < n_full
    n_loop = n_full - apart.to(tl.int32)
    row = (row_ptr, drow_ptr, V, y, c, cap, cap_in, m, log_s2, a, b, g_y)
    if ORDER == ORDER_BACKWARD:
        if has_tail:
            _dlogits_block(row, n_full, BLOCK_V, LANES, True, True, WITH_ENTROPY,
                           SOFTCAP, ACC, EVICT)
        if apart:
            _dlogits_block(row, y_block, BLOCK_V, LANES, False, True, WITH_ENTROPY,
                           SOFTCAP, ACC, EVICT)
    # the i-th full block other than the target's, in ORDER
    if NUM_STAGES == COMPILER_STAGES:
        for i in range(0, n_loop):
            k = i
            if ORDER == ORDER_BACKWARD:
                k = n_loop - 1 - i
            block = k + (k >= y_block).to(tl.int32)
            _dlogits_block(row, block, BLOCK_V, LANES, False, False, WITH_ENTROPY,
                           SOFTCAP, ACC, EVICT)
    else:
        for i in tl.range(0, n_loop, num_stages=NUM_STAGES):
            k = i
            if ORDER == ORDER_BACKWARD:
                k = n_loop - 1 - i
            block = k + (k >= y_block).to(tl.int32)
            _dlogits_block(row, block, BLOCK_V, LANES, False, False, WITH_ENTROPY,
                           SOFTCAP, ACC, EVICT)
    if ORDER == ORDER_FORWARD:
        if apart:
            _dlogits_block(row, y_block, BLOCK_V, LANES, False, True, WITH_ENTROPY,
                           SOFTCAP, ACC, EVICT)
        if has_tail:
            _dlogits_block(row, n_full, BLOCK_V, LANES, True, True, WITH_ENTROPY,
                           SOFTCAP, ACC, EVICT)


@triton.jit
def row_write_zeros(drow_ptr, V, BLOCK_V: tl.constexpr, EVICT: tl.constexpr):
    """Zeros over one row of dlogits (``EVICT``: the stores go first out of L2)."""
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        tl.store(drow_ptr + cols, tl.zeros([BLOCK_V], drow_ptr.dtype.element_ty), mask=cols < V,
                 eviction_policy=_STREAM if EVICT else _NO_HINT)


@triton.jit
def at(i, stride_i, j, stride_j):
    """The offset i stride_i + j stride_j of element (i, j), in int64 (i, j: the int32 indices
    of ``program_token``)."""
    return tl.cast(i, tl.int64) * stride_i + tl.cast(j, tl.int64) * stride_j


@triton.jit
def program_token(row, mask_ptr, T, S, offset, stride_mb, stride_mt, HAS_MASK: tl.constexpr):
    """(token, b, s, t, in_window, is_actor) of ``row``, the flat index b S + s of a row of
    ``[B, S, V]`` logits (one program per row: its program id, a 1-D grid with no
    grid-dimension limit). Row s predicts the token t = s - offset of the ``[B, T]`` inputs
    (``token = b T + t``, int64); a row outside the window [offset, offset + T) is no actor (its
    t is clamped to 0 and must not be used), nor is a masked one."""
    # Rows number less than 2^31 (a grid dimension): b, s, t stay int32 (one register each
    # where a row's state lives through its loops), offsets are formed in int64 (``at``; tl.cast
    # also takes the Python ints of the interpreter's row loops).
    b = tl.cast(row // S, tl.int32)
    s = tl.cast(row % S, tl.int32)
    t = s - offset
    in_window = (t >= 0) & (t < T)
    t = tl.where(in_window, t, 0)
    is_actor = in_window
    if HAS_MASK:
        is_actor = in_window & (tl.load(mask_ptr + at(b, stride_mb, t, stride_mt),
                                        mask=in_window, other=0) != 0)
    return tl.cast(b, tl.int64) * T + t, b, s, t, in_window, is_actor


@triton.jit
def program_row(row, targets_ptr, mask_ptr, T, S, offset, stride_yb, stride_yt, stride_mb,
                stride_mt, HAS_MASK: tl.constexpr):
    """(token, b, s, target id, in_window, is_actor): ``program_token`` and the target of the
    row (read only for actor rows)."""
    token, b, s, t, in_window, is_actor = program_token(row, mask_ptr, T, S, offset, stride_mb,
                                                        stride_mt, HAS_MASK)
    y = tl.load(targets_ptr + at(b, stride_yb, t, stride_yt), mask=is_actor, other=0)
    return token, b, s, y.to(tl.int64), in_window, is_actor


@triton.jit
def target_column(y, V):
    """The target id ``y`` as an int32 column of a row of ``V`` logits; -1 for one outside
    [0, V) (possible only with validation off)."""
    return tl.where((y >= 0) & (y < V), y, -1).to(tl.int32)


@triton.jit
def load_target_logit(row_ptr, column, cap, cap_in, SOFTCAP: tl.constexpr, ACC: tl.constexpr):
    """x[y] of a row (the logit, or its softcap with ``SOFTCAP``, before the temperature) at
    the ``target_column``; NaN for a target outside the row, which is never read."""
    x_y = tl.load(row_ptr + tl.maximum(column, 0)).to(ACC)
    if SOFTCAP:
        x_y, _ = softcap(x_y, cap, cap_in, ACC)
    return tl.where(column >= 0, x_y, float("nan"))


@triton.jit
def target_logprob(x_y, inv_temp, m, log_s):
    """log p[y] = (x[y] - m) / tau - log s of the statistics of ``row_logsumexp``: the
    difference to m taken first, as there."""
    return tl.fma(x_y - m, tl.cast(inv_temp, x_y.dtype), -log_s)
