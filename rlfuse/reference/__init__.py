"""Plain-torch reference implementations: the executable definition of rlfuse's math.

Same signatures as the public API; autograd computes the gradients.
"""
from .._types import LinearHead, Logits, LossOutput
from ..parallel import global_counts, packed_index
from .ggpo import ggpo_loss
from .gppo import group_advantages, gppo_bounds, gppo_loss
from .gr_opd import gr_opd_advantages, gr_opd_loss
from .logprobs import policy_logprobs, token_logprobs
from .ppo import ppo_loss

__all__ = ["LinearHead", "Logits", "LossOutput", "ggpo_loss", "global_counts", "gppo_bounds",
           "gppo_loss", "gr_opd_advantages", "gr_opd_loss", "group_advantages", "packed_index",
           "policy_logprobs", "ppo_loss", "token_logprobs"]
