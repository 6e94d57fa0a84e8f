"""Row kernels, one program per row of logits: log-probs and entropy (``logprobs``), the
surrogate losses' single pass and its launch configurations (``surrogate``, ``single_pass``),
distillation (``distill``) and the single pass's backward (``scale_rows``)."""
