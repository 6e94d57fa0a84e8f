"""A head's rows chunk by chunk: the one walk every head op takes (``HeadChunks``), a chunk's
logits by one matmul, and the gradients of the hidden states, weight and bias that the chunks
add up (cuBLAS, or the fixed-order matmul of a batch-invariant head, ``kernels.tiles.matmul``, or
for
its log-probs from the logits' tiles formed again on the chip, ``kernels.tiles.head_tiles``), summed
over a split vocabulary's group at the end. An op supplies what happens to each chunk: its row
kernels (its epilogue)."""
from __future__ import annotations

from typing import Iterator, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..._types import compute_dtype
from ...kernels.tiles.matmul import fixed_matmul
from ...scaleout import sequence, vocab


def chunk_logits(h_rows: Tensor, weight: Tensor, bias: Optional[Tensor],
                 batch_invariant: bool = False, fp32: bool = False) -> Tensor:
    """``[C, 1, V]`` logits of a chunk of hidden rows (a batch of C one-token rows for the row
    kernels), in the weight's dtype (accumulated in fp32); ``batch_invariant``: by the
    fixed-order matmul (``kernels.tiles.matmul``), each row's bits its own whatever the chunk;
    ``fp32``: in fp32, the accumulation never rounded to a bf16 / fp16 weight's dtype (on CUDA
    one matmul with an fp32 output; elsewhere of the inputs cast, exact in fp32; an fp64
    weight's stay fp64)."""
    dtype = torch.float32 if fp32 and weight.dtype != torch.float64 else weight.dtype
    if batch_invariant:
        return fixed_matmul(h_rows, weight.t(), bias=bias, dtype=dtype).unsqueeze(1)
    if dtype == weight.dtype:
        return torch.nn.functional.linear(h_rows, weight, bias).unsqueeze(1)
    if _fp32_output(h_rows, dtype):
        logits = torch.mm(h_rows, weight.t(), out_dtype=dtype)
    else:
        logits = h_rows.to(dtype) @ weight.t().to(dtype)
    if bias is not None:
        logits += bias.to(dtype)
    return logits.unsqueeze(1)


# cuBLAS matmuls of bf16 / fp16 inputs with an fp32 output (torch's mm / addmm with out_dtype:
# CUDA)
_FP32_OUTPUT_MATMUL = ("dtype_out" in torch.ops.aten.addmm.overloads()
                       and "dtype" in torch.ops.aten.mm.overloads())


def _fp32_output(a: Tensor, dtype: torch.dtype) -> bool:
    return a.dtype != dtype and a.is_cuda and _FP32_OUTPUT_MATMUL


def add_product(out: Tensor, a: Tensor, b: Tensor, batch_invariant: bool = False) -> None:
    """``out += a @ b`` for an fp32 ``out`` (the weight gradient over the chunks), accumulated
    in fp32 without a ``[V, H]`` product: ``batch_invariant``, the fixed-order matmul into
    ``out``; on CUDA one matmul into ``out`` (bf16 / fp16 inputs with an fp32 output);
    elsewhere the chunk-sized ``a`` and ``b`` in ``out``'s dtype."""
    if batch_invariant:
        fixed_matmul(a, b, out=out, accumulate=True)
    elif _fp32_output(a, out.dtype):
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    else:
        out.addmm_(a.to(out.dtype), b.to(out.dtype))


def product(a: Tensor, b: Tensor, dtype: torch.dtype, batch_invariant: bool = False) -> Tensor:
    """``a @ b`` in ``dtype``, rounded once (``batch_invariant``: by the fixed-order matmul; on
    CUDA an fp32 output of bf16 / fp16 inputs)."""
    if batch_invariant:
        return fixed_matmul(a, b, dtype=dtype)
    if _fp32_output(a, dtype):
        return torch.mm(a, b, out_dtype=dtype)
    return (a @ b).to(dtype)


class HeadGradients:
    """The gradients of hidden (in its dtype), weight and bias (accumulated in fp32) that the
    chunks add up; empty tensors stand for the ones nobody needs. ``group_name``: the head is a
    shard of a vocabulary split over that group, and the hidden states' gradient, a partial sum
    of each rank's, is kept in the compute dtype and summed over the group by ``results``.
    ``batch_invariant``: the products by the fixed-order matmul (``kernels.tiles.matmul``), and that
    sum in rank order (``vocab.ordered_sum``).
    ``row_blocks``: the rows are every rank's sequence shard (``scaleout.sequence``), and the
    hidden states' gradient is reduce-scattered to this rank's instead."""

    def __init__(self, hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
                 needs: Tuple[bool, bool, bool], group_name: str = "",
                 batch_invariant: bool = False, row_blocks: int = 0):
        self.weight, self.bias, self.group_name = weight, bias, group_name
        self.batch_invariant, self.row_blocks = batch_invariant, row_blocks
        acc = compute_dtype(weight.dtype)
        dhidden_dtype = compute_dtype(hidden.dtype) if group_name else hidden.dtype
        self.dhidden = (torch.zeros(hidden.shape, dtype=dhidden_dtype, device=hidden.device)
                        .reshape(-1, hidden.shape[-1]) if needs[0] else None)
        self.dweight = torch.zeros(weight.shape, dtype=acc, device=weight.device) \
            if needs[1] else None
        self.dbias = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) \
            if needs[2] and bias is not None else None

    def add(self, dlogits: Tensor, h_rows: Tensor, rows: Tensor) -> None:
        """dL/dh = dlogits W, dL/dW += dlogits^T h, dL/db += sum of dlogits, for one chunk."""
        dlogits = dlogits.squeeze(1)
        if self.dhidden is not None:
            self.dhidden.index_copy_(0, rows, product(dlogits, self.weight, self.dhidden.dtype,
                                                      self.batch_invariant))
        if self.dweight is not None:
            add_product(self.dweight, dlogits.t(), h_rows, self.batch_invariant)
        if self.dbias is not None:
            self.dbias += dlogits.sum(0, dtype=self.dbias.dtype)

    def add_tiles(self, h_rows: Tensor, rows: Tensor, backward) -> None:
        """``add`` of a batch-invariant chunk's hidden rows ``h_rows`` from its logits' tiles
        formed again on the chip by ``backward(dhidden, dweight, dbias)``, which adds into
        them (``kernels.tiles.head_tiles.head_backward`` for log-probs,
        ``kernels.tiles.distill_tiles.distill_head_backward`` for a divergence): no ``[C, V]``
        tensor, each row's hidden-state gradient its own over the vocabulary blocks in order,
        the weight's and bias's summed over the rows in order."""
        dh = None if self.dhidden is None else \
            torch.zeros(h_rows.shape, dtype=compute_dtype(h_rows.dtype), device=h_rows.device)
        backward(dh, self.dweight, self.dbias)
        if dh is not None:
            self.dhidden.index_copy_(0, rows, dh.to(self.dhidden.dtype))

    def results(self, hidden: Tensor, weight: Tensor,
                accumulated: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
        """The three gradients in their tensors' dtypes (the hidden states' summed over the
        group first, once however often this is called: one all-reduce, or with ``row_blocks``
        one reduce-scatter to this rank's rows, the others 0), a new empty tensor for each one
        not computed (an op's outputs alias nothing). ``accumulated``: the weight's and the
        bias's as accumulated (fp32), for a backward that scales and casts them at once."""
        if self.group_name and self.dhidden is not None:
            if self.row_blocks:
                sequence.sum_to_own_rows(self.dhidden, self.row_blocks, self.group_name,
                                         self.batch_invariant)
            else:
                vocab.group_sum(self.dhidden, self.group_name, self.batch_invariant)
            self.group_name = ""
        dhidden = None if self.dhidden is None else self.dhidden.view(hidden.shape).to(hidden.dtype)

        def of_weight(grad):
            if grad is None:
                return weight.new_empty(0)
            return grad if accumulated else grad.to(weight.dtype)

        return (hidden.new_empty(0) if dhidden is None else dhidden,
                of_weight(self.dweight), of_weight(self.dbias))


class Chunk(NamedTuple):
    """One chunk of a head's rows: ``tokens``, their flat positions ``b T + t`` in the ``[B,
    T]`` inputs; ``rows``, their flat hidden rows ``b S + offset + t``; ``hidden``, those rows
    ``[C, H]``."""

    tokens: Tensor
    rows: Tensor
    hidden: Tensor


class HeadChunks:
    """The chunks of ``chunk_tokens`` positions of a head's window (``hidden [B, S, H]``, the
    rows ``[offset, offset + T)`` for ``positions [B, T]``; with ``gather``, the positions of
    ``mask`` only, which reads it on the host), in order (``for chunk in chunks``); a chunk's
    logits ``[C, 1, V]`` formed by one matmul (``logits``: in the weight's dtype, ``fp32``: in
    fp32; ``batch_invariant``: by the fixed-order matmul); and, with ``needs`` (which of the
    hidden states, weight and bias need a gradient), where each chunk's gradient goes
    (``add``, ``add_tiles``; ``gradients`` at the end: ``HeadGradients``, over a split's
    ``group_name`` and ``row_blocks``)."""

    def __init__(self, hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
                 positions: Tensor, mask: Optional[Tensor], offset: int, chunk_tokens: int,
                 gather: bool, *, batch_invariant: bool = False, fp32: bool = False,
                 needs: Optional[Sequence[bool]] = None, group_name: str = "",
                 row_blocks: int = 0):
        B, S, H = hidden.shape
        T = positions.shape[1]
        if gather and mask is not None:
            tokens = mask.reshape(-1).nonzero().squeeze(1)
        else:
            tokens = torch.arange(B * T, device=hidden.device)
        rows = (tokens // T) * S + offset + tokens % T
        self._chunks = list(zip(tokens.split(chunk_tokens), rows.split(chunk_tokens)))
        self._flat = hidden.reshape(-1, H)
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self.batch_invariant, self.fp32 = batch_invariant, fp32
        self.grads = None if needs is None else HeadGradients(
            hidden, weight, bias, tuple(needs), group_name, batch_invariant, row_blocks)

    def __iter__(self) -> Iterator[Chunk]:
        for tokens, rows in self._chunks:
            yield Chunk(tokens, rows, self._flat[rows])

    def logits(self, chunk: Chunk) -> Tensor:
        return chunk_logits(chunk.hidden, self.weight, self.bias, self.batch_invariant,
                            self.fp32)

    def add(self, chunk: Chunk, dlogits: Tensor) -> None:
        """The chunk's gradient ``dlogits [C, 1, V]`` (in the weight's dtype) into the three."""
        self.grads.add(dlogits, chunk.hidden, chunk.rows)

    def add_tiles(self, chunk: Chunk, backward) -> None:
        """The chunk's gradient from its logits' tiles on the chip (``HeadGradients.add_tiles``)."""
        self.grads.add_tiles(chunk.hidden, chunk.rows, backward)

    def gradients(self, accumulated: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
        """``(dhidden, dweight, dbias)`` (``HeadGradients.results``)."""
        return self.grads.results(self.hidden, self.weight, accumulated)
