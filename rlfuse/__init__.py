"""rlfuse: fused Triton kernels for the losses of LLM reinforcement learning and distillation —
every objective of TRL and verl (the PPO family, KL and entropy terms), GGPO, GPPO, GR-OPD and
on-policy distillation — from ``[B, T]`` log-probs, logits (``Logits``) or the last hidden state
and the output head (``LinearHead``), with a plain-torch twin, ``rlfuse.reference``."""
from . import divergences, objectives, reference, terms
from ._version import __version__
from ._dispatch import (distill_loss, ggpo_loss, gppo_bounds, gppo_loss, gr_opd_advantages,
                        gr_opd_loss, head_logits, kl_penalty, policy_logprobs, policy_loss,
                        ppo_loss, token_divergence, token_logprobs, use_kernels)
from ._types import LossOutput
from .forms import LinearHead, Logits, TopK
from .api import group_advantages             # plain torch on [B]-sized data: one for both
from .modules import DistillLoss, GGPOLoss, GPPOLoss, GROPDLoss, PolicyLoss, PPOLoss
from .scaleout.data_parallel import global_counts
from .scaleout.layout import packed_index    # plain torch, [B, T]-sized: one for both

__all__ = ["DistillLoss", "GGPOLoss", "GPPOLoss", "GROPDLoss", "LinearHead", "Logits",
           "LossOutput", "PPOLoss", "PolicyLoss", "TopK", "distill_loss", "divergences",
           "ggpo_loss", "global_counts", "gppo_bounds", "gppo_loss", "gr_opd_advantages",
           "gr_opd_loss", "group_advantages", "head_logits", "kl_penalty", "objectives",
           "packed_index", "policy_logprobs", "policy_loss", "ppo_loss", "reference", "terms",
           "token_divergence", "token_logprobs", "use_kernels"]
