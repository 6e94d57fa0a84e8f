"""The policy forms: how a policy is given — ``Logits`` (logits), ``LinearHead`` (the last
hidden state and the output head), ``TopK`` (a teacher's top-k log-probs) — each with what it
does as a form: its device and vocabulary, its checks, its rows, the dtype of its matmuls, its
local tensors under DTensors and its rows under sequence parallelism. A ``[B, T]`` tensor of
learner log-probs is a policy too, with none of these (``prepared`` leaves it as it is)."""
from .linear_head import GatheredRowsHead, LinearHead, RankRowsHead
from .logits import Logits
from .top_k import TopK

__all__ = ["GatheredRowsHead", "LinearHead", "Logits", "RankRowsHead", "TopK", "prepared"]


def prepared(policy):
    """A policy ready to run: a form with its local tensors (DTensors) and every rank's rows
    (sequence parallelism); anything else (a ``[B, T]`` tensor, or what its checks will refuse)
    as it is."""
    from ..scaleout.dtensor import is_dtensor

    if is_dtensor(policy):
        raise ValueError("policy: a DTensor: pass logits sharded on the vocabulary as "
                         "rlfuse.Logits(logits, targets), or log-probs as a plain tensor "
                         "(to_local())")
    local = getattr(policy, "local", None)
    return policy if local is None else local().gathered()
