"""The custom ops (``torch.ops.rlfuse.*``) over the kernels, their autograd formulas, the
functional API and nn.Modules."""
from .ggpo import GGPOLoss, ggpo_loss
from .gppo import GPPOLoss, gppo_bounds, gppo_loss
from .gr_opd import GROPDLoss, gr_opd_advantages, gr_opd_loss
from .logprobs import policy_logprobs, token_logprobs
from .ppo import PPOLoss, ppo_loss

__all__ = ["GGPOLoss", "GPPOLoss", "GROPDLoss", "PPOLoss", "ggpo_loss", "gppo_bounds",
           "gppo_loss", "gr_opd_advantages", "gr_opd_loss", "policy_logprobs", "ppo_loss",
           "token_logprobs"]
