"""Plain-torch reference implementations: the executable definition of rlfuse's math.

``REFERENCE`` holds the math of each public function on checked arguments; the public
functions of ``rlfuse.api`` bound to it are exported here with the same signatures and
docstrings as ``rlfuse``'s; autograd computes the gradients.
"""
from .. import api
from .._types import LossOutput
from ..forms import LinearHead, Logits, TopK
from ..api import Implementation, bind, group_advantages
from ..scaleout.data_parallel import global_counts
from ..scaleout.layout import packed_index
from . import distill, ggpo, gr_opd, kl, logprobs, policy_loss as _policy_loss, regions

REFERENCE = Implementation(
    "reference", token_logprobs=logprobs.token_logprobs, window_logprobs=logprobs.window_logprobs,
    ggpo=ggpo.ggpo, gppo_bounds=regions.gppo_bounds,
    gr_opd_advantages=gr_opd.gr_opd_advantages, policy_loss=_policy_loss.policy_loss,
    kl_penalty=kl.kl_penalty, head_logits=logprobs.head_logits,
    token_divergence=distill.token_divergence)

distill_loss = bind(api.distill_loss, REFERENCE)
ggpo_loss = bind(api.ggpo_loss, REFERENCE)
gppo_bounds = bind(api.gppo_bounds, REFERENCE)
gppo_loss = bind(api.gppo_loss, REFERENCE)
gr_opd_advantages = bind(api.gr_opd_advantages, REFERENCE)
gr_opd_loss = bind(api.gr_opd_loss, REFERENCE)
kl_penalty = bind(api.kl_penalty, REFERENCE)
policy_logprobs = bind(api.policy_logprobs, REFERENCE)
policy_loss = bind(api.policy_loss, REFERENCE)
ppo_loss = bind(api.ppo_loss, REFERENCE)
token_divergence = bind(api.token_divergence, REFERENCE)
token_logprobs = bind(api.token_logprobs, REFERENCE)
head_logits = bind(api.head_logits, REFERENCE)

__all__ = ["LinearHead", "Logits", "LossOutput", "REFERENCE", "TopK", "distill_loss", "ggpo_loss",
           "global_counts",
           "gppo_bounds", "gppo_loss", "gr_opd_advantages", "gr_opd_loss", "group_advantages",
           "head_logits",
           "kl_penalty", "packed_index", "policy_logprobs", "policy_loss", "ppo_loss",
           "token_divergence", "token_logprobs"]
