"""What the fused kernels and the reference must agree on.

The names of the choices (geometries, topologies, aggregations), the argument checks of every
public function and the normalised arguments they return, the aggregation weights, and the small
``[B, T]`` helpers both paths use. It sits below ``reference/`` and ``fused_losses/``: both import
it, it imports neither.

Every check reads only metadata and ``[B, T]``-sized data (never the logits' values) and raises a
``ValueError`` / ``TypeError`` naming the argument and what was expected. With ``validate=False``
only metadata is checked: nothing reads a tensor's values, so nothing syncs with the host.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import torch

from ._types import LinearHead, Logits, compute_dtype
from ._validation import (check_actor_tokens, check_choice, check_finite, check_group_size,
                          check_logits, check_mask, check_no_overlap, check_nonnegative,
                          check_number, check_positive, check_sequence_tensor, check_targets,
                          check_tensor, check_token_tensors, check_unit_interval)

GEOMETRIES = ("tv", "chi2", "hellinger", "kl", "two_sided_log")
TOPOLOGIES = ("mc", "atomic", "binary")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                "seq-mean-token-sum-norm", "token-sum")
RATIO_LEVELS = ("token", "sequence")
MU_MIN = 1e-6  # mu = exp(old_lp) is clamped to [MU_MIN, 1 - MU_MIN]


# --------------------------------------------------------------------------------------------
# Policies and log-probs
# --------------------------------------------------------------------------------------------

class PolicyInfo(NamedTuple):
    """What the losses need to know about ``policy`` before computing its log-probs."""

    shape: Tuple[int, int]       # (B, T)
    device: torch.device
    compute_dtype: torch.dtype   # fp64 for fp64 inputs, fp32 otherwise


def policy_device(policy) -> Optional[torch.device]:
    """The device of a policy (log-probs, ``Logits`` or ``LinearHead``) or of a tensor; None
    for anything else (the checks then say what was expected)."""
    if isinstance(policy, Logits):
        policy = policy.logits
    elif isinstance(policy, LinearHead):
        policy = policy.hidden
    return policy.device if isinstance(policy, torch.Tensor) else None


def _check_window(targets, offset, *, batch: int, rows: int, device) -> None:
    """``targets [B, T]`` (integers) predicted by the rows ``[offset, offset + T)`` of ``rows``
    positions."""
    check_tensor("policy.targets", targets, device=device, floating=False)
    if targets.dim() != 2 or targets.shape[0] != batch:
        raise ValueError(f"policy.targets: expected shape [B, T] with B = {batch} (the "
                         f"policy's batch), got {tuple(targets.shape)}")
    T = targets.shape[1]
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(f"policy.offset: expected an int, got {type(offset).__name__}")
    if offset < 0 or offset + T > rows:
        raise ValueError(f"policy.offset: the rows [offset, offset + T) = [{offset}, "
                         f"{offset + T}) must lie within the policy's {rows} positions")


def _check_linear_head(head: LinearHead, dims: int) -> None:
    hidden, weight, bias = head.hidden, head.weight, head.bias
    check_tensor("policy.hidden", hidden, floating=True)
    if hidden.dim() != dims:
        expected = "[B, S, H]" if dims == 3 else "[N, H] (packed rows, with index)"
        raise ValueError(f"policy.hidden: expected shape {expected}, got "
                         f"{tuple(hidden.shape)}")
    check_tensor("policy.weight", weight, device=hidden.device, floating=True)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise ValueError(f"policy.weight: expected shape [V, H] with H = {hidden.shape[-1]} "
                         f"(the hidden size) and V >= 1, got {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"policy.weight: expected the hidden states' dtype {hidden.dtype}, got "
                        f"{weight.dtype}")
    if bias is not None:
        check_tensor("policy.bias", bias, shape=(weight.shape[0],), device=hidden.device,
                     floating=True)
        if bias.dtype != hidden.dtype:
            raise TypeError(f"policy.bias: expected the hidden states' dtype {hidden.dtype}, "
                            f"got {bias.dtype}")
    if head.chunk_tokens is not None and (isinstance(head.chunk_tokens, bool) or not isinstance(
            head.chunk_tokens, int) or head.chunk_tokens <= 0):
        raise ValueError(f"policy.chunk_tokens: expected None or an int > 0, got "
                         f"{head.chunk_tokens!r}")


def _check_group(group) -> int:
    """The size of a ``vocab_parallel_group``: a process group of an initialised
    ``torch.distributed``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("policy.vocab_parallel_group: torch.distributed is not initialised")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"policy.vocab_parallel_group: expected a torch.distributed "
                        f"ProcessGroup, got {type(group).__name__}")
    return dist.get_world_size(group)


def _check_packed(policy, loss_shape) -> Tuple[Tuple[int, ...], torch.device, torch.dtype]:
    """A packed policy: ``[N, V]`` logits or ``[N, H]`` hidden rows, ``targets [N]`` and
    ``index [N]`` (int64); its loss positions are ``loss_shape`` (the mask's), else ``(N,)``."""
    if isinstance(policy, Logits):
        check_logits(policy.logits)
        rows = policy.logits
        if rows.dim() != 2:
            raise ValueError(f"policy.logits: expected shape [N, V] (packed rows, with index), "
                             f"got {tuple(rows.shape)}")
        if policy.inplace_backward:
            check_no_overlap("policy.logits", rows)
    else:
        _check_linear_head(policy, 2)
        rows = policy.hidden
    N = rows.shape[0]
    check_tensor("policy.targets", policy.targets, shape=(N,), device=rows.device,
                 floating=False)
    check_tensor("policy.index", policy.index, shape=(N,), device=rows.device, floating=False)
    if policy.index.dtype != torch.int64:
        raise TypeError(f"policy.index: expected int64, got {policy.index.dtype}")
    if policy.offset != 0:
        raise ValueError(f"policy.offset: packed rows (index) take no offset, got "
                         f"{policy.offset!r}")
    if loss_shape is not None and len(loss_shape) != 2:
        raise ValueError(f"mask: expected shape [B, T] (the loss positions index points "
                         f"into), got {tuple(loss_shape)}")
    return tuple(loss_shape) if loss_shape is not None else (N,), rows.device, rows.dtype


def check_policy(policy, loss_shape: Optional[Tuple[int, ...]] = None) -> PolicyInfo:
    """A policy is learner log-probs ``[B, T]`` (floating tensor), :class:`rlfuse.Logits` with
    ``[B, S, V]`` logits or :class:`rlfuse.LinearHead` with ``[B, S, H]`` hidden states, whose
    rows ``[offset, offset + T)`` predict ``[B, T]`` targets, or packed rows with ``index``
    into ``loss_shape`` (the mask's shape; ``(N,)`` without one). Only metadata is read here;
    the targets' and index's values are checked with the mask."""
    if isinstance(policy, (Logits, LinearHead)) and policy.vocab_parallel_group is not None:
        _check_group(policy.vocab_parallel_group)
    if isinstance(policy, (Logits, LinearHead)) and policy.index is not None:
        shape, device, dtype = _check_packed(policy, loss_shape)
    elif isinstance(policy, Logits):
        logits = policy.logits
        check_logits(logits)
        if logits.dim() != 3:
            raise ValueError(f"policy.logits: expected shape [B, S, V], got "
                             f"{tuple(logits.shape)}")
        _check_window(policy.targets, policy.offset, batch=logits.shape[0],
                      rows=logits.shape[1], device=logits.device)
        if policy.inplace_backward:
            check_no_overlap("policy.logits", logits)
        shape, device, dtype = policy.targets.shape, logits.device, logits.dtype
    elif isinstance(policy, LinearHead):
        _check_linear_head(policy, 3)
        hidden = policy.hidden
        _check_window(policy.targets, policy.offset, batch=hidden.shape[0],
                      rows=hidden.shape[1], device=hidden.device)
        shape, device, dtype = policy.targets.shape, hidden.device, hidden.dtype
    elif isinstance(policy, torch.Tensor):
        check_tensor("policy", policy, floating=True)
        if policy.dim() != 2:
            raise ValueError(f"policy: expected learner log-probs of shape [B, T] (or "
                             f"rlfuse.Logits / rlfuse.LinearHead), got shape "
                             f"{tuple(policy.shape)}")
        shape, device, dtype = policy.shape, policy.device, policy.dtype
    else:
        raise TypeError(f"policy: expected a [B, T] tensor of log-probs, rlfuse.Logits or "
                        f"rlfuse.LinearHead, got {type(policy).__name__}")
    return PolicyInfo(tuple(shape), device, compute_dtype(dtype))


def vocab_size(policy) -> int:
    """The vocabulary of this rank's logits (its shard under a ``vocab_parallel_group``)."""
    return policy.logits.shape[-1] if isinstance(policy, Logits) else policy.weight.shape[0]


def vocab_shards(policy, validate: bool) -> Tuple[int, int]:
    """``(rank, world)`` of the vocabulary split (``(0, 1)`` without a group). With
    ``validate`` the shard sizes of all ranks are compared first, in one collective every rank
    makes, so that a mismatch raises on every rank instead of hanging the others."""
    group = policy.vocab_parallel_group
    if group is None:
        return 0, 1
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if validate:
        local = torch.tensor([vocab_size(policy)], dtype=torch.int64,
                             device=policy_device(policy))
        sizes = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(sizes, local, group=group)
        sizes = [int(v) for v in torch.cat(sizes).tolist()]
        if len(set(sizes)) != 1:
            raise ValueError(f"policy.vocab_parallel_group: every rank must hold a shard of "
                             f"the same size V_local (Megatron's split: pad the vocabulary to a "
                             f"multiple of the group size); got {sizes} over the ranks")
    return rank, world


def packed_rows_mask(index: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """``[N]`` bool: the packed rows a loss position uses (index >= 0, unmasked there)."""
    used = index >= 0
    if mask is None:
        return used
    return used & as_bool_mask(mask).reshape(-1)[index.clamp_min(0)]


def _check_index(index: torch.Tensor, positions: Optional[int]) -> None:
    """Values in ``[-1, positions)`` (``positions`` None: >= -1), no position twice (one host
    sync)."""
    bad = index < -1
    if positions is not None:
        bad |= index >= positions
    if bool(bad.any()):
        expected = f"[-1, {positions}) (B T = {positions} loss positions" if positions \
            is not None else "[-1, B T) ("
        raise ValueError(f"policy.index: expected values in {expected}, -1: none), found "
                         f"{int(index[bad][0])}")
    used = index[index >= 0]
    if used.numel() != torch.unique(used).numel():
        raise ValueError("policy.index: a loss position appears twice")


def check_logits_targets(policy, mask: Optional[torch.Tensor], shape, validate: bool) -> None:
    """The temperature and the targets of a ``Logits`` / ``LinearHead`` policy: integer
    ``shape`` (packed: ``[N]``, and the index); with ``validate``, in range where unmasked
    (everywhere without a mask), over the whole vocabulary of a ``vocab_parallel_group``."""
    if isinstance(policy, (Logits, LinearHead)):
        check_positive("policy.temperature", policy.temperature)
        device = policy_device(policy)
        _, world = vocab_shards(policy, validate)
        vocab = vocab_size(policy) * world
        if policy.index is not None:
            shape = tuple(policy.targets.shape)
            if validate:
                _check_index(policy.index, math.prod(mask.shape) if mask is not None
                             else None)
                mask = packed_rows_mask(policy.index, mask) if mask is not None \
                    else policy.index >= 0
        if validate:
            check_targets(policy.targets, shape, vocab, device, mask)
        else:
            check_tensor("targets", policy.targets, shape=shape, device=device, floating=False)


def as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def check_logprob_args(logits, targets, temperature, mask, inplace_backward: bool,
                       validate: bool) -> Optional[torch.Tensor]:
    """Checks the arguments of ``token_logprobs``; returns the mask as bool (or None). Without
    ``validate`` the values (0/1 mask, target range: one host sync) are not checked."""
    check_logits(logits)
    check_positive("temperature", temperature)
    if inplace_backward:
        check_no_overlap("logits", logits)
    shape = tuple(logits.shape[:-1])
    if mask is not None:
        if validate:
            mask = check_mask(mask, shape, logits.device)
        else:
            check_tensor("mask", mask, shape=shape, device=logits.device)
            mask = as_bool_mask(mask)
    if validate:
        check_targets(targets, shape, logits.shape[-1], logits.device, mask)
    else:
        check_tensor("targets", targets, shape=shape, device=logits.device, floating=False)
    return mask


# --------------------------------------------------------------------------------------------
# GGPO
# --------------------------------------------------------------------------------------------

class GGPOArgs(NamedTuple):
    info: PolicyInfo
    mask: torch.Tensor             # bool
    group_size: int
    beta: float
    clip_radius: Optional[float]
    loss_scale: float
    num_tokens: Optional[float]


def check_loss_scale(loss_scale) -> float:
    """A finite number that multiplies the loss and every gradient."""
    value = check_number("loss_scale", loss_scale)
    if abs(value) == math.inf:
        raise ValueError(f"loss_scale: expected a finite number, got {value}")
    return value


def check_ggpo_args(policy, ref_logprobs, rewards, mask, *, group_size, beta, clip_radius,
                    loss_scale, num_tokens, validate) -> GGPOArgs:
    info = check_policy(policy, getattr(mask, "shape", None))
    batch, device = info.shape[0], info.device
    mask = check_token_tensors(mask, {"ref_logprobs": ref_logprobs}, shape=info.shape,
                               device=device, validate=validate)
    check_sequence_tensor("rewards", rewards, batch=batch, device=device, validate=validate)
    m = check_group_size(group_size, batch, minimum=2)
    beta = check_positive("beta", beta)
    rho = None if clip_radius is None else check_positive("clip_radius", clip_radius,
                                                          allow_inf=True)
    if num_tokens is not None:
        num_tokens = check_positive("num_tokens", num_tokens)
    check_logits_targets(policy, mask, mask.shape, validate)
    if validate:
        check_actor_tokens(mask, m, what="group")
    return GGPOArgs(info, mask, m, beta, rho, check_loss_scale(loss_scale), num_tokens)


# --------------------------------------------------------------------------------------------
# GPPO
# --------------------------------------------------------------------------------------------

def check_count(name: str, value, device: torch.device, validate: bool):
    """A global count: None (the local one), a number > 0, or a 0-dim tensor on ``device``
    (e.g. all-reduced over a process group: never read on the host unless ``validate``)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        check_tensor(name, value, shape=(), device=device)
        if validate and not bool(value > 0):
            raise ValueError(f"{name}: expected a count > 0, got {value.item()}")
        return value
    return check_positive(name, value)


def check_sides(name: str, value, check) -> Tuple[float, float]:
    """One value or a ``(low, high)`` pair, each side checked by ``check(name, side)``."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{name}: expected a number or a (low, high) pair, got {value!r}")
        return check(f"{name}[0]", value[0]), check(f"{name}[1]", value[1])
    value = check(name, value)
    return value, value


def check_region(geometry: str, topology: str, delta) -> Tuple[float, float]:
    """A known geometry and topology and ``delta > 0`` (or a pair of them, for the lower and
    the upper side of the region); returns ``(delta_low, delta_high)``."""
    check_choice("geometry", geometry, GEOMETRIES)
    check_choice("topology", topology, TOPOLOGIES)
    return check_sides("delta", delta, check_positive)


def _check_clip_side(name: str, value) -> float:
    value = check_number(name, value)
    if not 0.0 < value < 1.0:
        raise ValueError(f"{name}: expected a clip range in (0, 1), got {value}")
    return value


def check_clip(name: str, clip) -> Tuple[float, float]:
    """PPO's ``eps`` or ``(eps_low, eps_high)``, each in (0, 1): the region
    ``[1 - eps_low, 1 + eps_high]``."""
    return check_sides(name, clip, _check_clip_side)


def check_dual_clip(dual_clip) -> float:
    """None (no dual clip: inf) or a finite ``c > 1``."""
    if dual_clip is None:
        return math.inf
    value = check_number("dual_clip", dual_clip)
    if not 1.0 < value < math.inf:
        raise ValueError(f"dual_clip: expected None or a finite value > 1, got {value}")
    return value


def check_bounds_args(old_logprobs, geometry, topology, delta) -> Tuple[float, float]:
    """The checks of ``gppo_bounds``; returns ``(delta_low, delta_high)``."""
    check_tensor("old_logprobs", old_logprobs, floating=True)
    return check_region(geometry, topology, delta)


def check_group_advantages_args(rewards, group_size, eps, normalize_std) -> Tuple[int, float]:
    """The checks of ``group_advantages``; returns ``(group_size, eps)``."""
    check_tensor("rewards", rewards, floating=True)
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected shape (B,), got {tuple(rewards.shape)}")
    m = check_group_size(group_size, rewards.shape[0])
    if normalize_std:
        eps = check_positive("eps", eps)
    check_finite("rewards", rewards)
    return m, eps


def check_advantages(advantages, info: PolicyInfo, mask, validate: bool,
                     name: str = "advantages") -> torch.Tensor:
    """``[B]``, ``[B, 1]`` or ``[B, T]`` advantages (finite at actor tokens with ``validate``);
    returns them as ``[B]`` or ``[B, T]``."""
    batch, shape = info.shape[0], info.shape
    check_tensor(name, advantages, device=info.device, floating=True)
    if tuple(advantages.shape) not in ((batch,), (batch, 1), shape):
        raise ValueError(f"{name}: expected shape ({batch},), ({batch}, 1) or {shape}, got "
                         f"{tuple(advantages.shape)}")
    if advantages.dim() == 2 and advantages.shape[1] == 1 and shape[1] != 1:
        advantages = advantages[:, 0]
    if validate:
        check_finite(name, per_token(advantages, shape), mask)
    return advantages


def check_weights(weights, info: PolicyInfo, mask, validate: bool) -> Optional[torch.Tensor]:
    """Optional ``[B, T]`` per-token multipliers, finite and >= 0 at actor tokens."""
    if weights is None:
        return None
    check_tensor("weights", weights, shape=info.shape, device=info.device, floating=True)
    if validate:
        check_finite("weights", weights, mask)
        bad = (weights < 0) & mask
        if bool(bad.any()):
            raise ValueError(f"weights: expected values >= 0 at actor (mask=True) positions; "
                             f"found {weights[bad][0].item()}")
    return weights


class SurrogateArgs(NamedTuple):
    """The normalised arguments of the surrogate-family losses (GPPO, PPO)."""

    info: PolicyInfo
    mask: torch.Tensor             # bool
    advantages: torch.Tensor       # [B] or [B, T]
    weights: Optional[torch.Tensor]
    delta: Tuple[float, float]     # the region's (low, high) sizes
    dual_clip: float               # inf: none
    loss_scale: float
    num_tokens: Optional[float]
    num_sequences: Optional[float]


def _check_surrogate_args(policy, old_logprobs, advantages, mask, *, agg, weights, dual_clip,
                          loss_scale, num_tokens, num_sequences, validate):
    info = check_policy(policy, getattr(mask, "shape", None))
    token_tensors = {} if old_logprobs is None else {"old_logprobs": old_logprobs}
    mask = check_token_tensors(mask, token_tensors, shape=info.shape, device=info.device,
                               validate=validate)
    advantages = check_advantages(advantages, info, mask, validate)
    weights = check_weights(weights, info, mask, validate)
    check_choice("agg", agg, AGGREGATIONS)
    num_tokens = check_count("num_tokens", num_tokens, info.device, validate)
    num_sequences = check_count("num_sequences", num_sequences, info.device, validate)
    check_logits_targets(policy, mask, mask.shape, validate)
    return (info, mask, advantages, weights, check_dual_clip(dual_clip),
            check_loss_scale(loss_scale), num_tokens, num_sequences)


def check_gppo_args(policy, old_logprobs, advantages, mask, *, geometry, topology, delta, agg,
                    dual_clip, weights, loss_scale, num_tokens, num_sequences,
                    validate) -> SurrogateArgs:
    delta = check_region(geometry, topology, delta)
    info, mask, adv, w, c, scale, n_tok, n_seq = _check_surrogate_args(
        policy, old_logprobs, advantages, mask, agg=agg, weights=weights, dual_clip=dual_clip,
        loss_scale=loss_scale, num_tokens=num_tokens, num_sequences=num_sequences,
        validate=validate)
    return SurrogateArgs(info, mask, adv, w, delta, c, scale, n_tok, n_seq)


def check_ppo_args(policy, old_logprobs, advantages, mask, *, clip, dual_clip, ratio_level, agg,
                   weights, loss_scale, num_tokens, num_sequences, validate) -> SurrogateArgs:
    """The checks of ``ppo_loss``: ``delta`` of the result is ``(eps_low, eps_high)``."""
    eps = check_clip("clip", clip)
    check_choice("ratio_level", ratio_level, RATIO_LEVELS)
    info, mask, adv, w, c, scale, n_tok, n_seq = _check_surrogate_args(
        policy, old_logprobs, advantages, mask, agg=agg, weights=weights, dual_clip=dual_clip,
        loss_scale=loss_scale, num_tokens=num_tokens, num_sequences=num_sequences,
        validate=validate)
    return SurrogateArgs(info, mask, adv, w, eps, c, scale, n_tok, n_seq)


# --------------------------------------------------------------------------------------------
# GR-OPD
# --------------------------------------------------------------------------------------------

class AdvantageArgs(NamedTuple):
    """The normalised hyper-parameters of GR-OPD's advantages."""

    group_size: int
    gamma: float
    lam: float
    feedback_clip: float
    adv_clip: float
    std_eps: float


def check_advantage_args(group_size, batch: int, gamma, lam, feedback_clip, adv_clip,
                         std_eps) -> AdvantageArgs:
    return AdvantageArgs(check_group_size(group_size, batch), check_unit_interval("gamma", gamma),
                         check_number("lam", lam),
                         check_nonnegative("feedback_clip", feedback_clip),
                         check_nonnegative("adv_clip", adv_clip),
                         check_positive("std_eps", std_eps))


def check_advantage_inputs(old_logprobs, teacher_logprobs, mask, *, group_size, gamma, lam,
                           feedback_clip, adv_clip, std_eps,
                           validate) -> Tuple[torch.Tensor, AdvantageArgs]:
    """The checks of ``gr_opd_advantages``; returns the bool mask and the hyper-parameters."""
    check_tensor("old_logprobs", old_logprobs, floating=True)
    if old_logprobs.dim() != 2:
        raise ValueError(f"old_logprobs: expected shape [B, T], got {tuple(old_logprobs.shape)}")
    shape = tuple(old_logprobs.shape)
    mask = check_token_tensors(mask, {"old_logprobs": old_logprobs,
                                      "teacher_logprobs": teacher_logprobs},
                               shape=shape, device=old_logprobs.device, validate=validate)
    hyper = check_advantage_args(group_size, shape[0], gamma, lam, feedback_clip, adv_clip,
                                 std_eps)
    if validate:
        check_actor_tokens(mask, 1, what="sequence")
    return mask, hyper


class GROPDArgs(NamedTuple):
    info: PolicyInfo
    mask: torch.Tensor             # bool
    hyper: AdvantageArgs
    eps: Tuple[float, float]       # (eps_low, eps_high)
    advantages: Optional[torch.Tensor]   # [B]
    loss_scale: float
    num_sequences: Optional[float]


def check_gr_opd_args(policy, old_logprobs, teacher_logprobs, mask, *, group_size, gamma, lam,
                      eps, feedback_clip, adv_clip, std_eps, advantages, loss_scale,
                      num_sequences, validate) -> GROPDArgs:
    info = check_policy(policy, getattr(mask, "shape", None))
    batch, device = info.shape[0], info.device
    mask = check_token_tensors(mask, {"old_logprobs": old_logprobs,
                                      "teacher_logprobs": teacher_logprobs},
                               shape=info.shape, device=device, validate=validate)
    hyper = check_advantage_args(group_size, batch, gamma, lam, feedback_clip, adv_clip, std_eps)
    eps = check_sides("eps", eps, check_positive)
    if advantages is not None:
        if isinstance(advantages, torch.Tensor) and tuple(advantages.shape) == (batch, 1):
            advantages = advantages[:, 0]
        check_sequence_tensor("advantages", advantages, batch=batch, device=device,
                              validate=validate)
    num_sequences = check_count("num_sequences", num_sequences, device, validate)
    check_logits_targets(policy, mask, mask.shape, validate)
    if validate:
        check_actor_tokens(mask, 1, what="sequence")
    return GROPDArgs(info, mask, hyper, eps, advantages, check_loss_scale(loss_scale),
                     num_sequences)


# --------------------------------------------------------------------------------------------
# Shared [B, T] helpers
# --------------------------------------------------------------------------------------------

def per_token(x: torch.Tensor, shape) -> torch.Tensor:
    """A ``[B]`` (per sequence) or ``[B, T]`` tensor as ``[B, T]`` (a broadcast view)."""
    return x.unsqueeze(-1).expand(shape) if x.dim() == 1 else x


def aggregation_weights(mask: torch.Tensor, agg: str, dtype: torch.dtype, *,
                        num_tokens: Optional[float] = None,
                        num_sequences: Optional[float] = None) -> torch.Tensor:
    """The weight ``w_b`` of every token of row ``b`` (``[B]``) under the aggregation ``agg``
    (verl's ``agg_loss`` names): ``agg(x) = sum_bt M_bt x_bt w_b`` with

        token-mean               w = 1 / N_tok
        seq-mean-token-mean      w = 1 / (T_b N_seq)
        seq-mean-token-sum       w = 1 / N_seq
        seq-mean-token-sum-norm  w = 1 / (T N_seq)       (Dr. GRPO; T = mask.shape[-1])
        token-sum                w = 1

    ``N_tok = num_tokens`` (default: the local ``sum M``), ``N_seq = num_sequences`` (default:
    the local ``B``, empty rows included), ``T_b = sum_t M_bt``; the counts may be numbers or
    0-dim tensors. A zero local count is replaced by 1 (the sum it divides is then 0).
    """
    B, T = mask.shape
    tokens = mask.sum(-1, dtype=dtype)
    ones = torch.ones_like(tokens)
    if agg == "token-sum":
        return ones
    if agg == "token-mean":
        return ones / (tokens.sum().clamp_min(1) if num_tokens is None else num_tokens)
    n_seq = num_sequences if num_sequences is not None else max(B, 1)
    if agg == "seq-mean-token-mean":
        return ones / (tokens.clamp_min(1) * n_seq)
    if agg == "seq-mean-token-sum":
        return ones / n_seq
    return ones / (T * n_seq)  # seq-mean-token-sum-norm


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the actor positions (0 when there are none); ``x`` may be garbage off
    the mask."""
    return torch.where(mask, x, torch.zeros_like(x)).sum() / mask.sum().clamp_min(1)


def clamped_feedback(old: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor,
                     feedback_clip: float) -> torch.Tensor:
    """GR-OPD's ``r_it = clamp(teacher_lp - old_lp, +-feedback_clip)`` at actor tokens, 0
    elsewhere."""
    return torch.where(mask, (teacher - old).clamp(-feedback_clip, feedback_clip), 0.0)


def raise_on_overflow(count: torch.Tensor, dtype: torch.dtype) -> None:
    """The surrogate losses' refusal of an unrepresentable ``r A`` (``count``: the tokens where
    the selected unclipped ``r A`` overflowed ``dtype``). One host sync, so it runs only when
    the loss validates; otherwise the count becomes the ``overflow`` metric."""
    n = int(count.item())
    if n:
        raise ValueError(
            f"policy: the unclipped surrogate r*A overflows {dtype} at {n} actor token(s) "
            f"(log-ratio lp - old_lp too large); the importance ratio is not representable, "
            f"refusing to return inf/NaN (validate=False reports it as the 'overflow' metric)")
