"""DTensor policies over a CPU device mesh (2 ``gloo`` processes running
``tests/dtensor_worker.py``): a vocabulary split taken from the tensors' own layout, equal to
one process; each rank's own rows through a head sharded on its rows (FSDP2), equal to FSDP2's
own forward; verl's tensor-parallel ``linear_cross_entropy``; bad layouts."""
from test_vocab_split import run_workers


def test_dtensor_policies_and_tensor_parallel_head_two_ranks():
    run_workers(2, worker="dtensor_worker.py")
