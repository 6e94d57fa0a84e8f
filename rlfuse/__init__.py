"""rlfuse: fused Triton kernels for the GGPO, GPPO and GR-OPD losses."""
from . import reference
from ._types import Logits, LossOutput
from .fused_losses import token_logprobs

__all__ = ["Logits", "LossOutput", "reference", "token_logprobs"]
__version__ = "0.1.0"
