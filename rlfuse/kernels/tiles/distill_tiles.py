"""Distillation from a batch-invariant student head, from tiles that never leave the chip: each
program forms the logits of ``BLOCK_M`` rows and one vocabulary block of the student's head and
of the teacher's (``head_tiles.head_tile``, in the compute dtype, as ``linear_distill`` forms a
chunk's; a teacher given as logits: its rows' block read in place), turns them into log-probs
with the rows' statistics (the heads' from ``head_blocks`` reduced by
``tile_stats.combine_blocks``) and sums the divergence's terms over the block
(``divergence_functions``, ``tile_stats.tree_sum``): ``[C, V / VOCAB_BLOCK, 2]`` sums, added
over the blocks in order by ``tile_stats.sum_blocks``. The backward forms both tiles again,
turns them into the student's gradient (rounded to the weight's dtype as ``linear_distill``
rounds its chunk's) and adds it into the gradients of the student's hidden states (each row's
over the vocabulary blocks in order) and weight and bias (over the rows in order, no atomics):
every row's bits its own whatever the batch.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..._types import compute_dtype
from ..rows.distill import log_probs_of
from ..lib.divergence_functions import divergence_args
from ..lib.head_functions import HeadParams
from .head_tiles import BLOCK_H, LOGITS_DTYPE, add_tile_product, head_tile, kept_rows
from .matmul import BLOCK_K, BLOCK_M, NUM_WARPS, dot_modes
from ..lib.utils import Flags, empty, fp64_values, tl_compute_dtype
from .tile_stats import BLOCK_IDS, HALF_BLOCK, VOCAB_BLOCK, sum_blocks, tree_sum

# Columns of the per-row statistics the kernels read: each model's max and log-sum (the
# ``DISTILL_STATS`` of ``kernels.rows.distill``, aux last)
_N_STATS = tl.constexpr(5)
_HALF_STEPS = tl.constexpr(6)      # log2(HALF_BLOCK)
# The kernels' FLAGS: each head's bias and softcap, the teacher given as logits, each model's
# matmul modes (``matmul.dot_modes``), the backward's wanted gradients
HEAD_PAIR_FLAGS = Flags("S_BIAS", "T_BIAS", "S_SOFTCAP", "T_SOFTCAP", "T_LOGITS", "IEEE",
                        "UPCAST", "T_IEEE", "T_UPCAST", "NEED_WEIGHT", "NEED_BIAS")
(_S_BIAS, _T_BIAS, _S_SOFTCAP, _T_SOFTCAP, _T_LOGITS, _IEEE, _UPCAST, _T_IEEE, _T_UPCAST,
 _NEED_WEIGHT, _NEED_BIAS) = HEAD_PAIR_FLAGS.bits()


@triton.jit
def _both_halves(sh_ptr, sw_ptr, sb_ptr, th_ptr, tw_ptr, tb_ptr, rows, start, C, V, H_s, H_t,
                 s_strides, t_strides, stats, s_head, t_head, FLAGS: tl.constexpr,
                 ACC: tl.constexpr, BLOCK_K: tl.constexpr):
    """``(s, t, ds, cols)``: both models' log-probs of ``rows`` and the ``HALF_BLOCK`` ids from
    ``start`` (``stats``: the rows' ``(m_s, log s_s, m_t, log s_t, aux)``; ``s_strides``,
    ``t_strides``: each model's hidden states' and weight's strides) and the softcap's
    derivative of the student's. ``T_LOGITS``: the teacher's logits read from memory (a row
    ``c``'s at the element offset ``tw_ptr[c]`` from ``th_ptr``, unit stride), not formed."""
    S_BIAS: tl.constexpr = (_S_BIAS & FLAGS) != 0
    T_BIAS: tl.constexpr = (_T_BIAS & FLAGS) != 0
    S_SOFTCAP: tl.constexpr = (_S_SOFTCAP & FLAGS) != 0
    T_SOFTCAP: tl.constexpr = (_T_SOFTCAP & FLAGS) != 0
    IEEE: tl.constexpr = (_IEEE & FLAGS) != 0
    UPCAST: tl.constexpr = (_UPCAST & FLAGS) != 0
    T_IEEE: tl.constexpr = (_T_IEEE & FLAGS) != 0
    T_UPCAST: tl.constexpr = (_T_UPCAST & FLAGS) != 0
    cols = start + tl.arange(0, HALF_BLOCK)
    inside = cols[None, :] < V
    if _T_LOGITS & FLAGS:
        # read (and taken to log-probs) before the student's tile is formed: registers free
        # for its products. Every row in [0, C) is a position of the teacher's (a masked one's
        # values never count); ids past V read V - 1's (in bounds, never counted: -inf)
        row_at = tl.load(tw_ptr + rows, mask=rows < C, other=0)
        y = tl.load(th_ptr + row_at[:, None] + tl.minimum(cols, V - 1)[None, :]).to(ACC)
        t, unused_dt = log_probs_of(y, inside, stats[2][:, None], stats[3][:, None], t_head,
                                    T_SOFTCAP, ACC)
        x = head_tile(sh_ptr, sw_ptr, sb_ptr, rows, cols, C, V, H_s, s_strides[0],
                      s_strides[1], s_strides[2], s_strides[3], S_BIAS, IEEE, UPCAST, ACC, ACC,
                      BLOCK_K)
    else:
        x = head_tile(sh_ptr, sw_ptr, sb_ptr, rows, cols, C, V, H_s, s_strides[0],
                      s_strides[1], s_strides[2], s_strides[3], S_BIAS, IEEE, UPCAST, ACC, ACC,
                      BLOCK_K)
        y = head_tile(th_ptr, tw_ptr, tb_ptr, rows, cols, C, V, H_t, t_strides[0],
                      t_strides[1], t_strides[2], t_strides[3], T_BIAS, T_IEEE, T_UPCAST, ACC,
                      ACC, BLOCK_K)
        t, unused_dt = log_probs_of(y, inside, stats[2][:, None], stats[3][:, None], t_head,
                                    T_SOFTCAP, ACC)
    s, ds = log_probs_of(x, inside, stats[0][:, None], stats[1][:, None], s_head, S_SOFTCAP,
                         ACC)
    return s, t, ds, cols


@triton.jit
def _scalars(s_head_args, t_head_args, hyper, ACC: tl.constexpr):
    """Both heads' ``(inv_temp, cap, cap_in)`` and the divergence's parameters."""
    return (fp64_values(s_head_args, ACC), fp64_values(t_head_args, ACC),
            fp64_values(hyper, ACC))


@triton.jit
def _row_stats(stats_ptr, rows, live, ACC: tl.constexpr):
    """The rows' ``(m_s, log s_s, m_t, log s_t, aux)`` (0 at rows not ``live``)."""
    at = stats_ptr + rows.to(tl.int64) * _N_STATS
    return (tl.load(at, mask=live, other=0.0).to(ACC),
            tl.load(at + 1, mask=live, other=0.0).to(ACC),
            tl.load(at + 2, mask=live, other=0.0).to(ACC),
            tl.load(at + 3, mask=live, other=0.0).to(ACC),
            tl.load(at + 4, mask=live, other=0.0).to(ACC))


@triton.jit(do_not_specialize=["C"])   # one binary for any row count
def _distill_blocks_kernel(
    sh_ptr, sw_ptr, sb_ptr, th_ptr, tw_ptr, tb_ptr,         # pointers: both heads (TwoHeads)
    keep_ptr, stats_ptr, out_ptr,                           # the rows; their statistics; out
    C, V, H_s, H_t, NB,                                     # sizes
    s_wv, s_wk, t_wv, t_wk,                                 # strides of the weights
    s_head_args, t_head_args, hyper,                        # scalars: heads, divergence
    DIVERGENCE: tl.constexpr, FLAGS: tl.constexpr, ACC: tl.constexpr,   # HEAD_PAIR_FLAGS
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # one program per BLOCK_M rows and vocabulary block: out [C, NB, 2] (the divergence's terms
    # and aux terms summed over the block)
    s_head, t_head, params = _scalars(s_head_args, t_head_args, hyper, ACC)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    block = tl.program_id(1)
    live = kept_rows(rows, C, keep_ptr)
    stats = _row_stats(stats_ptr, rows, live, ACC)
    term = tl.zeros([BLOCK_M], ACC)
    aux = tl.zeros([BLOCK_M], ACC)
    for half in tl.static_range(2):
        s, t, unused_ds, unused_cols = _both_halves(
            sh_ptr, sw_ptr, sb_ptr, th_ptr, tw_ptr, tb_ptr, rows,
            block * BLOCK_IDS + half * HALF_BLOCK, C, V, H_s, H_t, (H_s, 1, s_wv, s_wk),
            (H_t, 1, t_wv, t_wk), stats, s_head, t_head, FLAGS, ACC, BLOCK_K)
        term_v, aux_v, unused_grad = DIVERGENCE(s, t, tl.zeros_like(s), params)
        term += tree_sum(term_v, _HALF_STEPS)
        aux += tree_sum(aux_v, _HALF_STEPS)
    at = out_ptr + (rows.to(tl.int64) * NB + block) * 2
    tl.store(at, term, mask=live)
    tl.store(at + 1, aux, mask=live)


@triton.jit
def _student_dlogits(sh_ptr, sw_ptr, sb_ptr, th_ptr, tw_ptr, tb_ptr, rows, live, start, C, V,
                     H_s, H_t, s_strides, t_strides, stats, g, s_head, t_head, params,
                     DIVERGENCE: tl.constexpr, FLAGS: tl.constexpr, ACC: tl.constexpr,
                     GRAD: tl.constexpr, BLOCK_K: tl.constexpr):
    """``(the student's gradient, cols)`` of ``rows`` and the ``HALF_BLOCK`` ids from
    ``start``: ``g ∂D/∂z_v`` times the softcap's derivative (``g``: each row's upstream
    gradient over the temperature, ``_backward_rows``), 0 past ``V`` and at rows not ``live``,
    rounded to ``GRAD`` (the weight's dtype)."""
    s, t, ds, cols = _both_halves(sh_ptr, sw_ptr, sb_ptr, th_ptr, tw_ptr, tb_ptr, rows, start,
                                  C, V, H_s, H_t, s_strides, t_strides, stats, s_head,
                                  t_head, FLAGS, ACC, BLOCK_K)
    unused_term, unused_aux, d = DIVERGENCE(s, t, stats[4][:, None], params)
    d = g[:, None] * d * ds
    return tl.where(live[:, None] & (cols[None, :] < V), d, 0.0).to(GRAD), cols


@triton.jit
def _backward_rows(rows, C, keep_ptr, stats_ptr, dvalue_ptr, s_head, S_SOFTCAP: tl.constexpr,
                   ACC: tl.constexpr):
    """``(live, stats, g)`` of ``rows``: whether each counts, its statistics (``_row_stats``)
    and its upstream gradient times ``dz/dlogit`` (the temperature's, and the softcap's
    constant factor ``cap cap_in``)."""
    live = kept_rows(rows, C, keep_ptr)
    g = tl.load(dvalue_ptr + rows, mask=live, other=0.0).to(ACC) * s_head[0]
    if S_SOFTCAP:
        g = g * s_head[1] * s_head[2]
    return live, _row_stats(stats_ptr, rows, live, ACC), g


@triton.jit(do_not_specialize=["C"])   # one binary for any row count
def _distill_dhidden_kernel(
    sh_ptr, sw_ptr, sb_ptr, th_ptr, tw_ptr, tb_ptr,         # pointers: both heads (TwoHeads)
    keep_ptr, stats_ptr, dvalue_ptr, dh_ptr,                # rows; statistics; upstream; out
    C, V, H_s, H_t, NB,                                     # sizes
    s_wv, s_wk, t_wv, t_wk,                                 # strides of the weights
    s_head_args, t_head_args, hyper,                        # scalars: heads, divergence
    DIVERGENCE: tl.constexpr, FLAGS: tl.constexpr, ACC: tl.constexpr,   # HEAD_PAIR_FLAGS
    GRAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # one program per BLOCK_M rows: dh [C, H_s] (fp32, zeros) += the student's gradient's tiles
    # times its weight, the vocabulary blocks in order
    IEEE: tl.constexpr = (_IEEE & FLAGS) != 0
    UPCAST: tl.constexpr = (_UPCAST & FLAGS) != 0
    s_head, t_head, params = _scalars(s_head_args, t_head_args, hyper, ACC)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    live, stats, g = _backward_rows(rows, C, keep_ptr, stats_ptr, dvalue_ptr, s_head,
                                    (_S_SOFTCAP & FLAGS) != 0, ACC)
    for block in range(NB):
        for half in tl.static_range(2):
            d, cols = _student_dlogits(
                sh_ptr, sw_ptr, sb_ptr, th_ptr, tw_ptr, tb_ptr, rows, live,
                block * BLOCK_IDS + half * HALF_BLOCK, C, V, H_s, H_t,
                (H_s, 1, s_wv, s_wk), (H_t, 1, t_wv, t_wk), stats, g, s_head, t_head,
                params, DIVERGENCE, FLAGS, ACC, GRAD, BLOCK_K)
            add_tile_product(dh_ptr, H_s, rows, live, d, sw_ptr, cols, cols < V, s_wv, s_wk,
                             H_s, IEEE, UPCAST, BLOCK_H)


@triton.jit(do_not_specialize=["C"])   # one binary for any row count
def _distill_dweight_kernel(
    sh_ptr, sw_ptr, sb_ptr, th_ptr, tw_ptr, tb_ptr,         # pointers: both heads (TwoHeads)
    keep_ptr, stats_ptr, dvalue_ptr, dw_ptr, db_ptr,        # rows; statistics; upstream; out
    C, V, H_s, H_t,                                         # sizes
    s_wv, s_wk, t_wv, t_wk,                                 # strides of the weights
    s_head_args, t_head_args, hyper,                        # scalars: heads, divergence
    DIVERGENCE: tl.constexpr, FLAGS: tl.constexpr, ACC: tl.constexpr,   # HEAD_PAIR_FLAGS
    GRAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # one program per HALF_BLOCK ids: dw [V, H_s] (fp32) += the student's gradient's tiles
    # transposed times its hidden rows, the rows in order (no atomics); db [V] += their sums
    IEEE: tl.constexpr = (_IEEE & FLAGS) != 0
    UPCAST: tl.constexpr = (_UPCAST & FLAGS) != 0
    NEED_BIAS: tl.constexpr = (_NEED_BIAS & FLAGS) != 0
    s_head, t_head, params = _scalars(s_head_args, t_head_args, hyper, ACC)
    start = tl.program_id(0) * HALF_BLOCK
    cols = start + tl.arange(0, HALF_BLOCK)
    dbias = tl.zeros((HALF_BLOCK,), ACC)
    for tile in range(0, C, BLOCK_M):
        rows = tile + tl.arange(0, BLOCK_M)
        live, stats, g = _backward_rows(rows, C, keep_ptr, stats_ptr, dvalue_ptr, s_head,
                                        (_S_SOFTCAP & FLAGS) != 0, ACC)
        d, unused_cols = _student_dlogits(
            sh_ptr, sw_ptr, sb_ptr, th_ptr, tw_ptr, tb_ptr, rows, live, start, C, V, H_s, H_t,
            (H_s, 1, s_wv, s_wk), (H_t, 1, t_wv, t_wk), stats, g, s_head, t_head,
            params, DIVERGENCE, FLAGS, ACC, GRAD, BLOCK_K)
        if _NEED_WEIGHT & FLAGS:
            add_tile_product(dw_ptr, H_s, cols, cols < V, tl.trans(d), sh_ptr, rows, live, H_s,
                             1, H_s, IEEE, UPCAST, BLOCK_H)
        if NEED_BIAS:
            dbias += tl.sum(d.to(ACC), axis=0)
    if NEED_BIAS:
        at = db_ptr + cols
        tl.store(at, tl.load(at, mask=cols < V, other=0.0) + dbias, mask=cols < V)


class TwoHeads:
    """The launch arguments of a student's head (``hidden [C, H_s]``, ``weight [V, H_s]``,
    ``bias``, ``HeadParams``) and a teacher over the same ``C`` rows, the divergence's
    ``terms`` between them, and ``keep [C]``: the rows that count. The teacher: its head
    (``t_hidden [C, H_t]``, ``t_weight [V, H_t]``, ``t_bias``; each model's hidden rows made
    contiguous), or with ``t_weight`` None its logits (``t_hidden``: any tensor whose last
    dimension is the vocabulary at unit stride, read in place, a row ``c`` at the element
    offset ``t_rows[c]``). ``student``, ``teacher``: each model's ``(hidden, weight, bias)``."""

    def __init__(self, hidden, weight, bias, head: HeadParams, t_hidden, t_weight, t_bias,
                 t_head: HeadParams, keep: torch.Tensor, terms,
                 t_rows: Optional[torch.Tensor] = None):
        from_logits = t_weight is None
        t_vocab = t_hidden.shape[-1] if from_logits else t_weight.shape[0]
        if t_vocab != weight.shape[0]:
            raise ValueError(f"teacher: the student's vocabulary of {weight.shape[0]} ids, "
                             f"got {t_vocab}")
        hidden = hidden.contiguous()
        if not from_logits:
            t_hidden = t_hidden.contiguous()
        self.student, self.teacher = (hidden, weight, bias), (t_hidden, t_weight, t_bias)
        self.C, self.V = hidden.shape[0], weight.shape[0]
        self.grad_dtype = LOGITS_DTYPE[weight.dtype]
        divergence, hyper = divergence_args(terms)
        (s_args, s_cap), (t_args, t_cap) = head.kernel_args(), t_head.kernel_args()
        ieee, upcast = dot_modes(hidden.dtype)
        t_ieee, t_upcast = dot_modes(t_hidden.dtype)
        if from_logits:
            if t_hidden.stride(-1) != 1:
                raise ValueError("teacher.logits: read in place at unit stride over the "
                                 f"vocabulary, got stride {t_hidden.stride(-1)}")
            t_pointers = (t_hidden, t_rows.contiguous(), t_hidden)
            t_sizes, t_strides = 0, (0, 1)
        else:
            t_pointers = (t_hidden, t_weight, t_weight if t_bias is None else t_bias)
            t_sizes, t_strides = t_hidden.shape[1], (t_weight.stride(0), t_weight.stride(1))
        self.pointers = (hidden, weight, weight if bias is None else bias, *t_pointers,
                         keep.to(torch.uint8))
        self.sizes = (hidden.shape[1], t_sizes)
        self.strides = (weight.stride(0), weight.stride(1), *t_strides)
        self.scalars = (s_args, t_args, hyper)
        self.acc = compute_dtype(weight.dtype)
        self.flags = dict(S_BIAS=bias is not None, T_BIAS=t_bias is not None, S_SOFTCAP=s_cap,
                          T_SOFTCAP=t_cap, T_LOGITS=from_logits, IEEE=ieee, UPCAST=upcast,
                          T_IEEE=t_ieee, T_UPCAST=t_upcast)
        self.constexprs = dict(DIVERGENCE=divergence, ACC=tl_compute_dtype(weight.dtype),
                               BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS)

    def flags_word(self, need_weight: bool = False, need_bias: bool = False) -> int:
        """The kernels' ``FLAGS``: these heads' with the gradients a backward wants."""
        return HEAD_PAIR_FLAGS.word(**self.flags, NEED_WEIGHT=need_weight,
                                    NEED_BIAS=need_bias)


def distill_blocks(heads: TwoHeads, stats: torch.Tensor) -> torch.Tensor:
    """``[C, 2]``: each row's divergence and aux sum (``kernels.rows.distill``'s) between the two
    heads of ``heads`` for the rows' ``stats [C, DISTILL_STATS]`` (each model's max and
    log-sum as ``combine_blocks`` gives them), from tiles formed on the chip, summed over each
    block then over the blocks in order; rows not kept: unspecified."""
    NB = triton.cdiv(heads.V, VOCAB_BLOCK)
    blocks = empty((heads.C, NB, 2), dtype=heads.acc, device=stats.device)
    if heads.C and NB:
        _distill_blocks_kernel[(triton.cdiv(heads.C, BLOCK_M), NB)](
            *heads.pointers, stats.contiguous(), blocks, heads.C, heads.V, *heads.sizes, NB,
            *heads.strides, *heads.scalars, FLAGS=heads.flags_word(), **heads.constexprs,
            num_stages=1)      # no spill in fp32 beside a teacher's logits (SASS test)
    return sum_blocks(blocks)


def distill_head_backward(heads: TwoHeads, stats: torch.Tensor, dvalue: torch.Tensor,
                          dhidden: Optional[torch.Tensor], dweight: Optional[torch.Tensor],
                          dbias: Optional[torch.Tensor]) -> None:
    """The gradients of ``distill_blocks``' divergences for ``dvalue [C]`` (``stats``: with the
    forward's aux in its last column) added into the student's ``dhidden [C, H_s]``,
    ``dweight [V, H_s]`` and ``dbias [V]`` (contiguous, in the compute dtype; None: not
    wanted) from both heads' tiles formed again on the chip, the student's gradient rounded to
    its weight's dtype; rows not kept count for nothing, whatever their hidden states.
    ``dhidden``: each row's over the vocabulary blocks in order; ``dweight``, ``dbias``: over
    the rows in order (no atomics)."""
    C, V = heads.C, heads.V
    common = (*heads.pointers, stats.contiguous(), dvalue.contiguous())
    constexprs = dict(heads.constexprs, GRAD=heads.grad_dtype, BLOCK_H=BLOCK_H)
    if C and dhidden is not None:
        _distill_dhidden_kernel[(triton.cdiv(C, BLOCK_M),)](
            *common, dhidden, C, V, *heads.sizes, triton.cdiv(V, VOCAB_BLOCK),
            *heads.strides, *heads.scalars, FLAGS=heads.flags_word(), **constexprs)
    if C and (dweight is not None or dbias is not None):
        _distill_dweight_kernel[(triton.cdiv(V, HALF_BLOCK),)](
            *common, dweight, dbias, C, V, *heads.sizes, *heads.strides, *heads.scalars,
            FLAGS=heads.flags_word(dweight is not None, dbias is not None), **constexprs)
