"""``Logits``: a policy given as logits — and what it does as a policy form: its checks, its
rows, its local tensors."""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from .._types import compute_dtype
from ..checks.policy import (PolicyInfo, check_bool, check_form_targets, check_packed,
                             check_window)
from ..checks.values import check_logits, check_no_overlap
from ..scaleout import layout
from ..scaleout.dtensor import DTensor, local_fields
from ..scaleout.vocab import vocab_group_size


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

    # ---------------------------------------------------------------------------------------
    # What a policy form does (``rlfuse.forms``)
    # ---------------------------------------------------------------------------------------

    kind = "logits"    # which of the implementations' form ops run it
    own_rows = False   # its rows are every rank's (``RankRowsHead``: a rank's own)

    @property
    def device(self) -> Optional[torch.device]:
        return getattr(self.logits, "device", None)

    @property
    def vocab_size(self) -> int:
        """The ids of this rank's logits (its shard under a ``vocab_parallel_group``)."""
        return self.logits.shape[-1]

    @property
    def rows(self) -> torch.Tensor:
        """The tensor whose leading dimensions are the rows (``[B, S, V]``, packed ``[N, V]``)."""
        return self.logits

    def with_rows(self, reshape) -> "Logits":
        """The same policy with ``reshape`` applied to its rows and targets, no index (the
        packed rows laid out as a batch: ``scaleout.layout``)."""
        return self._replace(logits=reshape(self.logits), targets=reshape(self.targets),
                             index=None)

    def check_policy(self, loss_shape=None) -> PolicyInfo:
        """Its shapes, dtypes and devices as a loss's policy (``checks.policy.check_policy``)."""
        if self.vocab_parallel_group is not None:
            vocab_group_size(self.vocab_parallel_group)
        check_bool("policy.batch_invariant", self.batch_invariant)
        logits = self.logits
        check_logits(logits)
        if self.index is not None:
            if logits.dim() != 2:
                raise ValueError(f"policy.logits: expected shape [N, V] (packed rows, with "
                                 f"index), got {tuple(logits.shape)}")
            if self.inplace_backward:
                check_no_overlap("policy.logits", logits)
            shape = check_packed(logits, self, loss_shape)
        else:
            if logits.dim() != 3:
                raise ValueError(f"policy.logits: expected shape [B, S, V], got "
                                 f"{tuple(logits.shape)}")
            check_window(self.targets, self.offset, batch=logits.shape[0], rows=logits.shape[1],
                         device=logits.device)
            if self.inplace_backward:
                check_no_overlap("policy.logits", logits)
            shape = self.targets.shape
        return PolicyInfo(tuple(shape), logits.device, compute_dtype(logits.dtype))

    def check_targets(self, mask, shape, validate: bool) -> None:
        """Its temperature and targets (``checks.policy.check_form_targets``)."""
        vocab = self.vocab_size
        if self.vocab_parallel_group is not None:
            vocab *= vocab_group_size(self.vocab_parallel_group)
        check_form_targets(self, vocab, mask, shape, validate)

    def for_matmul(self, autocast=None) -> "Logits":
        """Itself: no matmul forms its logits."""
        return self

    def prepared(self) -> "Logits":
        """Ready to run: its local tensors (``local``), every rank's rows (``gathered``)."""
        return self.local().gathered()

    def local(self) -> "Logits":
        """Its local tensors: logits a DTensor sharded on the vocabulary become their shard and
        the mesh dimension's group (``scaleout.dtensor``)."""
        if DTensor is None or not any(isinstance(x, DTensor) for x in self):
            return self             # plain tensors throughout
        found = local_fields(self, "policy.logits", self.logits, -1,
                             {"targets": self.targets, "index": self.index})
        if found is None:
            return self
        fields, mesh, mesh_dim = found
        return self._replace(vocab_parallel_group=mesh.get_group(mesh_dim), **fields)

    def gathered(self) -> "Logits":
        """Itself: its rows are every rank's."""
        return self

    def beside_rows(self, index) -> "Logits":
        """As a teacher beside a student's packed rows ``index`` (its own, the same): as one
        batch of rows (``scaleout.layout.as_rows``)."""
        return layout.as_rows(self)

    def every_ranks_rows(self, mask):
        """None: its rows are the same on every rank of a split (``RankRowsHead``)."""
        return None

    def as_logits(self) -> "Logits":
        return self
