"""Autograd Functions and the functional API over the kernels."""
from .ggpo import GGPOFunction, GGPOLoss, ggpo_loss
from .gppo import GPPOLoss, gppo_bounds, gppo_loss, group_advantages
from .gr_opd import GROPDLoss, gr_opd_advantages, gr_opd_loss
from .logprobs import TokenLogprobsFunction, token_logprobs
from .surrogate import SurrogateFunction, SurrogateLogitsFunction

__all__ = ["GGPOFunction", "GGPOLoss", "GPPOLoss", "GROPDLoss", "SurrogateFunction",
           "SurrogateLogitsFunction", "TokenLogprobsFunction", "ggpo_loss", "gppo_bounds",
           "gppo_loss", "gr_opd_advantages", "gr_opd_loss", "group_advantages", "token_logprobs"]
