"""The methods: GGPO, GPPO, GR-OPD and distillation. Each adds what its loss needs to a rollout
(``prepare``) and makes exactly one rlfuse loss call per optimizer step (``loss``); the training
loop is shared (train.py).

``lib`` is ``rlfuse`` (fused) or ``rlfuse.reference``: the same functions with the same
signatures. ``policy`` is the learner as ``rlfuse.Logits`` over the response positions.
"""
from __future__ import annotations

import copy

import torch

from rlfuse.divergences import JSD, ForwardKL, ReverseKL

from .model import (VOCAB_SIZE, build_policy, frozen_copy, last_hidden_and_head, load_weights,
                    next_token_logits)
from .rollout import Batch, good_byte, response_logprobs, sample


class Method:
    name = ""
    mixed_only = True       # train only on groups whose rewards differ

    def __init__(self, policy, settings, prompts: torch.Tensor, generator: torch.Generator):
        self.settings = settings

    def prepare(self, lib, batch: Batch) -> None:
        """Once per rollout: detached per-method inputs, stored in ``batch.extra``."""

    def loss(self, lib, policy, batch: Batch):
        raise NotImplementedError

    def after_step(self, step: int, policy) -> None:
        """After optimizer step ``step`` (counted from 1)."""

    def measure(self, lib, policy, prompts: torch.Tensor, seed: int):
        """What the method reports before and after training besides the reward (None)."""
        return None


class GGPO(Method):
    """Stable Gibbs gap of KL-adjusted rewards against a reference policy. No behavior
    log-probs and no importance ratio enter the loss."""

    name = "ggpo"

    def __init__(self, policy, settings, prompts, generator):
        super().__init__(policy, settings, prompts, generator)
        self.reference = frozen_copy(policy)

    def loss(self, lib, policy, batch):
        # The reference may have been refreshed since the rollout: score the batch now.
        ref = response_logprobs(self.reference, batch.sequences, batch.prompt_len, batch.mask)
        return lib.ggpo_loss(policy, ref, batch.rewards, batch.mask,
                             group_size=self.settings.group_size, beta=self.settings.beta)

    def after_step(self, step, policy):
        # GGPO moves its target by refreshing the REFERENCE from the learner every K optimizer
        # steps; this never touches the behavior copy, which keeps the collection it sampled.
        if step % self.settings.ref_refresh_every == 0:
            load_weights(self.reference, policy)


class GPPO(Method):
    """PPO-style clipped surrogate over the chi2 / atomic trust region (the seed default),
    with GRPO group advantages; the behavior copy is the old policy."""

    name = "gppo"

    def prepare(self, lib, batch):
        batch.extra["advantages"] = lib.group_advantages(batch.rewards,
                                                         group_size=self.settings.group_size)

    def loss(self, lib, policy, batch):
        return lib.gppo_loss(policy, batch.old_logprobs, batch.extra["advantages"], batch.mask,
                             geometry="chi2", topology="atomic", delta=0.04)


class GROPD(Method):
    """On-policy distillation: a frozen teacher replayed on the student's own samples gives a
    group-relative credit per response; the verifier's reward is only reported, never trained on."""

    name = "gr_opd"
    mixed_only = False

    def __init__(self, policy, settings, prompts, generator):
        super().__init__(policy, settings, prompts, generator)
        self.teacher = train_teacher(policy, settings, prompts, generator)

    def prepare(self, lib, batch):
        teacher = response_logprobs(self.teacher, batch.sequences, batch.prompt_len, batch.mask)
        batch.extra["teacher_logprobs"] = teacher
        batch.extra["advantages"] = lib.gr_opd_advantages(
            batch.old_logprobs, teacher, batch.mask, group_size=self.settings.group_size)

    def loss(self, lib, policy, batch):
        return lib.gr_opd_loss(policy, batch.old_logprobs, batch.extra["teacher_logprobs"],
                               batch.mask, group_size=self.settings.group_size,
                               advantages=batch.extra["advantages"])


DIVERGENCES = {"forward_kl": ForwardKL(), "reverse_kl": ReverseKL(), "jsd": JSD(0.5)}


class Distill(Method):
    """On-policy distillation of a whole distribution: a teacher, its own tiny Llama built from
    the config and trained to prefer the rewarded bytes, then frozen; the student trained on
    the divergence (``settings.divergence``) between its next-byte distribution and the
    teacher's at the positions it sampled (both as ``LinearHead``: no ``[B, L, V]`` logits of
    either). The verifier's reward is only reported."""

    name = "distill"
    mixed_only = False

    def __init__(self, policy, settings, prompts, generator):
        super().__init__(policy, settings, prompts, generator)
        self.divergence = DIVERGENCES[settings.divergence]
        own = build_policy(generator.initial_seed() + 1, prompts.device,
                           lora_rank=settings.lora_rank)
        self.teacher = train_teacher(own, settings, prompts, generator)

    def _teacher(self, lib, sequences, targets, offset):
        with torch.no_grad():
            hidden, weight = last_hidden_and_head(self.teacher, sequences)
        return lib.LinearHead(hidden, weight, targets, offset=offset)

    def loss(self, lib, policy, batch):
        teacher = self._teacher(lib, batch.sequences, batch.responses, batch.prompt_len - 1)
        return lib.distill_loss(policy, teacher, batch.mask, self.divergence)

    @torch.no_grad()
    def measure(self, lib, policy, prompts, seed):
        """The mean divergence over the student's own samples on ``prompts`` (a fixed stream of
        draws, a quarter of the reward's), what training lowers."""
        generator = torch.Generator(prompts.device).manual_seed(seed + 2)
        samples = max(1, self.settings.eval_samples // 4)
        sequences, mask = sample(policy, prompts.repeat_interleave(samples, 0),
                                 self.settings.max_new_tokens, generator)
        P = prompts.shape[1]
        hidden, weight = last_hidden_and_head(policy, sequences)
        student = lib.LinearHead(hidden, weight, sequences[:, P:], offset=P - 1)
        teacher = self._teacher(lib, sequences, sequences[:, P:], P - 1)
        return lib.distill_loss(student, teacher, mask, self.divergence).loss.item()


def train_teacher(policy, settings, prompts: torch.Tensor, generator: torch.Generator):
    """A teacher that prefers the rewarded behavior: a copy of the initial policy trained for a
    few supervised steps to put its next byte among the task's bytes at every position of the
    text windows (``-log P(good next byte)``), then frozen."""
    teacher = copy.deepcopy(policy)
    good = good_byte(torch.arange(VOCAB_SIZE, device=prompts.device))
    optimizer = torch.optim.Adam([p for p in teacher.parameters() if p.requires_grad],
                                 lr=settings.teacher_lr)
    for _ in range(settings.teacher_steps):
        rows = torch.randint(len(prompts), (16,), generator=generator, device=prompts.device)
        logp = torch.log_softmax(next_token_logits(teacher, prompts[rows]).float(), -1)
        loss = -torch.logsumexp(logp[..., good], -1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return frozen_copy(teacher)


METHODS = {cls.name: cls for cls in (GGPO, GPPO, GROPD, Distill)}
