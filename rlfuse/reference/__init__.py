"""Plain-torch reference implementations: the executable definition of rlfuse's math.

Same signatures and docstrings as the public API; autograd computes the gradients.
"""
from ..shared.aggregation import group_advantages
from .._types import LinearHead, Logits, LossOutput
from ..scaleout.data_parallel import global_counts
from ..scaleout.layout import packed_index
from .ggpo import ggpo_loss
from .gppo import gppo_bounds, gppo_loss
from .gr_opd import gr_opd_advantages, gr_opd_loss
from .kl import kl_penalty
from .logprobs import policy_logprobs, token_logprobs
from .policy_loss import policy_loss
from .ppo import ppo_loss

__all__ = ["LinearHead", "Logits", "LossOutput", "ggpo_loss", "global_counts", "gppo_bounds",
           "gppo_loss", "gr_opd_advantages", "gr_opd_loss", "group_advantages", "kl_penalty",
           "packed_index", "policy_logprobs", "policy_loss", "ppo_loss", "token_logprobs"]
