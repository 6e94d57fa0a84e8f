"""``LinearHead``: a policy given as the last hidden state and the output head — and what it
does as a policy form: its checks, its rows, the dtype of its matmuls, its local tensors and
its rows over a split (``RankRowsHead``: each rank's own rows; ``GatheredRowsHead``: every
rank's rows of sequence parallelism)."""
from __future__ import annotations

import contextlib
from typing import Any, NamedTuple, Optional

import torch

from .._types import compute_dtype
from ..checks.policy import (PolicyInfo, check_form_targets, check_head, check_head_dtype,
                             check_packed, check_window)
from ..scaleout import layout
from ..scaleout.dtensor import DTensor, is_dtensor, local_fields
from ..scaleout.rank_rows import MeanOverRanks, every_ranks_rows
from ..scaleout.sequence import gather_rows
from ..scaleout.vocab import SumGradOverGroup, vocab_group_size
from ..shared.head import linear_row_by_row, scaled_logits
from .logits import Logits


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
    matmul of one fixed tile configuration and reduction order (``kernels.tiles.matmul``), the
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

    # ---------------------------------------------------------------------------------------
    # What a policy form does (``rlfuse.forms``)
    # ---------------------------------------------------------------------------------------

    kind = "head"      # which of the implementations' form ops run it
    own_rows = False   # its rows are every rank's (``RankRowsHead``: a rank's own)

    @property
    def device(self) -> Optional[torch.device]:
        return getattr(self.hidden, "device", None)

    @property
    def vocab_size(self) -> int:
        """The ids of this rank's head (its shard under a ``vocab_parallel_group``)."""
        return self.weight.shape[0]

    @property
    def rows(self) -> torch.Tensor:
        """The tensor whose leading dimensions are the rows (``[B, S, H]``, packed ``[N, H]``)."""
        return self.hidden

    @property
    def row_blocks(self) -> int:
        """The blocks of every rank's rows its hidden states hold (``GatheredRowsHead``); 0:
        its own rows."""
        return 0

    def with_rows(self, reshape) -> "LinearHead":
        """The same policy with ``reshape`` applied to its rows and targets, no index (the
        packed rows laid out as a batch: ``scaleout.layout``)."""
        return self._replace(hidden=reshape(self.hidden), targets=reshape(self.targets),
                             index=None)

    def check_policy(self, loss_shape=None) -> PolicyInfo:
        """Its shapes, dtypes and devices as a loss's policy (``checks.policy.check_policy``)."""
        if self.vocab_parallel_group is not None:
            vocab_group_size(self.vocab_parallel_group)
        hidden = self.hidden
        if self.index is not None:
            check_head(self, 2)
            shape = check_packed(hidden, self, loss_shape)
        else:
            check_head(self, 3)
            check_window(self.targets, self.offset, batch=hidden.shape[0], rows=hidden.shape[1],
                         device=hidden.device)
            shape = self.targets.shape
        return PolicyInfo(tuple(shape), hidden.device, compute_dtype(hidden.dtype))

    def check_targets(self, mask, shape, validate: bool) -> None:
        """Its temperature and targets (``checks.policy.check_form_targets``)."""
        vocab = self.vocab_size
        if self.vocab_parallel_group is not None:
            vocab *= vocab_group_size(self.vocab_parallel_group)
        check_form_targets(self, vocab, mask, shape, validate)

    def for_matmul(self, autocast: Optional[torch.dtype] = None) -> "LinearHead":
        """Its hidden states, weight and bias cast (differentiably: their gradients come back
        in their own dtypes) to the dtype of its matmuls: its ``head_dtype``, else ``autocast``
        (what autocast casts a linear layer's inputs to; fp64 stays fp64), else none."""
        check_head_dtype(self.head_dtype)
        dtype = self.head_dtype

        def cast(x):
            if not isinstance(x, torch.Tensor) or not x.is_floating_point():
                return x
            if dtype is not None:
                return x.to(dtype)
            return x if autocast is None or x.dtype == torch.float64 else x.to(autocast)

        if dtype is None and autocast is None:
            return self
        return self._replace(hidden=cast(self.hidden), weight=cast(self.weight),
                             bias=cast(self.bias))

    def prepared(self) -> "LinearHead":
        """Ready to run: its local tensors (``local``), every rank's rows (``gathered``)."""
        return self.local().gathered()

    def local(self) -> "LinearHead":
        """Its local tensors: a weight that is a DTensor sharded on its rows (``Shard(0)``)
        becomes its shard and the mesh dimension's group (``scaleout.dtensor``); plain hidden
        states beside it are this rank's own rows (a ``RankRowsHead``)."""
        if DTensor is None or not any(isinstance(x, DTensor) for x in self):
            return self             # plain tensors throughout
        found = local_fields(self, "policy.weight", self.weight, 0,
                             {"hidden": self.hidden, "targets": self.targets,
                              "index": self.index, "bias": self.bias})
        if found is None:
            return self
        fields, mesh, mesh_dim = found
        own_rows = not is_dtensor(self.hidden)
        head = self._replace(vocab_parallel_group=mesh.get_group(mesh_dim), **fields)
        if not own_rows:
            return head
        # plain hidden states: this rank's own rows, the shards' gradients their ranks' mean
        ranks = mesh.size(mesh_dim)
        head = head._replace(weight=MeanOverRanks.apply(head.weight, ranks), bias=None if
                             head.bias is None else MeanOverRanks.apply(head.bias, ranks))
        return RankRowsHead(*head)

    def gathered(self) -> "LinearHead":
        """With ``sequence_parallel``, the split head over every rank's rows, a
        ``GatheredRowsHead`` (its hidden states gathered along the rows: dim 1 of ``[B, S / W,
        H]``, dim 0 of packed ``[N / W, H]``, ``scaleout.sequence``); else itself."""
        if not self.sequence_parallel:
            return self
        if self.vocab_parallel_group is None:
            raise ValueError("policy.sequence_parallel: the rows are split over the "
                             "vocab_parallel_group (Megatron's tensor-parallel group); pass it")
        vocab_group_size(self.vocab_parallel_group)
        hidden = self.hidden
        if not isinstance(hidden, torch.Tensor) or hidden.dim() not in (2, 3):
            got = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else hidden
            raise ValueError(f"policy.hidden: expected [B, S / W, H] (or packed [N / W, H]) "
                             f"under sequence_parallel, got {got}")
        dim = hidden.dim() - 2
        return GatheredRowsHead(*self)._replace(
            hidden=gather_rows(hidden, dim, self.vocab_parallel_group.group_name),
            sequence_parallel=False)


    def beside_rows(self, index) -> "LinearHead":
        """As a teacher beside a student's packed rows ``index`` (its own, the same): as one
        batch of rows (``scaleout.layout.as_rows``)."""
        return layout.as_rows(self)

    def every_ranks_rows(self, mask):
        """None: its rows are the same on every rank of a split (``RankRowsHead``: its own)."""
        return None

    def as_logits(self) -> Logits:
        """The ``Logits`` it defines: ``softcap(logit_scale (hidden @ weight.T + bias))``, all
        of it (the definition), the matmul in its ``head_dtype`` when it has one
        (``batch_invariant``: each row by its own matmul). Under a ``vocab_parallel_group``
        that is this rank's shard, and the hidden states' gradient is summed over the group."""
        head = self.for_matmul()
        hidden, group = head.hidden, head.vocab_parallel_group
        if group is not None:
            hidden = SumGradOverGroup.apply(hidden, group)
        # the matmul in head_dtype, whatever autocast says
        with contextlib.nullcontext() if self.head_dtype is None else \
                torch.autocast(hidden.device.type, enabled=False):
            if self.batch_invariant:   # each row by its own matmul: its bits its own
                logits = linear_row_by_row(hidden, head.weight, head.bias)
            else:
                logits = torch.nn.functional.linear(hidden, head.weight, head.bias)
        if self.logit_scale != 1.0 or self.softcap is not None:
            logits = scaled_logits(logits, self.logit_scale, self.softcap)
        return Logits(logits, self.targets, self.temperature, offset=self.offset,
                      index=self.index, vocab_parallel_group=group)


class RankRowsHead(LinearHead):
    """A ``LinearHead`` over a ``vocab_parallel_group`` whose rows are this rank's own
    (``scaleout.rank_rows``)."""

    own_rows = True

    def every_ranks_rows(self, mask: Optional[torch.Tensor]):
        """``(head, mask, own)``: the same head over every rank's rows of its window as one
        batch of rows (a plain ``LinearHead``), their mask, and ``own(values)``: this rank's
        rows of a result of ``head`` (None: None), in the loss layout of ``mask``."""
        rows, rows_mask = layout.as_rows(self), layout.row_mask(self, mask)
        shape, T = rows.targets.shape, rows.targets.shape[1]
        hidden = rows.hidden[:, rows.offset:rows.offset + T]
        hidden, targets, whole_mask, own_rows = every_ranks_rows(
            hidden.reshape(-1, hidden.shape[-1]), rows.targets.reshape(-1),
            None if rows_mask is None else rows_mask.reshape(-1), self.vocab_parallel_group)
        whole = LinearHead(*rows)._replace(hidden=hidden.unsqueeze(0),
                                           targets=targets.unsqueeze(0), offset=0)

        def own(x):
            if x is None:
                return None
            return layout.to_loss_layout(self, own_rows(x).reshape(shape), mask)

        return whole, None if whole_mask is None else whole_mask.unsqueeze(0), own


class GatheredRowsHead(LinearHead):
    """A sequence-parallel ``LinearHead`` whose hidden states are every rank's rows
    (``scaleout.sequence.gather_rows``): the gradient of its hidden states is read at this
    rank's rows only."""

    @property
    def row_blocks(self) -> int:
        """The blocks of every rank's rows its hidden states hold: its sequences (1 packed)."""
        return 1 if self.hidden.dim() == 2 else self.hidden.shape[0]
