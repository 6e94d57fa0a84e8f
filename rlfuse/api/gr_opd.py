"""The advantages of GRPO (``group_advantages``) and of GR-OPD (``gr_opd_advantages``), and
GR-OPD's loss: its advantages, then ``policy_loss``'s step with the clip over them."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .._types import LossOutput, compute_dtype
from ..checks.policy import check_loss_policy, check_policy_targets
from ..checks.values import (check_actor_tokens, check_clip, check_count, check_finite,
                             check_group_size, check_loss_scale, check_nonnegative,
                             check_number, check_positive, check_sequence_tensor, check_tensor,
                             check_token_tensors, check_unit_interval)
from ..objectives import Clip
from ..shared.aggregation import clamped_feedback, discounted_sums, group_credit, masked_mean
from ..scaleout import context
from .policy_loss import PolicyLossArgs


def group_advantages(rewards: torch.Tensor, *, group_size: int, eps: float = 1e-6,
                     normalize_std: bool = True) -> torch.Tensor:
    """GRPO advantages: rewards centred (and scaled) within each group of ``group_size`` rows.

    Args:
        rewards: ``[B]`` sequence rewards, finite.
        group_size: rows ``[g m, (g + 1) m)`` form group ``g``; ``B % group_size == 0``.
        eps: added to the standard deviation (> 0 when ``normalize_std``).
        normalize_std: divide by the group's standard deviation (False: Dr. GRPO).

    ``A_i = (r_i − mean_g r) / (std_g r + eps)``, or ``r_i − mean_g r`` with
    ``normalize_std=False`` (Dr. GRPO). ``std`` is the sample standard deviation (ddof = 1,
    ``torch.std``'s default), as verl's ``compute_grpo_outcome_advantage`` and TRL's
    ``GRPOTrainer`` use. A group of one row follows verl: mean 0 and std 1, so ``A = r/(1+eps)``.
    ``eps`` must be > 0 when ``normalize_std`` (a group of equal rewards has std 0). Returns [B]
    in fp32 (fp64 for fp64 rewards), detached.
    """
    check_tensor("rewards", rewards, floating=True)
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected shape (B,), got {tuple(rewards.shape)}")
    m = check_group_size(group_size, rewards.shape[0])
    if normalize_std:
        eps = check_positive("eps", eps)
    check_finite("rewards", rewards)
    with torch.no_grad():
        r = rewards.to(compute_dtype(rewards.dtype)).reshape(-1, m)
        if m == 1:
            centred, std = r, torch.ones_like(r)
        else:
            centred = r - r.mean(-1, keepdim=True)
            std = (centred.square().sum(-1, keepdim=True) / (m - 1)).sqrt()   # ddof = 1
        adv = centred / (std + eps) if normalize_std else centred
    return adv.reshape(-1)


def gr_opd_advantages(old_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                      mask: torch.Tensor, *, group_size: int, gamma: float = 0.99,
                      lam: float = 0.25, feedback_clip: float = 5.0, adv_clip: float = 5.0,
                      std_eps: float = 1e-6, context_parallel_group=None,
                      validate: bool = True, run) -> torch.Tensor:
    """GR-OPD's group-relative sequence credit, one advantage per response (``[B]``, detached).

    Args:
        old_logprobs: ``[B, T]`` log-probs of the sampling student.
        teacher_logprobs: ``[B, T]`` log-probs of the frozen teacher on the student's tokens.
        mask: ``[B, T]`` bool (or 0/1): the response tokens; every response needs one.
        group_size: responses per prompt; rows ``[g m, (g + 1) m)`` form group ``g``.
        gamma: the discount over a response's actor tokens, in (0, 1].
        lam: the share of the group mean kept in the advantage.
        feedback_clip, adv_clip: clamps (>= 0) of the per-token feedback and the advantage.
        std_eps: added to the group's population std (> 0).
        context_parallel_group: the ranks that hold chunks of the same sequences (as in
            ``policy_loss``): every rank gets the advantages of the whole sequences.
        validate: check the values of the ``[B, T]`` inputs (host syncs).

    ::

        r_it = clamp(teacher_lp_it − old_lp_it, −feedback_clip, feedback_clip)
        S_i  = Σ_k γ^{k−1} r_{i,t_k} / Σ_k γ^{k−1}
               (t_k = k-th actor token of response i, k = 1..T_i)
        μ_g, σ_g = mean and POPULATION std (ddof=0) of S over the group
        A_i  = clamp( (S_i − μ_g + λ μ_g) / (σ_g + std_eps), −adv_clip, adv_clip )

    The discount counts actor tokens only: it restarts at every response and skips masked
    positions. A group of equal scores (σ = 0) gives ``clamp(λ μ_g / std_eps)``, finite.
    Computed in fp32 (fp64 when either input is fp64); every response needs an actor token.
    ``gamma`` in (0, 1], clips >= 0, ``std_eps`` > 0. ``validate=False`` skips the value checks
    (finite inputs at actor tokens, a token in every response; host syncs): a response without
    one then scores 0. Call it once per rollout on the whole batch and pass ``advantages=`` to
    ``gr_opd_loss`` for every micro-batch (fused: one kernel, one program per group).
    """
    def check(old_logprobs, teacher_logprobs, mask, whole=True):
        return check_advantage_inputs(
            old_logprobs, teacher_logprobs, mask, group_size=group_size, gamma=gamma, lam=lam,
            feedback_clip=feedback_clip, adv_clip=adv_clip, std_eps=std_eps, validate=validate,
            whole=whole)

    with run.on(old_logprobs) as (impl, old_logprobs):
        acc = compute_dtype(old_logprobs.dtype, teacher_logprobs.dtype)
        if context_parallel_group is None:
            args = check(old_logprobs, teacher_logprobs, mask)
            return impl.gr_opd_advantages(old_logprobs.detach(), teacher_logprobs.detach(),
                                          args.mask, args.hyper, acc)[0]
        with context.agreed(context_parallel_group, mask):
            args = check(old_logprobs, teacher_logprobs, mask, whole=False)
        return _context_credit(old_logprobs.detach(), teacher_logprobs.detach(), args.mask,
                               args.hyper, acc, context_parallel_group, validate)[0]


def gr_opd_loss(policy, old_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                mask: torch.Tensor, *, group_size: int, gamma: float = 0.99, lam: float = 0.25,
                eps: float = 0.2, feedback_clip: float = 5.0, adv_clip: float = 5.0,
                std_eps: float = 1e-6, advantages: Optional[torch.Tensor] = None,
                loss_scale: float = 1.0, num_sequences: Optional[float] = None,
                context_parallel_group=None, validate: bool = True, run) -> LossOutput:
    """GR-OPD: PPO on the student's tokens with the group-relative teacher credit ``A_i``.

    Args:
        policy: learner log-probs ``[B, T]`` (requires grad), ``rlfuse.Logits`` or
            ``rlfuse.LinearHead``.
        old_logprobs: ``[B, T]`` log-probs of the sampling student (detached).
        teacher_logprobs: ``[B, T]`` log-probs of the frozen teacher replayed on the student's
            tokens (detached).
        mask: ``[B, T]`` bool (or 0/1): the response tokens; every response needs one.
        group_size: responses per prompt; rows ``[g m, (g + 1) m)`` form group ``g``.
        gamma, lam, feedback_clip, adv_clip, std_eps: the advantage (see
            :func:`gr_opd_advantages`); all runtime kernel arguments.
        eps: PPO clip range ``[1 − eps, 1 + eps]``, or ``(eps_low, eps_high)`` for
            ``[1 − eps_low, 1 + eps_high]``.
        advantages: precomputed ``[B]`` (or ``[B, 1]``) advantages (from
            ``gr_opd_advantages`` on the whole rollout); ``teacher_logprobs`` then only feeds
            the ``feedback_mean`` metric.
        loss_scale: multiplies the loss and every gradient, inside the kernels (e.g.
            ``1 / gradient_accumulation_steps``): no pass over a gradient to rescale it.
        num_sequences: the global number of responses ``B`` (default: the local one).
        context_parallel_group: the ranks that hold chunks of the same sequences (as in
            ``policy_loss``).
        validate: check the values of the ``[B, T]`` inputs and refuse an overflowing ``ρ A``
            (host syncs); shapes, dtypes and devices are always checked.

    ::

        ρ_it = exp(lp_it − old_lp_it)
        L    = −(1/B) Σ_i (1/T_i) Σ_t M_it min(ρ_it A_i, clip(ρ_it, 1−ε, 1+ε) A_i)
        ∂L/∂lp_it = −A_i ρ_it 1[active_it] M_it / (B T_i)

    Per-response token mean first, then the mean over responses (never a global token mean);
    ``B`` is ``num_sequences``. The PPO branch is chosen in log-ratio space and only the selected
    branch is exponentiated; when it is the unclipped negative-advantage branch and ``ρ A``
    overflows the compute dtype (fp32 for bf16/fp16/fp32 inputs, fp64 for fp64) this raises
    ``ValueError`` rather than returning inf/NaN (``validate=False``: the ``overflow`` metric).

    Metrics (detached): ``clip_frac`` share of actor tokens where the clipped branch is
    selected, ``clip_frac_low`` / ``clip_frac_high`` the shares clipped from below (A < 0)
    and above (A > 0); ``adv_mean`` / ``adv_abs_mean`` mean of A_i / |A_i| over the responses;
    ``feedback_mean`` mean of the clamped feedback r_it over actor tokens (computed from
    ``teacher_logprobs`` also when ``advantages`` are given); ``overflow`` as in GPPO.

    Fused (``rlfuse.gr_opd_loss``): the advantage kernel, then GPPO's surrogate kernels with the
    fixed region ``[1 − ε, 1 + ε]``; from ``Logits`` one single pass over the logits, from
    ``LinearHead`` that pass on each chunk of the logits.
    """
    def check(policy, old_logprobs, teacher_logprobs, mask, whole=True):
        return check_gr_opd_args(
            policy, old_logprobs, teacher_logprobs, mask, group_size=group_size, gamma=gamma,
            lam=lam, eps=eps, feedback_clip=feedback_clip, adv_clip=adv_clip, std_eps=std_eps,
            advantages=advantages, loss_scale=loss_scale, num_sequences=num_sequences,
            validate=validate, whole=whole)

    group = context_parallel_group
    with run.on(policy) as (impl, policy):
        if group is None:
            args = check(policy, old_logprobs, teacher_logprobs, mask)
            return _gr_opd_step(impl, policy, args, old_logprobs.detach(),
                                teacher_logprobs.detach(), args.loss.mask, validate)
        with context.agreed(group, mask):
            args = check(policy, old_logprobs, teacher_logprobs, mask, whole=False)
        if impl.context_in_place:   # the advantages of whole sequences, the loss step in place
            old = old_logprobs.detach()
            acc = compute_dtype(args.loss.info.compute_dtype, old.dtype, teacher_logprobs.dtype)
            credit = _context_credit(old, teacher_logprobs.detach(), args.loss.mask,
                                     args.hyper, acc, group, validate)
            loss = args.loss._replace(counts=context.sequence_counts(args.loss.mask, group),
                                      context_parallel_group=group)
            return _gr_opd_step(impl, policy, args._replace(loss=loss), old, None,
                                args.loss.mask, validate, credit=credit)
        whole = context.whole_sequences(impl, group, policy, args.loss.mask,
                                        {"old": old_logprobs, "teacher": teacher_logprobs},
                                        validate=validate)
        old, teacher = whole.tensors["old"], whole.tensors["teacher"]
        args = check(whole.logprobs, old, teacher, whole.mask)
        return context.share(_gr_opd_step(impl, whole.logprobs, args, old.detach(),
                                          teacher.detach(), args.loss.mask, validate), group)


def _gr_opd_step(impl, policy, args, old: torch.Tensor, teacher: Optional[torch.Tensor],
                 mask: torch.Tensor, validate: bool, credit=None) -> LossOutput:
    """GR-OPD's advantages from ``old``, ``teacher`` and ``mask`` (detached; or ``credit``,
    the advantages and the mean feedback found already), then the loss step of ``args``
    (checked ``GROPDArgs``) on ``policy`` with the behaviour log-probs ``old``, and the
    metrics."""
    cdt = args.loss.info.compute_dtype
    if credit is not None:
        adv, feedback_mean = credit
    else:
        acc = compute_dtype(cdt, old.dtype, teacher.dtype)   # the advantages' widest input
        if args.advantages is None:
            adv, feedback_mean = impl.gr_opd_advantages(old, teacher, mask, args.hyper, acc)
        else:   # the metric alone, from [B, T] data
            feedback_mean = masked_mean(clamped_feedback(old.to(acc), teacher.to(acc), mask,
                                                         args.hyper.feedback_clip), mask)
    if args.advantages is not None:
        adv = args.advantages.detach()
    out = impl.policy_loss(policy, args.loss._replace(advantages=adv), old, None, None,
                           validate)
    low, high = out.metrics["clip_frac_low"], out.metrics["clip_frac_high"]
    adv_c = adv.to(cdt)
    empty = adv_c.new_zeros(())
    return LossOutput(out.loss, {
        "clip_frac": low + high, "clip_frac_low": low, "clip_frac_high": high,
        "adv_mean": adv_c.mean() if adv_c.numel() else empty,
        "adv_abs_mean": adv_c.abs().mean() if adv_c.numel() else empty,
        "feedback_mean": feedback_mean, "overflow": out.metrics["overflow"]})


def _context_credit(old: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, hyper,
                    acc: torch.dtype, group, validate: bool):
    """GR-OPD's ``(advantages [B], mean clamped feedback)`` of whole sequences from this rank's
    chunks under context parallelism, the same on every rank: each chunk's discounted sums with
    its actor tokens counted from 1 (``[B, 2]`` each), every rank's in one all-gather, each
    chunk's sums scaled by gamma to the number of actor tokens before it in the sequence (an
    exclusive scan over the chunks in order), never the sequences themselves; the feedback's
    sum and count in one all-reduce. ``validate``: every sequence needs an actor token."""
    import torch.distributed as dist

    with torch.no_grad():
        feedback = clamped_feedback(old.to(acc), teacher.to(acc), mask, hyper.feedback_clip)
        B, c = mask.shape[0], mask.shape[1] // 2
        num, den = discounted_sums(feedback.view(B, 2, c), mask.view(B, 2, c), hyper.gamma)
        tokens = mask.view(B, 2, c).sum(-1).to(acc)
        tokens, num, den = context.gather_chunks(torch.stack([tokens, num, den], -1),
                                                 group).unbind(-1)   # [B, 2 cp] each
        if validate:
            check_actor_tokens((tokens.sum(-1) > 0)[:, None], 1, what="sequence")
        scale = torch.pow(hyper.gamma, tokens.cumsum(-1) - tokens)
        score = (scale * num).sum(-1) / (scale * den).sum(-1).clamp_min(torch.finfo(acc).tiny)
        total = torch.stack([torch.where(mask, feedback, 0.0).sum(), mask.sum().to(acc)])
        dist.all_reduce(total, group=group)
        return (group_credit(score, hyper.group_size, hyper.lam, hyper.adv_clip,
                             hyper.std_eps), total[0] / total[1].clamp_min(1))


class AdvantageArgs(NamedTuple):
    """The normalised hyper-parameters of GR-OPD's advantages (the kernel's argument order)."""

    group_size: int
    gamma: float
    lam: float
    feedback_clip: float
    adv_clip: float
    std_eps: float


def _check_advantage_args(group_size, batch: int, gamma, lam, feedback_clip, adv_clip,
                          std_eps) -> AdvantageArgs:
    return AdvantageArgs(check_group_size(group_size, batch), check_unit_interval("gamma", gamma),
                         check_number("lam", lam),
                         check_nonnegative("feedback_clip", feedback_clip),
                         check_nonnegative("adv_clip", adv_clip),
                         check_positive("std_eps", std_eps))


class GROPDAdvantageArgs(NamedTuple):
    mask: torch.Tensor             # bool
    hyper: AdvantageArgs


def check_advantage_inputs(old_logprobs, teacher_logprobs, mask, *, group_size, gamma, lam,
                           feedback_clip, adv_clip, std_eps, validate,
                           whole: bool = True) -> GROPDAdvantageArgs:
    """The checks of ``gr_opd_advantages`` (``whole`` as in ``check_ggpo_args``)."""
    check_tensor("old_logprobs", old_logprobs, floating=True)
    if old_logprobs.dim() != 2:
        raise ValueError(f"old_logprobs: expected shape [B, T], got {tuple(old_logprobs.shape)}")
    shape = tuple(old_logprobs.shape)
    mask = check_token_tensors(mask, {"old_logprobs": old_logprobs,
                                      "teacher_logprobs": teacher_logprobs},
                               shape=shape, device=old_logprobs.device, validate=validate)
    hyper = _check_advantage_args(group_size, shape[0], gamma, lam, feedback_clip, adv_clip,
                                  std_eps)
    if validate and whole:
        check_actor_tokens(mask, 1, what="sequence")
    return GROPDAdvantageArgs(mask, hyper)


class GROPDArgs(NamedTuple):
    """GR-OPD's loss: its advantages' hyper-parameters, the advantages given (or None), and the
    loss step, ``policy_loss`` of the clip over ``[1 - eps_low, 1 + eps_high]`` with no dual
    clip and no clamp of the log-ratio, aggregated by ``seq-mean-token-mean`` (its advantages
    filled in once known)."""

    hyper: AdvantageArgs
    advantages: Optional[torch.Tensor]   # [B]
    loss: "PolicyLossArgs"


def check_gr_opd_args(policy, old_logprobs, teacher_logprobs, mask, *, group_size, gamma, lam,
                      eps, feedback_clip, adv_clip, std_eps, advantages, loss_scale,
                      num_sequences, validate, whole: bool = True) -> GROPDArgs:
    """The checks of ``gr_opd_loss`` (``whole`` as in ``check_ggpo_args``)."""
    info, mask = check_loss_policy(policy, mask, {"old_logprobs": old_logprobs,
                                             "teacher_logprobs": teacher_logprobs}, validate)
    batch, device = info.shape[0], info.device
    hyper = _check_advantage_args(group_size, batch, gamma, lam, feedback_clip, adv_clip,
                                  std_eps)
    objective = Clip(clip=check_clip("eps", eps), log_ratio_clamp=None)
    if advantages is not None:
        if isinstance(advantages, torch.Tensor) and tuple(advantages.shape) == (batch, 1):
            advantages = advantages[:, 0]
        check_sequence_tensor("advantages", advantages, batch=batch, device=device,
                              validate=validate)
    num_sequences = check_count("num_sequences", num_sequences, device, validate)
    check_policy_targets(policy, mask, mask.shape, validate)
    if validate and whole:
        check_actor_tokens(mask, 1, what="sequence")
    loss = PolicyLossArgs(info, mask, advantages, None, objective, "seq-mean-token-mean", None,
                          None, None, None, check_loss_scale(loss_scale), None, num_sequences)
    return GROPDArgs(hyper, advantages, loss)
