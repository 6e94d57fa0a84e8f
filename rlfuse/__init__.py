"""rlfuse: fused Triton kernels for the GGPO, GPPO and GR-OPD losses."""
from . import reference
from ._types import Logits, LossOutput
from .fused_losses import GGPOLoss, ggpo_loss, token_logprobs

__all__ = ["GGPOLoss", "Logits", "LossOutput", "ggpo_loss", "reference", "token_logprobs"]
__version__ = "0.1.0"
