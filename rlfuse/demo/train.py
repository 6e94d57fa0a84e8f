"""The training loop shared by the methods, and the evaluation."""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Dict, List, Optional

import torch

import rlfuse
from rlfuse import use_kernels
from rlfuse.scaleout.vocab import SumGradOverGroup

from .methods import METHODS
from .model import (build_policy, frozen_copy, last_hidden_and_head, load_weights,
                    next_token_logits)
from .rollout import collect, sample, verify
from .text import prompt_windows


@dataclasses.dataclass
class Settings:
    steps: int = 32                 # optimizer steps per method
    group_size: int = 4             # responses per prompt
    prompts_per_step: int = 4       # prompts (groups) per optimizer step
    max_new_tokens: int = 4
    prompt_len: int = 12            # bytes
    lr: float = 1.5e-2              # Adam on the LoRA parameters
    lora_rank: int = 8
    updates_per_rollout: int = 2    # PPO minibatches: each rollout is split into this many
                                    # optimizer steps; the behavior (the old policy) is refreshed
                                    # from the learner before the next rollout
    max_resamples: int = 4          # mixed-reward filtering: resamples per prompt
    beta: float = 0.1               # GGPO: KL weight
    ref_refresh_every: int = 3      # GGPO: optimizer steps between reference refreshes
    teacher_steps: int = 20         # GR-OPD: supervised steps that make the teacher
    teacher_lr: float = 2e-2
    divergence: str = "jsd"         # distill: forward_kl, reverse_kl or jsd (JSD(0.5))
    eval_samples: int = 16          # sampled responses per evaluation prompt
    policy: str = "linear"          # the learner as rlfuse.LinearHead (hidden states + lm_head,
                                    # no [B, L, V] logits) or as rlfuse.Logits (the whole output)


@dataclasses.dataclass
class RunResult:
    method: str
    impl: str
    path: str                       # which implementation ran the losses
    reward_before: float
    reward_after: float
    seconds: float
    history: List[Dict]             # one dict per optimizer step
    divergence_before: Optional[float] = None   # distill: the mean divergence on eval samples
    divergence_after: Optional[float] = None


def resolve_device(device: Optional[str] = None) -> torch.device:
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def active_path(impl: str, device: torch.device) -> str:
    if impl == "reference":
        return "rlfuse.reference (plain torch, autograd)"
    if use_kernels(device):
        if device.type == "cuda":
            return "fused Triton kernels on CUDA"
        return "fused Triton kernels through the Triton interpreter (TRITON_INTERPRET=1)"
    return ("rlfuse.reference: the fused API falls back to it on CPU unless TRITON_INTERPRET=1 "
            "is set before Python starts")


def vocab_shard(x: torch.Tensor, group, dim: int, pad_value: float) -> torch.Tensor:
    """This rank's slice of the vocabulary dimension ``dim`` of ``x`` (all of it without a
    group): Megatron's split, rank r holding the ids ``[r V_l, (r + 1) V_l)``, the vocabulary
    padded with ``pad_value`` to a multiple of the group size first (as Megatron pads it)."""
    if group is None:
        return x
    import torch.distributed as dist

    world = dist.get_world_size(group)
    pad = -x.shape[dim] % world
    if pad:
        shape = list(x.shape)
        shape[dim] = pad
        x = torch.cat([x, x.new_full(shape, pad_value)], dim)
    width = x.shape[dim] // world
    return x.narrow(dim, dist.get_rank(group) * width, width)


def learner(lib, policy, batch, form: str, vocab_parallel_group=None):
    """The learner over a batch, as a ``LinearHead`` or ``Logits`` of ``lib`` (rlfuse or its
    reference). Position t predicts token t + 1: the rows from ``prompt_len - 1`` on predict the
    response, so the whole output goes in with that offset (no slice, no slice gradient buffer).
    With a ``vocab_parallel_group`` each rank passes its shard of the head (or of the logits)."""
    group = vocab_parallel_group
    if form == "linear":
        hidden, weight = last_hidden_and_head(policy, batch.sequences)
        # the padding ids: zero weight rows and a bias of -inf, so they take no probability
        bias = None if group is None else \
            vocab_shard(weight.new_zeros(weight.shape[0]), group, 0, float("-inf"))
        return lib.LinearHead(hidden, vocab_shard(weight, group, 0, 0.0), batch.responses, bias,
                              offset=batch.prompt_len - 1, vocab_parallel_group=group)
    if form == "logits":
        logits = next_token_logits(policy, batch.sequences)
        if group is not None:   # each rank's shard gradient reaches the replicated model: summed
            logits = SumGradOverGroup.apply(logits, group)
        return lib.Logits(vocab_shard(logits, group, -1, float("-inf")), batch.responses,
                          offset=batch.prompt_len - 1, vocab_parallel_group=group)
    raise ValueError(f"policy: expected 'linear' or 'logits', got {form!r}")


@torch.no_grad()
def evaluate(model, prompts: torch.Tensor, settings: Settings, seed: int) -> float:
    """Mean verifier reward of sampled responses on fixed prompts, from a fixed random stream
    (the same draws before and after training)."""
    generator = torch.Generator(prompts.device).manual_seed(seed + 1)
    sequences, mask = sample(model, prompts.repeat_interleave(settings.eval_samples, 0),
                             settings.max_new_tokens, generator)
    return verify(sequences[:, prompts.shape[1]:], mask).mean().item()


def run(method: str, *, impl: str = "fused", device: Optional[str] = None, seed: int = 0,
        on_step: Optional[Callable[[Dict], None]] = None, vocab_parallel_group=None,
        **settings) -> RunResult:
    """Train a fresh tiny LoRA policy with one method; ``settings`` override :class:`Settings`.

    ``impl="fused"`` calls ``rlfuse.*``, ``impl="reference"`` the same functions of
    ``rlfuse.reference``; from the same seed both sample the same tokens. ``on_step`` receives
    each step's record as it is made. ``vocab_parallel_group``: the losses see each rank's
    shard of the head over this ``torch.distributed`` group (every rank of it runs the same
    seed, so all hold the same replicated model and rollouts).
    """
    if impl not in ("fused", "reference"):
        raise ValueError(f"impl: expected 'fused' or 'reference', got {impl!r}")
    lib = rlfuse if impl == "fused" else rlfuse.reference
    settings = Settings(**settings)
    device = resolve_device(device)
    start = time.perf_counter()

    policy = build_policy(seed, device, lora_rank=settings.lora_rank)
    generator = torch.Generator(device).manual_seed(seed)
    train_prompts = prompt_windows(settings.prompt_len, split="train").to(device)
    eval_prompts = prompt_windows(settings.prompt_len, split="eval").to(device)
    algo = METHODS[method](policy, settings, train_prompts, generator)
    behavior = frozen_copy(policy)
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad],
                                 lr=settings.lr)
    reward_before = evaluate(policy, eval_prompts, settings, seed)
    measured_before = algo.measure(lib, policy, eval_prompts, seed)

    history = []
    for step in range(1, settings.steps + 1):
        tic = time.perf_counter()
        if (step - 1) % settings.updates_per_rollout == 0:
            load_weights(behavior, policy)
            rows = torch.randint(len(train_prompts),
                                 (settings.prompts_per_step * settings.updates_per_rollout,),
                                 generator=generator, device=device)
            rollout, stats = collect(behavior, train_prompts[rows], group_size=settings.group_size,
                                     max_new_tokens=settings.max_new_tokens, generator=generator,
                                     mixed_only=algo.mixed_only,
                                     max_resamples=settings.max_resamples)
            minibatches = [None] * settings.updates_per_rollout
            if rollout is not None:
                algo.prepare(lib, rollout)      # once per rollout, on all its groups
                minibatches = rollout.minibatches(settings.updates_per_rollout,
                                                  settings.group_size)
        batch = minibatches[(step - 1) % settings.updates_per_rollout]
        record = {"step": step, **stats, "groups": 0, "loss": None, "metrics": {}, "tokens": 0}
        if batch is not None:           # else: no mixed group left for this step
            out = algo.loss(lib, learner(lib, policy, batch, settings.policy,
                                         vocab_parallel_group), batch)
            optimizer.zero_grad()
            out.loss.backward()
            optimizer.step()
            record.update(loss=out.loss.item(), tokens=int(batch.mask.sum()),
                          groups=len(batch.rewards) // settings.group_size,
                          metrics={k: v.item() for k, v in out.metrics.items()})
        algo.after_step(step, policy)
        record["seconds"] = time.perf_counter() - tic
        history.append(record)
        if on_step is not None:
            on_step(record)

    reward_after = evaluate(policy, eval_prompts, settings, seed)
    return RunResult(method, impl, active_path(impl, device), reward_before, reward_after,
                     time.perf_counter() - start, history, measured_before,
                     algo.measure(lib, policy, eval_prompts, seed))
