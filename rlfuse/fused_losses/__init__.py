"""The fused implementation: custom ops (``torch.ops.rlfuse.*``) over the kernels, their
autograd formulas, and ``FUSED``, the math of each public function on checked arguments."""
from ..api import Implementation
from . import distillation, form_ops, ggpo, gr_opd, kl, policy_loss, regions
from .head import head_logits
from .logits import logprobs

FUSED = Implementation(
    "fused", token_logprobs=logprobs.token_logprobs, window_logprobs=form_ops.window_logprobs,
    ggpo=ggpo.ggpo, gppo_bounds=regions.gppo_bounds, gr_opd_advantages=gr_opd.gr_opd_advantages,
    policy_loss=policy_loss.policy_loss, kl_penalty=kl.kl_penalty,
    head_logits=head_logits.head_logits, token_divergence=distillation.token_divergence,
    context_in_place=True)
