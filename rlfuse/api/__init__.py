"""The public functions, each defined once: its signature, its docstring, its argument checks
(``args``) and a call into the implementation it runs on, which it takes first (``run``) and
which ``implementation.bind`` fills in: ``rlfuse.reference`` binds every definition to the
plain-torch reference, ``rlfuse._dispatch`` to the kernels where they run and the reference
elsewhere (the functions ``rlfuse`` exports). ``group_advantages`` needs no implementation
(``[B]``-sized torch, one for both)."""
from .distill import distill_loss, token_divergence
from .ggpo import ggpo_loss
from .gr_opd import gr_opd_advantages, gr_opd_loss, group_advantages
from .implementation import Implementation, bind
from .logprobs import head_logits, policy_logprobs, token_logprobs
from .policy_loss import gppo_bounds, gppo_loss, kl_penalty, policy_loss, ppo_loss

__all__ = ["Implementation", "bind", "distill_loss", "ggpo_loss", "gppo_bounds", "gppo_loss",
           "gr_opd_advantages", "gr_opd_loss", "group_advantages", "head_logits", "kl_penalty",
           "policy_logprobs", "policy_loss", "ppo_loss", "token_divergence", "token_logprobs"]
