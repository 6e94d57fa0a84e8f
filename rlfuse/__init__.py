"""rlfuse: fused Triton kernels for the GGPO, GPPO and GR-OPD reinforcement-learning losses."""
from . import divergences, objectives, reference, terms
from ._version import __version__
from ._dispatch import (distill_loss, ggpo_loss, gppo_bounds, gppo_loss, gr_opd_advantages,
                        gr_opd_loss, head_logits, kl_penalty, policy_logprobs, policy_loss,
                        ppo_loss, token_divergence, token_logprobs, use_kernels)
from ._types import LinearHead, Logits, LossOutput, TopK
from .api import group_advantages             # plain torch on [B]-sized data: one for both
from .modules import GGPOLoss, GPPOLoss, GROPDLoss, PPOLoss
from .scaleout.data_parallel import global_counts
from .scaleout.layout import packed_index    # plain torch, [B, T]-sized: one for both

__all__ = ["GGPOLoss", "GPPOLoss", "GROPDLoss", "LinearHead", "Logits", "LossOutput", "PPOLoss",
           "TopK", "distill_loss", "divergences", "ggpo_loss", "global_counts", "gppo_bounds", "gppo_loss", "gr_opd_advantages",
           "gr_opd_loss", "group_advantages", "head_logits", "kl_penalty", "objectives",
           "packed_index",
           "policy_logprobs", "policy_loss", "ppo_loss", "reference", "terms", "token_divergence", "token_logprobs",
           "use_kernels"]
