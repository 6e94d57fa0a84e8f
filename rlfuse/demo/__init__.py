"""``python -m rlfuse.demo``: a tiny byte-level Llama with LoRA adapters trained by each rlfuse
loss (GGPO, GPPO, GR-OPD) on a rule-verified task. Needs the ``train`` extras (transformers,
peft), imported only when a run starts."""
from .train import RunResult, Settings, run

__all__ = ["RunResult", "Settings", "run"]
