"""The custom ops (``torch.ops.rlfuse.*``) over the kernels, their autograd formulas and the
fused public functions (``rlfuse._api`` gathers them). Importing a module here needs Triton."""
