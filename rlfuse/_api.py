"""The public functions: the fused ones where Triton is installed (each falls back to its
reference twin off the kernels' devices, ``_dispatch``), the reference ones where it is not."""
from ._dispatch import HAVE_TRITON

if HAVE_TRITON:
    from .fused_losses.ggpo import ggpo_loss
    from .fused_losses.gppo import gppo_bounds, gppo_loss
    from .fused_losses.gr_opd import gr_opd_advantages, gr_opd_loss
    from .fused_losses.kl import kl_penalty
    from .fused_losses.logprobs import token_logprobs
    from .fused_losses.policy import policy_logprobs
    from .fused_losses.policy_loss import policy_loss
    from .fused_losses.ppo import ppo_loss
else:  # a platform without Triton: the reference runs every call
    from .reference import (ggpo_loss, gppo_bounds, gppo_loss, gr_opd_advantages,  # noqa: F401
                            gr_opd_loss, kl_penalty, policy_logprobs, policy_loss, ppo_loss,
                            token_logprobs)

__all__ = ["ggpo_loss", "gppo_bounds", "gppo_loss", "gr_opd_advantages", "gr_opd_loss",
           "kl_penalty", "policy_logprobs", "policy_loss", "ppo_loss", "token_logprobs"]
