"""The distillation cases of the benchmark (``cases.OPS``: ``distill_logits``,
``token_divergence_logits``, ``distill_head``, ``distill_top_k_logits``,
``distill_top_k_head``): TRL's default divergence, ``JSD(0.5)``, between the policy and a
teacher of the same vocabulary, from logits (the loss, and the per-token divergence a trainer
aggregates itself) and from both models' heads, with the peers a TRL user runs today for the
heads: TRL 1.16's ``ChunkedDivergenceFunction`` (its DistillationTrainer's loss) and Liger's
``LigerFusedLinearJSDLoss``; and verl's top-k forward KL (``forward_kl_topk`` with its
default ``log_prob_min_clamp``) from a teacher server's top-k (verl's own, from the logits, is
not a peer here)."""
from __future__ import annotations

import torch

from rlfuse.divergences import JSD, ForwardKL

BETA = 0.5            # TRL's DistillationConfig default
TOP_K = 64            # a teacher server's top-k
MIN_LOGPROB = -10.0   # verl's DistillationLossConfig.log_prob_min_clamp default
TRL_DIVERGENCE_MODULE = "trl.kernels.chunked_divergence"


@torch.no_grad()
def add_teacher(x, shape, device, seed: int) -> None:
    """A teacher beside ``make_inputs``' policy, from its own random stream (the policy's inputs
    stay as they were): ``teacher_logits [B, T, V]`` (``randn * 2``), and a head,
    ``teacher_hidden [B, T+1, H]`` and ``teacher_weight [V, H]`` (H the policy's: a width no
    rows of logits share)."""
    g = torch.Generator(device=device).manual_seed(seed + 1)
    B, T, V, H = shape.batch, shape.T, shape.V, shape.hidden

    def randn(*size):
        return torch.randn(*size, generator=g, device=device, dtype=shape.dtype)

    x.teacher_logits = randn(B, T, V).mul_(2.0)
    x.teacher_hidden = randn(B, T + 1, H)
    x.teacher_weight = randn(V, H).mul_(2.0 / H ** 0.5)
    x.teacher_ids = torch.randint(0, V, (B, T, TOP_K), generator=g, device=device)
    x.teacher_top_logprobs = torch.log_softmax(
        torch.randn(B, T, TOP_K, generator=g, device=device).mul_(2.0), -1)


def run_logits(lib, x):
    return lib.distill_loss(lib.Logits(x.logits, x.targets),
                            lib.Logits(x.teacher_logits, x.targets), x.mask, JSD(BETA),
                            validate=x.validate).loss


def run_token_divergence(lib, x):
    return lib.token_divergence(lib.Logits(x.logits, x.targets),
                                lib.Logits(x.teacher_logits, x.targets), JSD(BETA), x.mask,
                                validate=x.validate)


def run_head(lib, x, batch_invariant=False):
    """``batch_invariant``: both heads' tiles formed on the chip
    (``kernels.tiles.distill_tiles``)."""
    student = lib.LinearHead(x.hidden, x.weight, x.targets, batch_invariant=batch_invariant)
    teacher = lib.LinearHead(x.teacher_hidden, x.teacher_weight, x.targets,
                             batch_invariant=batch_invariant)
    return lib.distill_loss(student, teacher, x.mask, JSD(BETA), validate=x.validate).loss


def run_top_k_logits(lib, x):
    return lib.distill_loss(lib.Logits(x.logits, x.targets),
                            lib.TopK(x.teacher_ids, x.teacher_top_logprobs), x.mask,
                            ForwardKL(MIN_LOGPROB), validate=x.validate).loss


def run_top_k_head(lib, x):
    return lib.distill_loss(lib.LinearHead(x.hidden, x.weight, x.targets),
                            lib.TopK(x.teacher_ids, x.teacher_top_logprobs), x.mask,
                            ForwardKL(MIN_LOGPROB), validate=x.validate).loss


def trl_head(_module, x):
    """TRL's ``ChunkedDivergenceFunction`` over the actor positions, as its trainer calls it."""
    import importlib

    chunked = importlib.import_module(TRL_DIVERGENCE_MODULE).ChunkedDivergenceFunction
    student, teacher = x.hidden[:, :-1][x.mask], x.teacher_hidden[:, :-1][x.mask]
    divergence, _ = chunked.apply(student, x.weight, None, teacher, x.teacher_weight, None,
                                  BETA, 1.0)
    return divergence.sum() / x.mask.sum()


def liger_head(_module, x):
    """Liger's fused-linear JSD (the soft loss alone) over the actor positions."""
    from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

    loss = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=BETA)
    student, teacher = x.hidden[:, :-1][x.mask], x.teacher_hidden[:, :-1][x.mask]
    return loss(student, x.weight, teacher, x.teacher_weight, x.targets[x.mask])
