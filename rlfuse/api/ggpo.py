"""GGPO's loss: the stable Gibbs (log-mean-exp) gap of KL-adjusted rewards."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .._types import LossOutput
from ..checks.policy import PolicyInfo, check_loss_policy, check_policy_targets
from ..checks.values import (check_actor_tokens, check_group_size, check_loss_scale,
                             check_positive, check_sequence_tensor)
from ..scaleout import context


def ggpo_loss(policy, ref_logprobs: torch.Tensor, rewards: torch.Tensor,
              mask: torch.Tensor, *, group_size: int, beta: float,
              clip_radius: Optional[float] = None, loss_scale: float = 1.0,
              num_tokens: Optional[float] = None, context_parallel_group=None,
              validate: bool = True, run) -> LossOutput:
    """GGPO: the stable Gibbs (log-mean-exp) gap of KL-adjusted rewards.

    Args:
        policy: learner log-probs ``[B, T]`` (requires grad), ``rlfuse.Logits`` or
            ``rlfuse.LinearHead``.
        ref_logprobs: ``[B, T]`` log-probs of the reference policy (detached; garbage allowed at
            masked positions).
        rewards: ``[B]`` sequence rewards.
        mask: ``[B, T]`` bool (or 0/1): the response tokens.
        group_size: ``m >= 2``; rows ``[g m, (g + 1) m)`` form group ``g``.
        beta: KL weight ``> 0`` (a runtime kernel argument: changing it does not recompile).
        clip_radius: ``ρ`` (> 0, may be ``inf``) selects the clipped branch.
        loss_scale: multiplies the loss and every gradient, inside the kernels (e.g.
            ``1 / gradient_accumulation_steps``): no pass over a gradient to rescale it.
        num_tokens: the token count ``T_tok`` of the whole minibatch (for gradient accumulation
            and data parallelism); default: ``mask.sum()``.
        context_parallel_group: the ranks that hold chunks of the same sequences (as in
            ``policy_loss``; ``rewards`` are every rank's same ``[B]``).
        validate: check the values of the ``[B, T]`` inputs (0/1 mask, finite values at actor
            positions, a token in every group); shapes and devices are always checked.

    No behavior log-probs and no importance ratio enter the loss::

        s_i = Σ_t M_it lp_it        s_i^ref = Σ_t M_it ref_lp_it
        R_i = r_i − β (s_i − s_i^ref)
        J_g = β log( (1/m) Σ_{i∈g} exp(R_i/β) ) − (1/m) Σ_{i∈g} R_i       (≥ 0; 0 iff all R_i equal)
            = β ( logsumexp_i z_i − log m ),  z_i = (R_i − mean_g R)/β
        T_tok = Σ M (argument num_tokens),  ℓ̄ = T_tok / B
        L = (1/G) Σ_g J_g / (β ℓ̄ √(m−1))  =  m Σ_g J_g / (β √(m−1) T_tok)
        q_i = softmax_{i∈g}(R_i/β),  c_i = (m q_i − 1)/√(m−1)
        ∂L/∂lp_it = − c_i M_it / T_tok

    ``z`` is formed as ``(r_i − mean_g r)/β − (Δ_i − mean_g Δ)`` with ``Δ = s − s^ref`` (the
    same value, without scaling the log-probs by β and back), and ``J_g/β`` is never multiplied
    out, so β from 1e-2 to 1e1 with large rewards stays finite. The gradient is autograd's.

    ``clip_radius = ρ`` (may be ``inf``) selects the clipped branch::

        d_it = clamp(lp_it − ref_lp_it, −ρ, ρ)   (detached)
        R̃_i = r_i − β Σ_t M_it d_it,  q̃ = softmax_g(R̃/β),  c̃_i = (m q̃_i − 1)/√(m−1)  (detached)
        L_clip = −(1/T_tok) Σ_i c̃_i s_i,   ∂L_clip/∂lp_it = −c̃_i M_it / T_tok

    (the clamped LME is never differentiated; with ρ = ∞ both branches have the same gradient).
    With a global ``num_tokens`` the losses of micro-batches of whole groups add up to the
    full-batch loss.

    Metrics (detached): ``gap`` mean over groups of J_g/β (unclipped J, both branches);
    ``q_max`` max over the batch of the weights of the update (q, or q̃ in the clipped branch);
    ``clip_frac`` share of actor tokens with |lp − ref_lp| > ρ (0 without ``clip_radius``);
    ``seq_logratio_mean`` mean over sequences of s_i − s_i^ref; ``kl`` mean over actor tokens
    of the k3 estimate e^d − d − 1, d = ref_lp − lp clamped to ±20 (TRL's ``kl``).

    Fused (``rlfuse.ggpo_loss``): from log-probs one group kernel (one program per group) and one
    token-gradient kernel; from ``Logits`` the log-prob pass over the logits, the group kernel
    and one backward pass that writes ``dlogits``: two reads and one write of the logits; from
    ``LinearHead`` the same, each chunk's logits formed in the log-prob pass and once more in
    the backward.
    """
    def check(policy, ref_logprobs, mask, whole=True):
        return check_ggpo_args(
            policy, ref_logprobs, rewards, mask, group_size=group_size, beta=beta,
            clip_radius=clip_radius, loss_scale=loss_scale, num_tokens=num_tokens,
            validate=validate, whole=whole)

    with run.on(policy) as (impl, policy):
        if context_parallel_group is None:
            args = check(policy, ref_logprobs, mask)
            return impl.ggpo(policy, args, ref_logprobs.detach(), rewards.detach(), validate)
        with context.agreed(context_parallel_group, mask):
            args = check(policy, ref_logprobs, mask, whole=False)
        whole = context.whole_sequences(impl, context_parallel_group, policy, args.mask,
                                        {"ref": ref_logprobs}, validate=validate)
        ref = whole.tensors["ref"]
        args = check(whole.logprobs, ref, whole.mask)
        return context.share(impl.ggpo(whole.logprobs, args, ref, rewards.detach(), validate),
                             context_parallel_group)


class GGPOArgs(NamedTuple):
    info: PolicyInfo
    mask: torch.Tensor             # bool
    group_size: int
    beta: float
    clip_radius: Optional[float]   # None: the unclipped branch
    loss_scale: float
    num_tokens: Optional[float]


def check_ggpo_args(policy, ref_logprobs, rewards, mask, *, group_size, beta, clip_radius,
                    loss_scale, num_tokens, validate, whole: bool = True) -> GGPOArgs:
    """The checks of ``ggpo_loss`` (``whole``: the mask holds whole sequences, not a context-
    parallel rank's chunks of them, whose actor tokens may all sit elsewhere)."""
    info, mask = check_loss_policy(policy, mask, {"ref_logprobs": ref_logprobs}, validate)
    check_sequence_tensor("rewards", rewards, batch=info.shape[0], device=info.device,
                          validate=validate)
    m = check_group_size(group_size, info.shape[0], minimum=2)
    beta = check_positive("beta", beta)
    rho = None if clip_radius is None else check_positive("clip_radius", clip_radius,
                                                          allow_inf=True)
    if num_tokens is not None:
        num_tokens = check_positive("num_tokens", num_tokens)
    check_policy_targets(policy, mask, mask.shape, validate)
    if validate and whole:
        check_actor_tokens(mask, m, what="group")
    return GGPOArgs(info, mask, m, beta, rho, check_loss_scale(loss_scale), num_tokens)
