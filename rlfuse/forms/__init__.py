"""The policy forms: how a policy is given — ``Logits`` (logits), ``LinearHead`` (the last
hidden state and the output head), ``TopK`` (a teacher's top-k log-probs) — each with what it
does as a form: its device and vocabulary, its checks, its rows, the dtype of its matmuls, its
local tensors under DTensors and its rows under sequence parallelism. A ``[B, T]`` tensor of
learner log-probs is a policy too, with none of these."""
from .linear_head import GatheredRowsHead, LinearHead, RankRowsHead
from .logits import Logits
from .top_k import TopK

__all__ = ["GatheredRowsHead", "LinearHead", "Logits", "RankRowsHead", "TopK"]
