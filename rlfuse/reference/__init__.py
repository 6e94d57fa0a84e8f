"""Plain-torch reference implementations: the executable definition of rlfuse's math.

Same signatures as the public API; autograd computes the gradients.
"""
from .._types import Logits, LossOutput
from .logprobs import token_logprobs

__all__ = ["Logits", "LossOutput", "token_logprobs"]
