"""Context parallelism (``context_parallel_group=`` on every loss, ``rlfuse.scaleout.context``):
2 ``gloo`` processes, each with its two chunks of every sequence in Megatron's layout, against
one process over the whole sequences (``tests/context_parallel_worker.py``); and the layout
itself on one process."""
import torch

from rlfuse.scaleout.context import _sequences, own_positions
from test_vocab_split import run_workers


def test_every_loss_two_ranks_against_one_process():
    """fp64: every objective record, the terms and masks, every aggregation, GGPO, GR-OPD
    and its advantages, from log-probs, logits and a head, both implementations; compiled
    equal to eager; bad layouts raise on every rank."""
    run_workers(2, worker="context_parallel_worker.py")


def test_every_loss_two_ranks_bf16():
    """bf16: the losses and metrics within another order of their sums; from log-probs every
    gradient bitwise one process's, from logits and a head within one bf16 rounding."""
    run_workers(2, "--dtype", "bfloat16", worker="context_parallel_worker.py")


def test_the_chunks_of_every_rank_make_the_sequence():
    """Rank r's chunks are r and 2 cp - 1 - r (Megatron's ``get_batch_on_this_cp_rank``), and
    the ranks' chunks back in rank order give the sequence back."""
    x = torch.arange(2 * 12).reshape(2, 12)
    assert own_positions(x, 0, 3)[0].tolist() == [0, 1, 10, 11]
    assert own_positions(x, 1, 3)[0].tolist() == [2, 3, 8, 9]
    assert own_positions(x, 2, 3)[0].tolist() == [4, 5, 6, 7]
    assert torch.equal(_sequences([own_positions(x, r, 3) for r in range(3)]), x)
