"""Autograd Functions and the functional API over the kernels."""
from .logprobs import TokenLogprobsFunction, token_logprobs

__all__ = ["TokenLogprobsFunction", "token_logprobs"]
