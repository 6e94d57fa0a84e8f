"""Ops from logits in memory: log-probs (``logprobs``), the single pass's backward
(``scale_rows``), distillation (``distill``) and a split vocabulary's ops (``vocab_split``)."""
