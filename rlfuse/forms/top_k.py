"""``TopK``: a teacher given as its top-k next-token log-probs."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class TopK(NamedTuple):
    """A teacher given as its top-k next-token log-probs (a teacher server's, verl's
    distillation): ``ids [B, T, k]`` (integer ids of the vocabulary) and ``logprobs [B, T, k]``
    (the teacher's log-probs there, <= 0), for ``rlfuse.distill_loss`` with ``ForwardKL``."""

    ids: torch.Tensor
    logprobs: torch.Tensor

    kind = "top_k"     # which of the implementations' form ops run it
    # a teacher of [B, T, k] positions: no packed rows, no split vocabulary (global ids)
    index = None
    vocab_parallel_group = None

    @property
    def device(self) -> Optional[torch.device]:
        return getattr(self.ids, "device", None)

    def for_matmul(self, autocast=None) -> "TopK":
        return self

    def beside_rows(self, index) -> "TopK":
        """As a teacher beside a student's packed rows ``index``: its ``[B, T, k]`` read at each
        row's position, as one batch of rows ``[1, N, k]``."""
        at = index.clamp_min(0)
        return TopK(*(x.reshape(-1, x.shape[-1])[at].unsqueeze(0)
                      for x in (self.ids, self.logprobs)))

    def prepared(self) -> "TopK":
        """Ready to run: its local tensors (``local``), every rank's rows (``gathered``)."""
        return self.local().gathered()

    def local(self) -> "TopK":
        return self

    def gathered(self) -> "TopK":
        return self
