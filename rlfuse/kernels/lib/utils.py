"""Launch helpers shared by every kernel module: interpreter detection, named codes, block-size
tables, output allocation, the layout arguments of ``[B, T]`` inputs, fp64 scalars."""
from __future__ import annotations

import math
import os
import struct
import warnings
from typing import Optional

import torch
import triton
import triton.language as tl

# `@triton.jit` picks the interpreter when the kernels are decorated, i.e. when this package is
# imported (``_dispatch.INTERPRET`` is the same decision).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _index_scalars_of_any_shape() -> None:
    """Triton 3.6's interpreter (and older ones) turns a scalar into a Python int (``range(0,
    n)`` over a computed ``n``) with ``int()`` of its one-element array, which numpy >= 2.4
    refuses for an array of one dimension; Triton 3.9's squeezes it first, as this does for the
    older ones."""
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "squeezes_index", False):
        return

    def patched(tensor, *scope):
        patch(tensor, *scope)
        index = lambda self: int(self.handle.data.squeeze())  # noqa: E731
        if scope:   # restored after the kernel by the scope, as Triton's own patches
            scope[0].set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index

    patched.squeezes_index = True
    interpreter._patch_lang_tensor = patched


if INTERPRET:
    # The interpreter runs the kernels on numpy, which warns about IEEE results (log 0, inf *
    # 0, overflow) in the lanes a kernel computes and then discards with tl.where, as a GPU
    # does silently.
    warnings.filterwarnings("ignore", category=RuntimeWarning,
                            module="triton.runtime.interpreter")
    _index_scalars_of_any_shape()

# What every freshly allocated kernel output is filled with (None: nothing). Tests set NaN (-1 for
# integers), so that an element a kernel forgets to write fails the comparison instead of passing
# by luck; the compile-only driver (``tools/gpu_compile.py``), whose launches write nothing, 0.
OUTPUT_FILL = None

# Vocabulary block per loop iteration, by logits element size: large enough to keep many loads in
# flight, small enough that the fp32 working set of a block stays in registers.
_MAX_BLOCK_V = {2: 8192, 4: 4096, 8: 2048}
# The narrowest block: a row helper's thread reads a line of two 16-byte loads from each block
# (``logprobs.row_logsumexp``), 16 logits of 2 bytes.
_MIN_BLOCK_V = 16


def constexpr_codes(names, *wanted):
    """The codes (positions in ``names``) of the names ``wanted``, as ``tl.constexpr`` for the
    kernels; launchers and kernels share them, so no code or column is a literal number. A name
    missing from ``names`` fails at import."""
    return tuple(tl.constexpr(names.index(name)) for name in wanted)


class Flags:
    """A kernel's boolean options in one constexpr word ``FLAGS``, one bit each in the order of
    ``names``: the launcher packs them (``word(NAME=bool, ...)``, every name given), the kernel
    reads one with its bit (``bits()``, module-level constexprs) at compile time:
    ``NAME: tl.constexpr = (NAME_BIT & FLAGS) != 0`` (the bit first: the interpreter passes
    ``FLAGS`` as an int, which has no ``&`` with a constexpr). A narrow signature, the same
    binaries."""

    def __init__(self, *names: str):
        self.names = names

    def bits(self):
        return tuple(tl.constexpr(1 << i) for i in range(len(self.names)))

    def word(self, **values: bool) -> int:
        if set(values) != set(self.names):
            raise TypeError(f"flags: expected {self.names}, got {tuple(values)}")
        return sum(1 << i for i, name in enumerate(self.names) if values[name])

    def reads(self, word, name: str) -> bool:
        """Whether a launch's ``FLAGS`` (an int, or its text in a compiled kernel's
        constexprs) has ``name`` set."""
        return bool(int(word) >> self.names.index(name) & 1)


def vocab_launch_config(vocab_size: int, element_size: int, block_v=None, num_warps=None):
    """(BLOCK_V, num_warps) for a kernel that streams one row of ``vocab_size`` logits: from the
    table, or ``block_v`` / ``num_warps`` when given (a block is never wider than the row's next
    power of two, nor narrower than 16; the warps follow the block unless given)."""
    block = max(_MIN_BLOCK_V, min(triton.next_power_of_2(vocab_size),
                                  block_v or _MAX_BLOCK_V[element_size]))
    if num_warps is None:
        num_warps = 4 if block <= 1024 else (8 if block <= 4096 else 16)
    return block, num_warps


def tl_compute_dtype(dtype: torch.dtype):
    """The kernels' ACC: ``compute_dtype`` as a Triton dtype."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def empty(shape, *, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.empty`` for kernel outputs, filled with ``OUTPUT_FILL`` when it is set."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if OUTPUT_FILL is not None:
        integer_fill = 0 if OUTPUT_FILL == 0 else -1
        out.fill_(OUTPUT_FILL if dtype.is_floating_point else integer_fill)
    return out


def time_block(T: int) -> int:
    """Time block of a kernel that streams one row (or row block) of ``[B, T]`` data."""
    return max(16, min(1024, triton.next_power_of_2(max(T, 1))))


def group_tile(T: int, group_size: int):
    """(BLOCK_M, BLOCK_T, num_warps) of the [group rows, time] tile of a one-program-per-group
    kernel: at most 4096 elements (BLOCK_T shrinks as groups grow, down to 1), and more warps
    for large groups, so that a thread holds a few elements of each tile and of each per-row
    vector (no register spill up to groups of 4096)."""
    block_m = triton.next_power_of_2(group_size)
    block_t = max(1, min(triton.next_power_of_2(max(T, 1)), 4096 // block_m))
    num_warps = 4 if block_m <= 64 else (8 if block_m <= 256 else 16)
    return block_m, block_t, num_warps


def fp64_parts(x: float):
    """``x`` as ``(hi, lo)``, two fp32-representable floats whose fp64 sum is ``x`` to 48 bits:
    Triton passes a Python float to a GPU kernel as fp32, so a kernel that computes in fp64
    takes a hyper-parameter as ``hi + lo``."""
    try:
        hi = struct.unpack("f", struct.pack("f", x))[0]   # x rounded to fp32
    except OverflowError:
        hi = math.inf
    return (hi, x - hi) if math.isfinite(hi) else (x, 0.0)  # beyond fp32: inf on a GPU


def mask_args(mask: Optional[torch.Tensor]):
    """(pointer tensor, stride_b, stride_t) of an optional bool mask, as uint8 without a copy."""
    if mask is None:
        return None, 0, 0
    mask = mask.view(torch.uint8)
    return mask, mask.stride(0), mask.stride(1)


def token_strides(x: Optional[torch.Tensor]):
    """(stride_b, stride_t) of a per-token [B, T] tensor, a per-row [B] one (broadcast over t)
    or None (0, 0)."""
    if x is None:
        return 0, 0
    return (x.stride(0), 0) if x.dim() == 1 else (x.stride(0), x.stride(1))


def token_tensor(x: Optional[torch.Tensor]):
    """A per-token ``[B, T]`` tensor (or per-row ``[B]``, or None) as the kernels take it: the
    tuple ``(pointer, stride_b, stride_t)`` (``token_strides``) that ``token_at`` reads."""
    return (x,) + token_strides(x)


def fp64_args(values):
    """Float hyper-parameters as a kernel takes them: a tuple of their ``fp64_parts`` pairs,
    which ``fp64_values`` turns into the compute dtype."""
    return tuple(fp64_parts(float(v)) for v in values)


def ones_if_none(x: Optional[torch.Tensor], like: torch.Tensor):
    """``token_tensor(x)``, or for None a single 1 that a kernel reads with strides (0, 0)."""
    return (like.new_ones(()), 0, 0) if x is None else token_tensor(x)


@triton.jit
def fp64_pair(hi, lo, ACC: tl.constexpr):
    """A float argument passed as its ``fp64_parts``, in the compute dtype: ``hi + lo`` in
    fp64, ``hi`` in fp32."""
    x = hi
    if ACC == tl.float64:
        x = (tl.zeros((), tl.float64) + hi) + lo
    return x


@triton.jit
def fp64_values(pairs, ACC: tl.constexpr):
    """The tuple of ``fp64_args``' values in the compute dtype (``fp64_pair`` each)."""
    values = ()
    for i in tl.static_range(len(pairs)):
        values = values + (fp64_pair(pairs[i][0], pairs[i][1], ACC),)
    return values


@triton.jit
def token_at(x, b, t):
    """The address of element (b, t) of a ``token_tensor`` ``x`` (b, t: int32 or int64)."""
    return x[0] + tl.cast(b, tl.int64) * x[1] + tl.cast(t, tl.int64) * x[2]


LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
LOG2E_HI = tl.constexpr(1.4426950216293335)       # log2(e) rounded to fp32
LOG2E_LO = tl.constexpr(1.92596298909109e-08)     # log2(e) - LOG2E_HI
_LN2_HI = tl.constexpr(0.693145751953125)          # ln 2 to 16 bits: k ln2_hi is exact
_LN2_LO = tl.constexpr(1.4286068202862268e-06)     # ln 2 - _LN2_HI


@triton.jit
def exp_accurate(x):
    """e^x to a few units of fp32 rounding where ``tl.exp`` is ``ex2.approx`` of ``x log2(e)``,
    whose product carries the rounding of x into the exponent (a relative error up to ~4e-6 at
    |x| = 88): x = k ln 2 + r with an integer k and r formed exactly by two fmas of ln 2's hi and
    lo parts, e^x = 2^(r log2 e) 2^(k/2) 2^(k - k/2), |r log2 e| <= 1/2. Overflow to inf,
    underflow to 0 and NaN as ``tl.exp``. fp64: ``tl.exp`` (full precision)."""
    y = tl.exp(x)
    if x.dtype != tl.float64:
        xc = tl.minimum(tl.maximum(x, -104.0), 89.0)   # e^x is 0 below, inf above
        k = tl.floor(tl.fma(xc, LOG2E, 0.5))
        r = tl.fma(k, -_LN2_LO, tl.fma(k, -_LN2_HI, xc))
        half = tl.floor(k * 0.5)
        y = tl.math.exp2(r * LOG2E) * tl.math.exp2(half) * tl.math.exp2(k - half)
        y = tl.where(x == x, y, x)
    return y


@triton.jit
def load_tile(ptr, rows, cols, stride_b, stride_t, mask, ACC: tl.constexpr):
    """The ``[rows, cols]`` tile of a ``[B, T]`` tensor in the compute dtype, 0 where ``mask`` is
    False: masked positions are never read, so garbage there (NaN, -inf) cannot leak."""
    offsets = rows[:, None] * stride_b + cols[None, :] * stride_t
    return tl.load(ptr + offsets, mask=mask, other=0.0).to(ACC)
