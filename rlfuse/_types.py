"""The small value types of the public API."""
from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional

import torch


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """Where rlfuse accumulates: fp64 when any of the inputs is fp64 (for gradcheck), fp32
    otherwise."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


class LossOutput(NamedTuple):
    """What every loss returns: the scalar ``loss`` (0-dim fp32, differentiable) and detached
    0-dim ``metrics``."""

    loss: torch.Tensor
    metrics: Dict[str, torch.Tensor]


class Logits(NamedTuple):
    """A policy given as logits rather than log-probs.

    ``logits [B, S, V]`` (any batch/time strides) may be a model's whole output:
    ``logits[b, offset + t]`` predicts ``targets[b, t]`` (``[B, T]`` integer ids,
    ``S >= offset + T``), so ``Logits(out.logits, input_ids[:, 1:])`` needs no slice. Log-probs
    are ``log_softmax(logits / temperature)``. A loss that receives a ``Logits`` computes the
    log-probs itself and, in the fused path, writes the gradient w.r.t. the whole ``logits``
    (zero rows outside the window) without materialising a ``[B, T, V]`` fp32 temporary or a
    slice's gradient buffer; with ``inplace_backward=True`` it writes it into the logits' own
    buffer (only safe when nothing else needs the logits afterwards; the reference ignores it):
    a single-pass loss does so during the call, and bumps the logits' version so that autograd
    refuses a consumer that saved them before.

    ``index`` (packed, padding-free rows): ``logits [N, V]`` and ``targets [N]`` hold the rows
    of many sequences back to back, ``index [N]`` (int64) each row's flat position ``b T + t`` in
    the loss's ``[B, T]`` inputs, or -1 for a row no loss position uses (a prompt token; it gets
    zero gradient); ``rlfuse.packed_index`` builds it from ``cu_seqlens``.
    ``vocab_parallel_group``: a ``torch.distributed`` process group over which the vocabulary
    is split (Megatron's convention: rank r holds the ids ``[r V_local, (r + 1) V_local)`` in
    its ``logits[..., :V_local]``); targets are global ids, every rank gets the same log-probs,
    entropy and loss, and the gradient of its own shard. ``batch_invariant``: each row's
    log-prob and entropy from fixed vocabulary blocks combined in one order, the bits of a
    ``LinearHead(..., batch_invariant=True)`` whose logits these are, on one rank or a split
    of any number of ranks (shards of whole blocks of 128 ids); the losses then take two passes
    over the logits. Pass ``offset``, ``index``, ``vocab_parallel_group`` and
    ``batch_invariant`` by keyword.
    """

    logits: torch.Tensor
    targets: torch.Tensor
    temperature: float = 1.0
    inplace_backward: bool = False
    offset: int = 0
    index: Optional[torch.Tensor] = None
    vocab_parallel_group: Optional[Any] = None
    batch_invariant: bool = False


class TopK(NamedTuple):
    """A teacher given as its top-k next-token log-probs (a teacher server's, verl's
    distillation): ``ids [B, T, k]`` (integer ids of the vocabulary) and ``logprobs [B, T, k]``
    (the teacher's log-probs there, <= 0), for ``rlfuse.distill_loss`` with ``ForwardKL``."""

    ids: torch.Tensor
    logprobs: torch.Tensor


class LinearHead(NamedTuple):
    """A policy given as the last hidden state and the output head: ``logits = hidden @
    weight.T + bias``, never materialised beyond one chunk of tokens in the fused path.

    ``hidden [B, S, H]`` (row ``offset + t`` predicts ``targets[:, t]``, ``targets [B, T]``),
    ``weight [V, H]`` (the ``lm_head`` weight, tied to the embedding or not), ``bias [V]`` or
    None, all of one floating dtype and device. Gradients go to whichever of ``hidden``,
    ``weight``, ``bias`` require them (``weight``'s accumulated in fp32 over the chunks).
    ``chunk_tokens``: tokens per chunk (default: about ``T H / V`` for ``T`` positions, a
    multiple of 64, at least 64, at most H and 1 GiB of logits, so that a chunk's logits are
    about as large as the hidden states and never larger than the weight; or a budget of
    chunk-logit bytes in the environment variable ``RLFUSE_CHUNK_BYTES``). ``index`` and
    ``vocab_parallel_group`` as for :class:`Logits`: packed ``hidden [N, H]`` and ``targets [N]``; a ``weight [V_local,
    H]`` (and ``bias``) shard per rank, whose hidden-state gradient is summed over the group.
    What models put after the output projection, in this order, then the temperature:
    ``logit_scale`` (a positive factor: Cohere's ``logit_scale``, Granite's ``1 /
    logits_scaling``) and ``softcap`` (``cap tanh(logits / cap)``, Gemma 2/3's
    ``final_logit_softcapping``; None: none), so that log-probs are ``log_softmax(softcap(
    logit_scale (hidden @ weight.T + bias)) / temperature)``; the fused path applies both, and
    the softcap's derivative, in its row kernels (fp32 or fp64, on the logits as the matmul
    stored them). ``head_dtype``: the dtype of the chunk matmuls, ``hidden``, ``weight`` and
    ``bias`` cast to it (differentiably: each gradient in its tensor's dtype); e.g.
    ``torch.float32`` for an fp32 head over bf16 hidden states (TRL's
    ``cast_lm_head_to_fp32``). Without it the three share one dtype (under autocast: the
    autocast dtype). ``sequence_parallel`` (with a ``vocab_parallel_group``, Megatron's
    sequence parallelism): ``hidden [B, S / W, H]`` holds this rank's slice of the rows of every
    sequence (rank r: rows ``[r S / W, (r + 1) S / W)``; packed: ``hidden [N / W, H]``, rank r
    the rows ``[r N / W, (r + 1) N / W)``), ``targets``, ``offset`` and ``index`` those of all
    the rows; the rows are gathered before anything else (``scaleout.sequence``), every rank
    gets every row's results, and the hidden-state gradient of its own rows.
    ``batch_invariant``: each row's log-prob, entropy, per-token loss terms and hidden-state
    gradient bitwise independent of the other rows of the call (their number and values, the
    row's position, ``chunk_tokens``, packed or padded rows, the window), and every gradient
    the same run to run: the fused path forms the logits and the gradients' products by a
    matmul of one fixed tile configuration and reduction order (``kernels.matmul``), the
    reference each row's logits by its own matmul. Pass ``offset``, ``chunk_tokens``, ``index``,
    ``vocab_parallel_group``, ``logit_scale``, ``softcap``, ``head_dtype``,
    ``sequence_parallel`` and ``batch_invariant`` by keyword.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    targets: torch.Tensor
    bias: Optional[torch.Tensor] = None
    temperature: float = 1.0
    offset: int = 0
    chunk_tokens: Optional[int] = None
    index: Optional[torch.Tensor] = None
    vocab_parallel_group: Optional[Any] = None
    logit_scale: float = 1.0
    softcap: Optional[float] = None
    head_dtype: Optional[torch.dtype] = None
    sequence_parallel: bool = False
    batch_invariant: bool = False


class SequenceCounts(NamedTuple):
    """The counts of whole sequences of which a rank holds chunks (context parallelism): each
    sequence's actor tokens ``[B]`` (summed over the ranks) and the sequences' padded length."""

    tokens: torch.Tensor
    length: int
