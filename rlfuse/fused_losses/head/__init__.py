"""Ops from a head's hidden states and weight: the chunk driver (``head_matmuls``), log-probs
and the single pass (``linear_head``), distillation (``linear_distill``), a batch-invariant
head's statistics (``invariant_stats``) and ``head_logits``."""
