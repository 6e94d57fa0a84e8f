"""Rollouts: groups of responses sampled from a frozen behavior policy, a rule verifier, and
mixed-reward filtering with bounded resampling."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict

import torch

from .model import EOS, next_token_logits


@dataclass
class Batch:
    """Groups of ``group_size`` consecutive rows sharing a prompt. All prompts have the same
    length, so ``sequences[:, :prompt_len]`` is the prompt and the rest the response."""

    sequences: torch.Tensor        # [B, P + R] token ids
    mask: torch.Tensor             # [B, R] bool: tokens the behavior generated (up to its EOS)
    rewards: torch.Tensor          # [B] fp32, from the verifier
    old_logprobs: torch.Tensor     # [B, R] behavior log-probs of its own tokens
    prompt_len: int
    extra: Dict[str, torch.Tensor] = field(default_factory=dict)  # per-method rollout data

    @property
    def responses(self) -> torch.Tensor:
        return self.sequences[:, self.prompt_len:]

    def select(self, rows: torch.Tensor) -> "Batch":
        return Batch(self.sequences[rows], self.mask[rows], self.rewards[rows],
                     self.old_logprobs[rows], self.prompt_len,
                     {k: v[rows] for k, v in self.extra.items()})

    def minibatches(self, count: int, group_size: int):
        """Split into ``count`` minibatches of whole groups (``None`` where none is left)."""
        groups = torch.arange(len(self.rewards), device=self.rewards.device).view(-1, group_size)
        return [self.select(part.reshape(-1)) if len(part) else None
                for part in torch.tensor_split(groups, count)]


def good_byte(tokens: torch.Tensor) -> torch.Tensor:
    """The byte the task asks for: an even byte value (EOS is not a byte)."""
    return (tokens % 2 == 0) & (tokens != EOS)


def verify(responses: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Binary rule verifier: reward 1 when more than half of the response's bytes are even."""
    hits = (good_byte(responses) & mask).sum(1)
    return (2 * hits > mask.sum(1)).float()


@torch.no_grad()
def sample(model, prompts: torch.Tensor, max_new_tokens: int, generator: torch.Generator):
    """Sample one response per prompt row at temperature 1. Returns ``(sequences, mask)``;
    positions after a row's EOS are EOS padding, masked out."""
    sequences, done, mask = prompts, torch.zeros_like(prompts[:, 0], dtype=torch.bool), []
    for _ in range(max_new_tokens):
        probs = torch.softmax(next_token_logits(model, sequences)[:, -1].float(), -1)
        token = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        mask.append(~done)
        token = torch.where(done, EOS, token)
        done = done | (token == EOS)
        sequences = torch.cat([sequences, token[:, None]], 1)
    return sequences, torch.stack(mask, 1)


@torch.no_grad()
def response_logprobs(model, sequences: torch.Tensor, prompt_len: int,
                      mask: torch.Tensor) -> torch.Tensor:
    """Detached ``[B, R]`` log-probs of the response tokens under a frozen model (no gradient is
    needed, so plain torch is enough); 0 off the mask."""
    logits = next_token_logits(model, sequences)[:, prompt_len - 1:-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, sequences[:, prompt_len:, None]).squeeze(-1)
    return torch.where(mask, logp, 0.0)


def collect(behavior, prompts: torch.Tensor, *, group_size: int, max_new_tokens: int,
            generator: torch.Generator, mixed_only: bool, max_resamples: int = 4):
    """Sample a group of ``group_size`` responses per prompt from ``behavior``.

    With ``mixed_only`` a group whose rewards are all equal carries no learning signal for a
    group-relative loss: its prompt is resampled, at most ``max_resamples`` times, and dropped
    if it never gives a mixed group. Returns ``(batch or None, stats)``; ``stats["reward"]`` is
    the mean reward of the first draw (the behavior's reward, before any filtering).
    """
    prompt_len, kept, stats = prompts.shape[1], [], {"resampled": 0}
    for attempt in range(max_resamples + 1):
        if attempt:
            stats["resampled"] += len(prompts)
        sequences, mask = sample(behavior, prompts.repeat_interleave(group_size, 0),
                                 max_new_tokens, generator)
        rewards = verify(sequences[:, prompt_len:], mask)
        if attempt == 0:
            stats["reward"] = rewards.mean().item()
        grouped = rewards.view(-1, group_size)
        mixed = grouped.amax(1) > grouped.amin(1)
        if not mixed_only:
            mixed = torch.ones_like(mixed)
        rows = mixed.repeat_interleave(group_size)
        kept.append((sequences[rows], mask[rows], rewards[rows]))
        prompts = prompts[~mixed]
        if len(prompts) == 0:
            break
    sequences, mask, rewards = (torch.cat(parts) for parts in zip(*kept))
    if len(rewards) == 0:
        return None, stats
    old = response_logprobs(behavior, sequences, prompt_len, mask)
    return Batch(sequences, mask, rewards, old, prompt_len), stats
