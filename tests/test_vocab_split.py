"""A vocabulary split over ``torch.distributed`` process groups (``vocab_parallel_group``):
2 and 4 ``gloo`` processes running ``tests/vocab_split_worker.py``, against the whole vocabulary
in one process, every loss and policy form, under ``torch.compile`` too; the data-parallel
counts; bad input."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import process_env

import rlfuse

WORKER = Path(__file__).resolve().parent / "vocab_split_worker.py"


def test_vocab_parallel_needs_a_process_group():
    logits = torch.randn(1, 3, 5)
    targets = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="not initialised"):
        rlfuse.policy_logprobs(rlfuse.Logits(logits, targets, vocab_parallel_group="tp"))


@pytest.mark.parametrize("lib", [rlfuse, rlfuse.reference], ids=["fused", "reference"])
def test_sequence_parallel_needs_the_vocabulary_group(lib):
    head = lib.LinearHead(torch.randn(1, 3, 4), torch.randn(5, 4),
                          torch.zeros(1, 3, dtype=torch.long), sequence_parallel=True)
    with pytest.raises(ValueError, match="policy.sequence_parallel: .* vocab_parallel_group"):
        lib.policy_logprobs(head)
    with pytest.raises(ValueError, match="not initialised"):
        lib.policy_logprobs(head._replace(vocab_parallel_group="tp"))


def run_workers(world: int, *args: str, worker: str = WORKER.name) -> None:
    """``world`` gloo processes of ``tests/<worker>``, each of which must print its ok."""
    env = process_env(OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         str(world), str(WORKER.parent / worker), *args],
        env=env, capture_output=True, text=True, timeout=720)   # a hang fails; 2 cores, shared
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for rank in range(world):
        assert f"rank {rank}: ok" in out, out[-4000:]


@pytest.mark.slow
def test_vocab_parallel_two_ranks_every_form_and_loss():
    """fp64: the split equals the whole vocabulary to 1e-10 in every loss, policy form and
    metric, the fused path and the reference; compiled equal to eager; bad input raises on both
    ranks."""
    run_workers(2, "--compile")


def test_vocab_parallel_two_ranks_bf16():
    # bf16 through the row kernels of both forms (packed rows: the float64 and 4-rank runs),
    # every head option; randomised heads (fp64 and fp32) over the split
    run_workers(2, "--dtype", "bfloat16", "--impls", "fused", "--forms",
                 "logits,head,scaled_head,softcapped_head,capped_head,fp32_head,sp_head",
                 "--random-heads", "24")


def test_vocab_parallel_four_ranks():
    run_workers(4, "--dtype", "float32", "--impls", "fused",
                 "--forms", "logits,packed_head,scaled_head,sp_packed_head",
                 "--calls", "policy_logprobs,ggpo,gppo,gspo", "--random-heads", "12")
