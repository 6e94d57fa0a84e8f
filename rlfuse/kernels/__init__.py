"""Triton kernels and their launchers (no autograd, no torch.nn), in four folders:

- ``lib``: what the kernels share: launch helpers, a row's passes, a head's scalars, the
  per-token objectives, the divergences, the trust regions (and the kernel exporting GPPO's);
- ``rows``: one program per row of logits: log-probs, the surrogate's single pass (and its
  kernels over ``[B, T]`` log-probs), distillation, the backward's rescaling;
- ``tokens``: kernels over ``[B, T]`` log-probs and groups of rows: GGPO, GR-OPD, the KL penalty;
- ``tiles``: the batch-invariant kernels, on tiles formed on the chip: the fixed-order matmul,
  a head's and two heads' tiles, the vocabulary blocks' statistics.
"""
