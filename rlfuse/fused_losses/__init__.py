"""Autograd Functions and the functional API over the kernels."""
from .ggpo import GGPOFunction, GGPOLoss, ggpo_loss
from .logprobs import TokenLogprobsFunction, token_logprobs

__all__ = ["GGPOFunction", "GGPOLoss", "TokenLogprobsFunction", "ggpo_loss", "token_logprobs"]
