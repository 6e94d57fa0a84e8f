"""The backward of a single pass from ``Logits``, which writes the gradient of its loss into a
``[B, S, V]`` buffer in the forward for an upstream gradient of 1 (the surrogate losses'
``surrogate_logits_op``, distillation's ``distill_loss_op``): that buffer rescaled in place by
the upstream gradient, read on the device (``kernels.rows.scale_rows``: no host sync, and no pass
over it when the gradient is 1), and handed out once."""
from __future__ import annotations

from torch import Tensor

from ...kernels.rows.scale_rows import scale_rows
from .._op import custom_op, register_autograd


@custom_op("scale_rows_", mutates_args=("x",))
def scale_rows_op(x: Tensor, mask: Tensor, scale: Tensor, offset: int) -> None:
    """``x[b, s] *= scale`` at the actor rows of ``x [B, S, V]`` (rows ``[offset, offset + T)``
    go with ``mask [B, T]``), in place; ``scale`` (0-dim) is read on the device, and a scale of
    1 reads and writes nothing."""
    scale_rows(x, mask, scale, offset)


@scale_rows_op.register_fake
def _(x, mask, scale, offset):
    return None


def hand_out(ctx, grad_loss: Tensor) -> Tensor:
    """The single pass's gradient buffer (saved with the mask) rescaled by the upstream
    gradient, once: it is handed out, so a second backward (``retain_graph``) would rescale
    what the caller holds. Checked before the saved tensors are read: the first backward's
    rescale moved their version."""
    if ctx.backward_done:
        raise RuntimeError(
            "rlfuse: a loss from Logits computed in a single pass (GPPO, GR-OPD, PPO, "
            "distill_loss) writes its gradient in the forward and hands that buffer out in the "
            "first backward; it cannot be backpropagated twice (retain_graph=True). Compute the "
            "loss again for a second backward.")
    ctx.backward_done = True
    dlogits, mask = ctx.saved_tensors
    scale_rows_op(dlogits, mask, grad_loss, ctx.offset)
    return dlogits


def register_single_pass_autograd(op, logits: str) -> None:
    """The autograd of a single pass from ``Logits``: its first output the loss, its last the
    gradient of the input named ``logits`` (``[B, S, V]``, or empty when not written), the
    others without a gradient; its inputs hold the ``mask`` and the window's ``offset``."""
    def setup(ctx, inputs, output):
        ctx.save_for_backward(output[-1], inputs.mask)
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)   # no zero-filled [B, S, V] "gradient" of dlogits
        ctx.offset = inputs.offset
        ctx.backward_done = False

    def backward(ctx, grad_loss, *_):
        if grad_loss is None:
            return None
        dlogits = hand_out(ctx, grad_loss)
        return {logits: dlogits.view(dlogits.shape)}

    register_autograd(op, backward, setup)
