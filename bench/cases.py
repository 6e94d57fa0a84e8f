"""What is measured: the shapes, ONE input factory (used for speed and for memory alike), the
ops, the implementations that run them, and each op's minimal HBM byte count (its floor) — the
one registry of the benchmark, the byte counts and the SASS counts (``tools.traffic``,
``tools.sass``) and their tests. ``VARIANTS`` are the forms a trainer calls beyond the
benchmark's grid (a whole output with an offset, ``loss_scale``, ...), held to an op's floor.

An op is a function of the inputs made by :func:`make_inputs`; every implementation of it goes
through the same call (``Op.run(lib, x)`` with ``lib`` = ``rlfuse``, ``rlfuse.reference`` or the
compiled reference), so the rows of one op differ only in the implementation. Liger-Kernel, where
it does the same work, has its own adapter (``Op.liger``): it wants ``[B, T+1, V]`` contiguous
logits, which is why the factory allocates those and hands the other implementations the
``logits[:, :-1]`` view (the layout a trainer passes; it must not be copied). TRL's chunked head
(``Op.trl``) is the peer of the LinearHead ops, its Triton log-probs and entropy of the
logits ops.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
from types import SimpleNamespace
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

import rlfuse

from . import distill_cases
from .distill_cases import TOP_K

MODES = ("fwd", "bwd", "fwd+bwd")
IMPLS = ("fused", "reference", "compiled", "liger", "trl")

# Every shape is B sequences of T = N / B positions, in groups of GROUP_SIZE rows (4 groups).
BATCH, GROUP_SIZE = 16, 4
DEFAULT_N = (16384, 4096)
DEFAULT_V = (151936, 128256, 32000)     # Qwen2/2.5, Llama 3, Llama 2 vocabularies
FP32_SHAPE = (16384, 151936)            # the one fp32 shape of the default grid
# --quick: small enough for the Triton interpreter on 2 CPU cores, whose cost is per program
# (row), not per element: 16 rows, two groups of 4 sequences of 2 positions.
QUICK_BATCH, QUICK_N, QUICK_V = 8, (16,), (1000,)
# The hidden size of the LinearHead ops (the policy as last hidden state + output head).
HIDDEN, QUICK_HIDDEN = 4096, 32

BETA = 0.1            # GGPO's KL weight (a runtime kernel argument; any value costs the same)
# ppo_loss as TRL's GRPOTrainer runs it with DAPO's clip-higher (loss_type "grpo": the token mean
# of each response, then over responses), the same in the Liger peers
PPO_CLIP = (0.2, 0.28)
PPO_AGG = "seq-mean-token-mean"
LIGER_MODULE = "liger_kernel.ops.grpo_loss"   # selective log-softmax and the GRPO loss
# TRL's chunked head (its GRPOTrainer's fused LM head: log-probs from the hidden states and the
# head without the [N, V] logits; Triton on CUDA, torch tiles elsewhere) and the vocabulary
# chunk its trainer passes
TRL_MODULE = "trl.kernels.chunked_logprob"
TRL_CHUNK_ATTR = ("trl.trainer.utils", "_CHUNKED_LOGPROB_CHUNK_SIZE")


@dataclasses.dataclass(frozen=True)
class Shape:
    N: int                     # tokens, B * T
    V: Optional[int]           # vocabulary; None for the ops that take [B, T] log-probs
    dtype: torch.dtype         # of the logits (float32 for the log-prob ops)
    batch: int
    group_size: int
    hidden: int = HIDDEN       # H of the LinearHead ops

    @property
    def T(self) -> int:
        return self.N // self.batch

    @property
    def element_size(self) -> int:
        return torch.finfo(self.dtype).bits // 8

    def __str__(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        return f"N={self.N} V={self.V} {dtype}" if self.V else f"N={self.N} [B,T] log-probs"


def make_shapes(Ns: Sequence[int] = (), Vs: Sequence[int] = (),
                dtypes: Sequence[torch.dtype] = (), *, quick: bool = False,
                hidden: Optional[int] = None):
    """The grid, headline shape first (largest N and V): logits shapes for every (N, V, dtype)
    and one log-prob shape per N. With no ``dtypes`` given: bf16, plus fp32 at ``FP32_SHAPE``."""
    batch = QUICK_BATCH if quick else BATCH
    Ns = sorted(Ns or (QUICK_N if quick else DEFAULT_N), reverse=True)
    Vs = sorted(Vs or (QUICK_V if quick else DEFAULT_V), reverse=True)
    for n in Ns:
        if n % batch:
            raise ValueError(f"--N: expected a multiple of B = {batch}, got {n}")
    hidden = hidden or (QUICK_HIDDEN if quick else HIDDEN)
    shape = lambda n, v, dt: Shape(n, v, dt, batch, GROUP_SIZE, hidden)  # noqa: E731
    logits = [shape(n, v, dt) for dt in (dtypes or (torch.bfloat16,)) for n in Ns for v in Vs]
    if not dtypes:
        n, v = FP32_SHAPE if not quick else (Ns[0], Vs[0])
        logits.append(shape(n, v, torch.float32))
    logprobs = [shape(n, None, torch.float32) for n in Ns]
    return logits[:1] + logprobs + logits[1:]


def headline_ops():
    """The headline's ops in the order they run (a time budget, which drops the compiled
    reference's cases first, keeps those of the first ops): every op on logits or a LinearHead,
    these three first."""
    first = ("token_logprobs", "gppo_logits", "gppo_head")
    return first + tuple(name for name, op in OPS.items() if op.from_logits and name not in first)


# --------------------------------------------------------------------------------------------
# The one input factory
# --------------------------------------------------------------------------------------------

@torch.no_grad()
def _own_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The policy's own log-probs, one sequence at a time (no [B, T, V] fp32 temporary)."""
    rows = [torch.log_softmax(logits[b].float(), -1).gather(-1, targets[b, :, None])[:, 0]
            for b in range(logits.shape[0])]
    return torch.stack(rows)


def make_inputs(shape: Shape, device, *, seed: int = 0, validate: bool = True,
                full_output: bool = False) -> SimpleNamespace:
    """Realistic inputs: logits ``randn * 2`` in the dtype, random targets, padded responses with
    ~85% actor tokens, old/ref log-probs = the policy's own + small noise (ratios near 1), a
    teacher further off, rewards 0/1. Leaves that require grad: ``logits`` (the ``[:, :-1]``
    view; its gradient is what the fused kernels write), ``logits_full`` (for Liger), ``lp``,
    and for the LinearHead ops ``hidden [B, T+1, H]`` and a trainable ``weight [V, H]`` (scaled
    so that their logits look like the others: ``randn * 2``). ``full_output``: also a model's
    whole output ``full_output [B, T + 2, V]`` whose rows ``1 .. T`` predict the targets (for
    the variants).
    """
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    B, T, m = shape.batch, shape.T, shape.group_size

    def randn(*size, dtype=torch.float32):
        return torch.randn(*size, generator=g, device=device, dtype=dtype)

    lengths = torch.randint((7 * T) // 10, T + 1, (B,), generator=g, device=device)
    mask = torch.arange(T, device=device) < lengths[:, None]   # response, then right padding
    rewards = torch.randint(0, 2, (B,), generator=g, device=device).float()
    x = SimpleNamespace(shape=shape, group_size=m, mask=mask, mask_i32=mask.to(torch.int32),
                        rewards=rewards, validate=validate, logits=None, logits_full=None,
                        targets=None)
    if shape.V is None:
        own = -4.0 * torch.rand(B, T, generator=g, device=device)
    else:
        logits_full = randn(B, T + 1, shape.V, dtype=shape.dtype).mul_(2.0)
        x.targets = torch.randint(0, shape.V, (B, T), generator=g, device=device)
        own = _own_logprobs(logits_full[:, :-1], x.targets)
        x.logits_full = logits_full.requires_grad_()
        x.logits = logits_full.detach()[:, :-1].requires_grad_()   # same storage, own leaf
        x.hidden = randn(B, T + 1, shape.hidden, dtype=shape.dtype).requires_grad_()
        x.weight = randn(shape.V, shape.hidden, dtype=shape.dtype).mul_(
            2.0 / shape.hidden ** 0.5).requires_grad_()
        if full_output:
            x.full_output = randn(B, T + 2, shape.V, dtype=shape.dtype).mul_(2.0) \
                .requires_grad_()
    x.lp = own.clone().requires_grad_()
    x.old_lp = (own + 0.05 * randn(B, T)).clamp_max(0.0)
    x.ref_lp = (own + 0.05 * randn(B, T)).clamp_max(0.0)
    x.teacher_lp = (own + 0.5 * randn(B, T)).clamp_max(0.0)
    x.advantages = rlfuse.reference.group_advantages(rewards, group_size=m)
    x.opd_advantages = rlfuse.reference.gr_opd_advantages(x.old_lp, x.teacher_lp, mask,
                                                          group_size=m)
    if shape.V is not None:
        distill_cases.add_teacher(x, shape, device, seed)
    return x


# --------------------------------------------------------------------------------------------
# The ops and their floors
# --------------------------------------------------------------------------------------------

# Bytes per token of the [B, T] side data (negligible beside the logits, kept for honesty).
TGT, MSK, F32 = 8, 1, 4      # int64 target id, bool mask, fp32 log-prob / lse / gradient


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    from_logits: bool                     # the policy is [B, T, V] logits (else [B, T] log-probs)
    run: Callable                         # (lib, x) -> output(s), differentiable
    # mode -> (reads of the logits, writes of dlogits, bytes per token of [B, T] data): the
    # least HBM traffic any implementation needs for that mode.
    floor: Dict[str, Tuple[int, int, int]]
    liger: Optional[Callable] = None      # (liger module, x) -> output(s), grads to logits_full
    liger_modes: Tuple[str, ...] = MODES
    trl: Optional[Callable] = None        # (TRL's module, x) -> output(s)
    # The single pass from logits writes dlogits in its forward and hands that buffer out in
    # ONE backward: its bwd alone cannot be repeated over one graph (and is almost free).
    fused_modes: Tuple[str, ...] = MODES
    modes: Tuple[str, ...] = MODES        # of every implementation
    # LinearHead ops: the matmuls of [N, H] x [H, V] a mode needs at least (2 N H V FLOPs
    # each); their floor is compute, not bytes
    matmuls: Optional[Dict[str, int]] = None
    # (x) -> the tensors a step differentiates; None: by form (logits, log-probs, hidden+weight)
    leaves: Optional[Callable] = None
    # (x) -> (rows S of the logits, the first row of the window); None: (T, 0)
    window: Optional[Callable] = None

    def bytes(self, shape: Shape, mode: str, actor_rows: Optional[int] = None) -> int:
        """The floor in bytes: each actor row of logits read ``reads`` times, every row written
        ``writes`` times (an actor row's gradient, a masked row's zeros), and the [B, T] data.
        ``actor_rows`` None: every row an actor's (the dense floor)."""
        reads, writes, per_token = self.floor[mode]
        actor = shape.N if actor_rows is None else actor_rows
        return (reads * actor + writes * shape.N) * (shape.V or 0) * shape.element_size \
            + per_token * shape.N

    def flops(self, shape: Shape, mode: str, actor_rows: Optional[int] = None
              ) -> Optional[int]:
        """The matmuls' FLOPs, over the actor rows only (a LinearHead gathers them)."""
        if self.matmuls is None:
            return None
        rows = shape.N if actor_rows is None else actor_rows
        return self.matmuls[mode] * 2 * rows * shape.hidden * shape.V


def _run_loss(call, form: str, lib, x):
    """A loss on the policy in any form: [B, T] log-probs, ``Logits`` (the [:, :-1] view) or
    ``LinearHead`` (hidden rows 0..T-1 with the head; row T predicts nothing)."""
    if form == "head":
        policy = lib.LinearHead(x.hidden, x.weight, x.targets)
    else:
        policy = lib.Logits(x.logits, x.targets) if form == "logits" else x.lp
    return call(lib, policy, x)


# One call per loss, shared by both policy forms and by every implementation.
_LOSSES = {
    "ggpo": lambda lib, pol, x: lib.ggpo_loss(
        pol, x.ref_lp, x.rewards, x.mask, group_size=x.group_size, beta=BETA,
        validate=x.validate).loss,
    "gppo": lambda lib, pol, x: lib.gppo_loss(
        pol, x.old_lp, x.advantages, x.mask, validate=x.validate).loss,   # chi2 / atomic
    "gr_opd": lambda lib, pol, x: lib.gr_opd_loss(
        pol, x.old_lp, x.teacher_lp, x.mask, group_size=x.group_size, validate=x.validate).loss,
    "ppo": lambda lib, pol, x: lib.ppo_loss(
        pol, x.old_lp, x.advantages, x.mask, clip=PPO_CLIP, agg=PPO_AGG,
        validate=x.validate).loss,
}

# The floors. "bwd" is a backward that starts from the forward's per-token saves (lse);
# "fwd+bwd" is the whole step, which for a token-local loss (GPPO, GR-OPD) is ONE pass, so it is
# less than fwd + bwd: a single-pass implementation does all its work in the forward (its "fwd"
# row costs one read + one write, its "bwd" row almost nothing); read its fwd+bwd row.
_FLOORS = {
    # fwd: read logits once (N*V*elt) + targets, mask; write logp and lse.
    # bwd: read logits once, write dlogits once (2*N*V*elt) + targets, mask, lse, dlogp.
    # fwd+bwd: two reads + one write (the loss's dlogp is known only after the forward).
    "token_logprobs": {"fwd": (1, 0, TGT + MSK + 2 * F32),
                       "bwd": (1, 1, TGT + MSK + 2 * F32),
                       "fwd+bwd": (2, 1, 2 * (TGT + MSK) + 4 * F32)},
    # as token_logprobs, plus the entropy written (fwd) and entropy, dentropy read (bwd).
    "token_logprobs_entropy": {"fwd": (1, 0, TGT + MSK + 3 * F32),
                               "bwd": (1, 1, TGT + MSK + 4 * F32),
                               "fwd+bwd": (2, 1, 2 * (TGT + MSK) + 7 * F32)},
    # [B, T] only: fwd reads lp, ref_lp, mask; bwd reads mask, writes dlp.
    "ggpo": {"fwd": (0, 0, MSK + 2 * F32), "bwd": (0, 0, MSK + F32),
             "fwd+bwd": (0, 0, 2 * MSK + 3 * F32)},
    # [B, T] only: fwd reads lp, old_lp, mask; bwd also writes dlp; token-local: one pass.
    "gppo": {"fwd": (0, 0, MSK + 2 * F32), "bwd": (0, 0, MSK + 3 * F32),
             "fwd+bwd": (0, 0, MSK + 3 * F32)},
    "ppo": {"fwd": (0, 0, MSK + 2 * F32), "bwd": (0, 0, MSK + 3 * F32),
            "fwd+bwd": (0, 0, MSK + 3 * F32)},
    # [B, T] only: the advantage pass reads old_lp, teacher_lp, mask; the loss pass reads lp,
    # old_lp, mask (and writes dlp in bwd / fwd+bwd).
    "gr_opd": {"fwd": (0, 0, 2 * MSK + 4 * F32), "bwd": (0, 0, MSK + 3 * F32),
               "fwd+bwd": (0, 0, 2 * MSK + 5 * F32)},
    # GGPO from logits: every log-prob of a group is needed before any gradient, so
    # fwd: one read (log-prob pass) + targets, mask, ref_lp, lse written;
    # bwd: one read + one write (dlogits) + targets, mask, lse;
    # fwd+bwd: two reads + one write.
    "ggpo_logits": {"fwd": (1, 0, TGT + MSK + 2 * F32), "bwd": (1, 1, TGT + MSK + F32),
                    "fwd+bwd": (2, 1, 2 * (TGT + MSK) + 3 * F32)},
    # GPPO from logits: fwd (loss only) one read + targets, mask, old_lp; bwd from saved lse one
    # read + one write; fwd+bwd ONE read + ONE write (token-local gradient, single pass).
    "gppo_logits": {"fwd": (1, 0, TGT + MSK + F32), "bwd": (1, 1, TGT + MSK + 2 * F32),
                    "fwd+bwd": (1, 1, TGT + MSK + F32)},
    # PPO from logits: GPPO's kernels with the clip's region, the same traffic.
    "ppo_logits": {"fwd": (1, 0, TGT + MSK + F32), "bwd": (1, 1, TGT + MSK + 2 * F32),
                   "fwd+bwd": (1, 1, TGT + MSK + F32)},
    # GR-OPD from logits: as GPPO, plus the [B, T] advantage pass (old_lp, teacher_lp, mask).
    "gr_opd_logits": {"fwd": (1, 0, TGT + 2 * MSK + 3 * F32), "bwd": (1, 1, TGT + MSK + 2 * F32),
                      "fwd+bwd": (1, 1, TGT + 2 * MSK + 3 * F32)},
    # Distillation from two models' logits (the rows of both counted): fwd one read of each +
    # mask, the divergence and entropy written; bwd one read of each + one write of the
    # student's gradient + mask, each model's max and log-sum, the upstream gradient; fwd+bwd
    # of the loss ONE read of each + one write (each position's upstream gradient, its weight
    # in the loss, is known before the kernels: a single pass) + mask, divergence, entropy.
    "distill_logits": {"fwd": (2, 0, MSK + 2 * F32), "bwd": (2, 1, MSK + 5 * F32),
                       "fwd+bwd": (2, 1, MSK + 2 * F32)},
    # The per-token divergence (a trainer's own aggregation after it, verl's agg_loss): its
    # upstream gradient comes after the forward, so fwd+bwd is both, as token_logprobs.
    "token_divergence_logits": {"fwd": (2, 0, MSK + 2 * F32), "bwd": (2, 1, MSK + 5 * F32),
                                "fwd+bwd": (4, 1, 2 * MSK + 7 * F32)},
    # Distillation from a teacher's top-k (the student's rows only): fwd one read + mask, the k
    # ids and log-probs, the student's log-probs at them, its entropy and row statistics; bwd
    # one read + one write + mask, the ids, the upstream gradient at them, the statistics;
    # fwd+bwd both
    "distill_top_k_logits": {
        "fwd": (1, 0, MSK + TOP_K * (TGT + 2 * F32) + 3 * F32),
        "bwd": (1, 1, MSK + TOP_K * (TGT + F32) + 2 * F32),
        "fwd+bwd": (2, 1, 2 * MSK + TOP_K * (2 * TGT + 3 * F32) + 5 * F32)},
}


def _trl_logprobs(entropy: bool):
    """TRL 1.16's Triton log-probs and entropy from logits (``selective_log_softmax_and_entropy``,
    one pass, the entropy always computed): the peer of ``token_logprobs``."""
    def run(_, x):
        from trl.kernels.logprob_entropy import selective_log_softmax_and_entropy

        lp, h = selective_log_softmax_and_entropy(x.logits, x.targets, 1.0, x.mask)
        return (lp, h) if entropy else lp
    return run


def _liger_logprobs(lk, x):
    # Liger's selective log-softmax: forward only (no autograd), over [B, T+1, V] logits.
    return lk.fused_selective_log_softmax(x.logits_full, x.targets, 1.0, x.mask_i32)


def _liger_grpo(advantages: str, eps_high: float = 0.2):
    """Liger's triton GRPO loss (PPO clip [0.8, 1 + eps_high], beta = 0, loss_type "grpo": the
    token mean of each response, then over responses): the peer of the single-pass PPO / GPPO /
    GR-OPD from logits (one read in its forward, one read + one write in its backward)."""
    def run(lk, x):
        # Positional: the first 11 arguments are the same in every Liger release so far.
        out = lk.GrpoLossFunction.apply(x.logits_full, x.old_lp, None, x.targets,
                                        getattr(x, advantages), x.mask_i32, 1.0, 0.0, 0.2,
                                        eps_high, False)
        loss = out[0] if isinstance(out, (tuple, list)) else out
        if loss.dim():   # releases that return per-token losses
            loss = (loss * x.mask).sum() / x.mask.sum()
        return loss
    return run


def _liger_head_grpo(advantages: str, eps_high: float = 0.2):
    """Liger's chunked fused-linear GRPO loss (PPO clip [0.8, 1 + eps_high], beta = 0, loss_type
    "grpo", torch.compile'd chunks): the peer of the LinearHead PPO / GPPO / GR-OPD."""
    loss_fn = {}

    def run(lk, x):
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        fn = loss_fn.setdefault("fn", LigerFusedLinearGRPOLoss(
            beta=0.0, use_ref_model=False, loss_type="grpo", epsilon_low=0.2,
            epsilon_high=eps_high))
        out = fn(x.hidden[:, :-1], x.weight, x.targets, x.mask_i32, getattr(x, advantages),
                 old_per_token_logps=x.old_lp)
        return out[0] if isinstance(out, (tuple, list)) else out

    def vocab_tile():     # its selective log-probs stream each row chunk's logits in tiles
        from liger_kernel.chunked_loss import fused_linear_ppo

        return fused_linear_ppo._SELECTIVE_LOGPROB_VOCAB_CHUNK_SIZE

    run.vocab_tile = vocab_tile
    return run


def _trl_head(loss: str):
    """TRL 1.16's chunked head (``ChunkedLogProbFunction``, as its GRPOTrainer calls it: the
    actor tokens' hidden rows, its trainer's vocabulary chunk, log-probs only), then the loss on
    the ``[B, T]`` log-probs (``rlfuse.reference``, the same math): the peer of the LinearHead
    losses that a TRL user runs today."""
    def run(trl_module, x):
        chunk = getattr(importlib.import_module(TRL_CHUNK_ATTR[0]), TRL_CHUNK_ATTR[1])
        hidden = x.hidden[:, :-1]
        actor = trl_module.ChunkedLogProbFunction.apply(
            hidden[x.mask], x.weight, None, x.targets[x.mask], 1.0, chunk, None, 1.0, ())[0]
        lp = actor.new_zeros(x.mask.shape).masked_scatter(x.mask, actor)
        return _LOSSES[loss](rlfuse.reference, lp, x)
    return run


# LinearHead: every implementation does the training step (fwd+bwd). Its floor: the logits
# once, then dhidden and dweight: 3 matmuls (a chunked GGPO forms each chunk's logits twice, 4).
_HEAD_MATMULS = {"fwd+bwd": 3}
_HEAD_FLOOR = {"fwd+bwd": (0, 0, TGT + MSK + 2 * F32)}   # the [B, T] side data only
# Distillation from two heads: each model's logits once, dhidden and dweight of the student's
_DISTILL_HEAD_MATMULS = {"fwd+bwd": 4}
# A head's log-probs and entropy: the logits (fwd), then dhidden and dweight; the [B, T] side
# data: the targets read, log-probs and entropies written (and their gradients read)
_HEAD_LOGPROBS_MATMULS = {"fwd": 1, "fwd+bwd": 3}
_HEAD_LOGPROBS_FLOOR = {"fwd": (0, 0, TGT + 2 * F32), "fwd+bwd": (0, 0, TGT + 4 * F32)}


def _head_logprobs(batch_invariant: bool, lib, x):
    return lib.policy_logprobs(lib.LinearHead(x.hidden, x.weight, x.targets,
                                              batch_invariant=batch_invariant),
                               return_entropy=True)


def _gppo(lib, policy, x, **kw):
    return lib.gppo_loss(policy, x.old_lp, x.advantages, x.mask, **kw).loss


def _policy(lib, policy, x, objective, **terms_kw):
    """policy_loss with the KL penalty (to the behaviour log-probs: any reference costs the
    same) and the entropy bonus."""
    from rlfuse import objectives, terms

    return lib.policy_loss(policy, x.old_lp, x.advantages, x.mask,
                           getattr(objectives, objective)(), ref_logprobs=x.old_lp,
                           kl=terms.KLPenalty(0.01), entropy=terms.EntropyBonus(0.01),
                           **terms_kw).loss


def _packed(lib, x):
    """A whole output's rows packed (``[B (T + 2), V]``, a view): ``Logits`` with ``index``."""
    B, S, V = x.full_output.shape
    T = x.shape.T
    t = torch.arange(S, device=x.targets.device) - 1           # rows 1 .. T predict the tokens
    inside = (t >= 0) & (t < T)
    batch = torch.arange(B, device=t.device)[:, None]
    index = torch.where(inside, batch * T + t, -1).reshape(-1)
    targets = torch.where(inside, x.targets[batch, t.clamp(0, T - 1)], 0).reshape(-1)
    return lib.Logits(x.full_output.reshape(B * S, V), targets, index=index)


@contextlib.contextmanager
def trl_triton_everywhere():
    """TRL's chunked head takes its Triton kernels on CUDA only (torch tiles elsewhere): within
    this, on any device (the interpreter's CPU tensors, a compile-only drive) too."""
    try:
        from trl.kernels import chunked_logprob
    except ImportError:
        yield
        return
    gate = chunked_logprob._use_triton
    chunked_logprob._use_triton = lambda device: True
    try:
        yield
    finally:
        chunked_logprob._use_triton = gate


def _variants():
    """What a trainer does beyond the benchmark's calls, with GPPO's single pass (PPO's is the
    same kernel): a whole model output with offset, loss_scale, an upstream gradient that is
    not 1, the gradient written into the logits' own buffer, a chunked LinearHead, the
    batch-invariant head (its fixed-order matmul in place of cuBLAS). Each is held to the floor
    of the op it varies."""
    logits, head = OPS["gppo_logits"], OPS["gppo_head"]
    step = ("fwd+bwd",)

    def variant(op, **fields):
        return dataclasses.replace(op, liger=None, trl=None, **fields)

    return {v.name: v for v in (
        variant(logits, name="gppo_logits, full output + offset",
                run=lambda lib, x: _gppo(lib, lib.Logits(x.full_output, x.targets, offset=1), x),
                leaves=lambda x: x.full_output, window=lambda x: (x.shape.T + 2, 1)),
        variant(logits, name="gppo_logits, loss_scale=1/8", fused_modes=step, modes=step,
                run=lambda lib, x: _gppo(lib, lib.Logits(x.logits, x.targets), x,
                                         loss_scale=0.125)),
        variant(logits, name="gppo_logits, upstream gradient 1/8", fused_modes=step,
                modes=step,
                run=lambda lib, x: _gppo(lib, lib.Logits(x.logits, x.targets), x) * 0.125),
        variant(logits, name="gppo_logits, inplace_backward", fused_modes=step, modes=step,
                run=lambda lib, x: _gppo(lib, lib.Logits(x.logits, x.targets,
                                                         inplace_backward=True), x)),
        variant(head, name="gppo_head, batch_invariant",
                run=lambda lib, x: _gppo(lib, lib.LinearHead(x.hidden, x.weight, x.targets,
                                                             batch_invariant=True), x)),
        variant(head, name="gppo_head, chunk_tokens=5",
                run=lambda lib, x: _gppo(lib, lib.LinearHead(x.hidden, x.weight, x.targets,
                                                             chunk_tokens=5), x)),
        variant(logits, name="gppo_logits, packed rows", fused_modes=step, modes=step,
                run=lambda lib, x: _gppo(lib, _packed(lib, x), x),
                leaves=lambda x: x.full_output, window=lambda x: (x.shape.T + 2, 1)),
        variant(logits, name="policy_logits, packed rows, CISPO + KL + entropy",
                fused_modes=step, modes=step,
                run=lambda lib, x: _policy(lib, _packed(lib, x), x, "CISPO"),
                leaves=lambda x: x.full_output, window=lambda x: (x.shape.T + 2, 1)),
        # token-local objectives with the KL and entropy terms: the same single pass
        *(variant(logits, name=f"policy_logits, {objective} + KL + entropy",
                  run=lambda lib, x, o=objective: _policy(lib, lib.Logits(x.logits, x.targets),
                                                          x, o))
          for objective in ("Clip", "CISPO", "SAPOTRL", "DPPOKL")),
        variant(head, name="policy_head, CISPO + KL + entropy",
                run=lambda lib, x: _policy(lib, lib.LinearHead(x.hidden, x.weight, x.targets),
                                           x, "CISPO")),
        # a sequence-level objective: the log-prob pass, the loss on [B, T], the backward
        variant(logits, name="policy_logits, VESPO (two passes) + KL + entropy",
                fused_modes=step, modes=step, floor=OPS["ggpo_logits"].floor,
                run=lambda lib, x: _policy(lib, lib.Logits(x.logits, x.targets), x, "VESPO")),
    )}


def _ops():
    ops = [Op("token_logprobs", True,
              lambda lib, x: lib.token_logprobs(x.logits, x.targets, mask=x.mask),
              _FLOORS["token_logprobs"], liger=_liger_logprobs, liger_modes=("fwd",),
              trl=_trl_logprobs(False)),
           Op("token_logprobs_entropy", True,
              lambda lib, x: lib.token_logprobs(x.logits, x.targets, mask=x.mask,
                                                return_entropy=True),
              _FLOORS["token_logprobs_entropy"], trl=_trl_logprobs(True))]
    liger = {"gppo": _liger_grpo("advantages"), "gr_opd": _liger_grpo("opd_advantages"),
             "ppo": _liger_grpo("advantages", PPO_CLIP[1])}
    liger_head = {"gppo": _liger_head_grpo("advantages"),
                  "gr_opd": _liger_head_grpo("opd_advantages"),
                  "ppo": _liger_head_grpo("advantages", PPO_CLIP[1])}
    for form in ("logprobs", "logits"):
        for loss, call in _LOSSES.items():
            name = loss + ("_logits" if form == "logits" else "")
            single_pass = form == "logits" and loss in liger
            ops.append(Op(name, form == "logits", functools.partial(_run_loss, call, form),
                          _FLOORS[name],
                          liger=liger.get(loss) if form == "logits" else None,
                          fused_modes=("fwd", "fwd+bwd") if single_pass else MODES))
    for loss, call in _LOSSES.items():
        step = ("fwd+bwd",)
        ops.append(Op(loss + "_head", True, functools.partial(_run_loss, call, "head"),
                      _HEAD_FLOOR, liger=liger_head.get(loss), liger_modes=step,
                      trl=_trl_head(loss),
                      fused_modes=step, modes=step, matmuls=_HEAD_MATMULS))
    # a head's log-probs (the old-log-prob pass): the default head (chunks of cuBLAS logits)
    # and the batch-invariant one, whose forward forms its tiles on the chip
    for name, invariant in (("logprobs_head", False), ("logprobs_head_invariant", True)):
        ops.append(Op(name, True, functools.partial(_head_logprobs, invariant),
                      _HEAD_LOGPROBS_FLOOR, fused_modes=("fwd", "fwd+bwd"),
                      modes=("fwd", "fwd+bwd"), matmuls=_HEAD_LOGPROBS_MATMULS))
    # distillation (JSD, TRL's default): both models' rows; the loss a single pass, the
    # per-token divergence two (fwd reads each row twice, bwd once)
    ops.append(Op("distill_logits", True, distill_cases.run_logits, _FLOORS["distill_logits"],
                  fused_modes=("fwd", "fwd+bwd")))
    ops.append(Op("token_divergence_logits", True, distill_cases.run_token_divergence,
                  _FLOORS["token_divergence_logits"]))
    ops.append(Op("distill_head", True, distill_cases.run_head, _HEAD_FLOOR,
                  liger=distill_cases.liger_head, liger_modes=("fwd+bwd",),
                  trl=distill_cases.trl_head, fused_modes=("fwd+bwd",), modes=("fwd+bwd",),
                  matmuls=_DISTILL_HEAD_MATMULS))
    ops.append(Op("distill_head_invariant", True,
                  functools.partial(distill_cases.run_head, batch_invariant=True), _HEAD_FLOOR,
                  fused_modes=("fwd+bwd",), modes=("fwd+bwd",), matmuls=_DISTILL_HEAD_MATMULS))
    # verl's top-k forward KL: the student's log-probs at a teacher's top-k ids
    ops.append(Op("distill_top_k_logits", True, distill_cases.run_top_k_logits,
                  _FLOORS["distill_top_k_logits"]))
    ops.append(Op("distill_top_k_head", True, distill_cases.run_top_k_head, _HEAD_FLOOR,
                  fused_modes=("fwd+bwd",), modes=("fwd+bwd",), matmuls=_HEAD_MATMULS))
    return {op.name: op for op in ops}


OPS = _ops()
VARIANTS = _variants()
# The headline (``python -m bench --headline``, the GPU check's cases): its shape, ops, modes.
HEADLINE = Shape(DEFAULT_N[0], DEFAULT_V[0], torch.bfloat16, BATCH, GROUP_SIZE, HIDDEN)
HEADLINE_OPS = headline_ops()
HEADLINE_MODES = ("fwd", "fwd+bwd")


# --------------------------------------------------------------------------------------------
# Implementations
# --------------------------------------------------------------------------------------------

class CompiledReference:
    """``rlfuse.reference`` with each function wrapped once in ``torch.compile`` (a new shape
    recompiles it: ``dynamic=False``, the fastest code per shape)."""

    Logits = rlfuse.Logits

    def __init__(self):
        self._fns = {}

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._fns:
            self._fns[name] = torch.compile(getattr(rlfuse.reference, name), dynamic=False)
        return self._fns[name]


def load_impl(name: str):
    """The library object of an implementation; raises for a missing or broken optional peer
    (whatever its import raises)."""
    if name == "fused":
        return rlfuse
    if name == "reference":
        return rlfuse.reference
    if name == "compiled":
        return CompiledReference()
    if name == "liger":
        return importlib.import_module(LIGER_MODULE)
    if name == "trl":      # its kernels alone where TRL's dependencies are missing
        from . import trl_kernels

        return trl_kernels.load(TRL_MODULE)
    raise ValueError(f"--impls: expected some of {', '.join(IMPLS)}, got {name!r}")


def modes_for(op: Op, impl: str) -> Tuple[str, ...]:
    return {"liger": op.liger_modes, "fused": op.fused_modes,
            "trl": ("fwd+bwd",)}.get(impl, op.modes)


def forward_fn(op: Op, impl: str, lib, x) -> Optional[Callable]:
    """``forward() -> (outputs tuple, leaves)`` of ``impl`` on ``op``; None when ``impl`` has no
    such op (Liger has no GGPO and no entropy; TRL's kernels serve the LinearHead ops, the
    log-probs and distillation). The leaves: the logits (Liger: its ``[B, T+1, V]`` logits),
    the log-probs, or a LinearHead's hidden states and weight."""
    if op.leaves is not None:
        leaves = op.leaves(x)
    elif op.matmuls is not None:
        leaves = (x.hidden, x.weight)
    elif impl == "liger":
        leaves = x.logits_full
    else:
        leaves = x.logits if op.from_logits else x.lp
    if impl in ("liger", "trl"):
        adapter = getattr(op, impl)
        if adapter is None:
            return None
        run = lambda: adapter(lib, x)  # noqa: E731
    else:
        run = lambda: op.run(lib, x)  # noqa: E731
    return lambda: (as_tuple(run()), leaves)


def vocab_tile(op: Op, impl: str) -> int:
    """The width of the vocabulary tiles in which a peer ``impl`` forms ``op``'s logits where
    they are narrower than the vocabulary (its adapter's ``vocab_tile``); 0: whole rows."""
    adapter = getattr(op, impl, None) if impl in ("liger", "trl") else None
    tile = getattr(adapter, "vocab_tile", None)
    return tile() if tile is not None else 0


def as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)
