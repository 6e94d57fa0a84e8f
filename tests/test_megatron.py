"""rlfuse in Megatron-core 0.16 (2 ``gloo`` processes running ``tests/megatron_worker.py``, the
tensor-parallel group from Megatron's own ``parallel_state``): the output layer's log-probs,
entropy and gradients from ``rlfuse.integrations.megatron`` and through verl's Megatron fused
forward, against Megatron's output layer and cross entropy, with and without sequence
parallelism; a loss equal to one process's; bad layouts; on 4 processes data x context
parallelism (the counts, a loss with them) and tensor x sequence x context parallelism (a loss
from ``output_head``)."""
import pytest
import torch

from conftest import integration
from test_vocab_split import run_workers

integration("megatron.core")
integration("verl")


def test_megatron_tensor_and_sequence_parallel_two_ranks():
    run_workers(2, worker="megatron_worker.py")


def test_data_and_tensor_times_context_parallel_four_ranks():
    run_workers(4, worker="megatron_worker.py")


def test_output_head_without_model_parallelism():
    """No parallel_state set up: the whole head on one process, Megatron's layouts."""
    from rlfuse.integrations import megatron as rlfuse_megatron

    import rlfuse

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 2, 4, generator=g, dtype=torch.float64)
    weight = torch.randn(9, 4, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 9, (2, 5), generator=g)
    logp, entropy = rlfuse_megatron.logprobs_and_entropy(hidden, weight, labels, temperature=0.7)
    want = torch.log_softmax(hidden.transpose(0, 1) @ weight.t() / 0.7, -1)
    torch.testing.assert_close(logp, want.gather(-1, labels[..., None])[..., 0])
    torch.testing.assert_close(entropy, -(want.exp() * want).sum(-1))
    head = rlfuse_megatron.output_head(hidden, weight, labels, sequence_parallel=True)
    assert head.vocab_parallel_group is None and not head.sequence_parallel
    assert isinstance(head, rlfuse.LinearHead)
    with pytest.raises(ValueError, match=r"hidden: expected Megatron's \[s, b, h\]"):
        rlfuse_megatron.output_head(hidden[0], weight, labels)
    with pytest.raises(ValueError, match=r"labels: expected \[b, s\] = \(2, 5\)"):
        rlfuse_megatron.output_head(hidden, weight, labels.t())
