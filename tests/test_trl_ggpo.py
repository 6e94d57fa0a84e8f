"""GGPO in TRL as the paper trains it (the real package): with TRL's defaults and nothing but
``rlfuse_loss="ggpo"``, the optimizer step's gradient is ``ggpo_loss`` over the step's
whole minibatch in one call (the paper's normaliser, whatever ``loss_type``; the groups whose
rewards all agree left out), and the reference is refreshed by a copy of the policy."""
import os
import subprocess
import sys

import pytest
import torch

from conftest import TOL, assert_three_way, integration, process_env  # noqa: E402

trl = integration("trl")
integration("rlfuse.integrations.trl")      # TRL's trainers, with all they import
import rlfuse  # noqa: E402
import rlfuse.reference  # noqa: E402
from rlfuse.integrations.trl.grpo_config import GGPO_BETA as BETA  # noqa: E402
from rlfuse.integrations.trl.ggpo import STEP_TOKENS  # noqa: E402
from rlfuse.integrations.trl import RLFuseGRPOConfig, RLFuseGRPOTrainer  # noqa: E402
from test_trl import config, dataset, eos_model, tokenizer  # noqa: E402



def prompt_reward(prompts, completions, **kwargs):
    """1 for every completion of a prompt whose first word's index is even (a group whose
    rewards all agree); else a tenth of the sum of the completion's word indices (a group
    whose rewards differ, but for two completions of equal sums)."""
    def one(prompt, completion):
        if int(prompt.split()[0][1:]) % 2 == 0:
            return 1.0
        return 0.1 * sum(int(w[1:]) for w in completion.split() if w.startswith("w"))

    return [one(p, c) for p, c in zip(prompts, completions)]


def odd_prompts():
    """The test prompts whose groups' rewards differ, as a dataset."""
    data = dataset(16)
    return data.select([i for i, row in enumerate(data)
                        if int(row["prompt"].split()[0][1:]) % 2])


def ggpo_config(tmp_path, **kw):
    """TRL's defaults, the test's sizes and ``kw``: β unset unless in ``kw``."""
    args = {k: v for k, v in config(tmp_path).items() if k != "beta"}
    return dict(args, **kw)


def ggpo_trainer(tmp_path, data=None, **kw):
    args = ggpo_config(tmp_path, **kw)
    return RLFuseGRPOTrainer(model=eos_model(), reward_funcs=prompt_reward,
                             train_dataset=data or dataset(),
                             processing_class=tokenizer(),
                             args=RLFuseGRPOConfig(**args, rlfuse_loss="ggpo"))


def prompts_by_kind():
    """The test prompts whose groups' rewards agree, and those whose rewards differ."""
    data = dataset(16)
    return ([row for row in data if int(row["prompt"].split()[0][1:]) % 2 == parity]
            for parity in (0, 1))


def micro_batches(trainer, accumulation, groups=None, seed=4):
    """The ``accumulation`` micro-batches of the first optimizer step, as the trainer prepares
    them from one generation batch of ``groups`` (prompts, each twice: a group), the reference
    log-probs moved so that GGPO's KL term acts. By default one group whose rewards agree, the
    others' differ: however the trainer shuffles the groups, two micro-batches keep different
    numbers of them."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = accumulation
    if groups is None:
        even, odd = prompts_by_kind()
        groups = [even[0]] + odd[:2 * accumulation - 1]
    generation = [row for row in groups for _ in range(2)]
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 2)
    batches = []
    for step in range(accumulation):
        trainer._step = step
        inputs = dict(trainer._prepare_inputs(generation))
        ref = inputs["ref_per_token_logps"]
        inputs["ref_per_token_logps"] = ref + 0.5 * torch.randn(ref.shape, generator=gen)
        batches.append(inputs)
    return batches


def accumulated_step(trainer, batches, autocast):
    """The summed losses and every parameter's accumulated gradient of the step."""
    trainer.model.zero_grad()
    total = 0.0
    for inputs in batches:
        with trainer.accelerator.autocast() if autocast else torch.enable_grad():
            loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        total += loss.detach().float()
    return total, {n: p.grad.clone() for n, p in trainer.model.named_parameters()
                   if p.grad is not None}


def _cat(parts, left):
    """The rows of ``parts`` (of several processes' generation batches: their widths may
    differ) in one tensor, padded with zeros on the ``left`` (prompts) or the right."""
    width = max(p.shape[1] for p in parts)
    pad = [(width - p.shape[1], 0) if left else (0, width - p.shape[1]) for p in parts]
    return torch.cat([torch.nn.functional.pad(p, w) for p, w in zip(parts, pad)])


def one_call(trainer, batches, mixed_only, autocast):
    """``rlfuse.reference.ggpo_loss`` over the step's whole minibatch in one call: the
    rewards from the completions themselves, the groups left out by the test's own reading of
    them, the default normaliser (the minibatch's tokens)."""
    tok = trainer.processing_class
    whole = {k: _cat([b[k] for b in batches], left=k.startswith("prompt")) for k in
             ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
              "ref_per_token_logps")}
    rewards = torch.tensor(prompt_reward(
        tok.batch_decode(whole["prompt_ids"], skip_special_tokens=True),
        tok.batch_decode(whole["completion_ids"], skip_special_tokens=True)))
    pairs = rewards.view(-1, 2)
    kept = (pairs[:, 0] != pairs[:, 1]) if mixed_only else torch.ones(len(pairs), dtype=torch.bool)
    mask = whole["completion_mask"].bool() & kept.repeat_interleave(2)[:, None]
    trainer.model.zero_grad()
    with trainer.accelerator.autocast() if autocast else torch.enable_grad():
        lp = trainer._through_head(trainer.model, whole,
                                   lambda head: rlfuse.policy_logprobs(head, validate=False))
    out = rlfuse.reference.ggpo_loss(lp.float(), whole["ref_per_token_logps"].float(), rewards,
                                     mask, group_size=2, beta=BETA, validate=False)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()
             if p.grad is not None}
    return out.loss.detach(), grads, kept


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_step_is_ggpo_over_its_whole_minibatch(accumulation, loss_type, tmp_path):
    """fp32: the micro-batches' losses add up to the one call's and their accumulated
    gradient is its gradient, whatever ``loss_type`` (TRL's normalisers of grpo / dr_grpo
    would be off), with the all-equal groups left out (the test's reward makes some) and
    their share logged."""
    trainer = ggpo_trainer(tmp_path, gradient_accumulation_steps=accumulation,
                           loss_type=loss_type)
    batches = micro_batches(trainer, accumulation)
    got, got_grads = accumulated_step(trainer, batches, autocast=False)
    want, want_grads, kept = one_call(trainer, batches, True, autocast=False)
    assert 0 < kept.sum() < len(kept), kept      # both kinds of group in the step
    if accumulation > 1:     # the micro-batches' tokens differ: their own normalisers would not do
        tokens = [(b["completion_mask"] * b["advantages"].ne(0)[:, None]).sum() for b in batches]
        assert len(set(int(t) for t in tokens)) > 1, tokens
    dropped = trainer._metrics["train"]["rlfuse/ggpo_dropped_group_frac"][-1]
    assert dropped == pytest.approx(1.0 - kept.float().mean().item())
    torch.testing.assert_close(got, want.float(), **TOL["fp32_chain"])
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], **TOL["fp32_matmul"],
                                   msg=name)


def test_every_group_is_kept_when_asked(tmp_path):
    trainer = ggpo_trainer(tmp_path, gradient_accumulation_steps=2,
                           rlfuse_ggpo_mixed_groups_only=False)
    batches = micro_batches(trainer, 2)
    got, got_grads = accumulated_step(trainer, batches, autocast=False)
    want, want_grads, _ = one_call(trainer, batches, False, autocast=False)
    assert trainer._metrics["train"]["rlfuse/ggpo_dropped_group_frac"][-1] == 0.0
    torch.testing.assert_close(got, want.float(), **TOL["fp32_chain"])
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], **TOL["fp32_matmul"],
                                   msg=name)


def test_the_step_under_trls_default_bf16(tmp_path):
    """TRL's default bf16 autocast, two micro-batches: the step's gradient keeps the three-way
    rule against the one call in fp32, with the one call under the same autocast as the
    yardstick."""
    trainer = ggpo_trainer(tmp_path, gradient_accumulation_steps=2, bf16=True)
    assert trainer.accelerator.mixed_precision == "bf16"
    batches = micro_batches(trainer, 2)
    got, got_grads = accumulated_step(trainer, batches, autocast=True)
    ref, ref_grads, _ = one_call(trainer, batches, True, autocast=True)
    ref32, ref32_grads, _ = one_call(trainer, batches, True, autocast=False)
    assert_three_way(got, ref.float(), ref32.float(), "loss", atol_dtype=torch.bfloat16)
    for name in ref32_grads:
        assert_three_way(got_grads[name], ref_grads[name], ref32_grads[name], name,
                         atol_dtype=torch.bfloat16)


def test_the_reference_is_refreshed_by_a_copy(tmp_path):
    """rlfuse_loss="ggpo" turns TRL's reference sync on with alpha 1 (a copy) unless the user
    sets them; after a step the reference is the policy, bit for bit."""
    defaults = RLFuseGRPOConfig(**ggpo_config(tmp_path), rlfuse_loss="ggpo")
    assert defaults.sync_ref_model is True and defaults.ref_model_mixup_alpha == 1.0
    plain = RLFuseGRPOConfig(**config(tmp_path), rlfuse_loss="ppo")
    theirs = trl.GRPOConfig(**config(tmp_path))
    assert (plain.sync_ref_model, plain.ref_model_mixup_alpha) == \
        (theirs.sync_ref_model, theirs.ref_model_mixup_alpha)
    own = RLFuseGRPOConfig(**ggpo_config(tmp_path, sync_ref_model=True,
                                         ref_model_mixup_alpha=0.5), rlfuse_loss="ggpo")
    assert own.ref_model_mixup_alpha == 0.5
    trainer = ggpo_trainer(tmp_path, odd_prompts(), max_steps=1, ref_model_sync_steps=1)
    before = [p.detach().clone() for p in trainer.ref_model.parameters()]
    trainer.train()
    policy = list(trainer.model.parameters())
    assert any(not torch.equal(b, p) for b, p in zip(before, policy))
    for ref, p in zip(trainer.ref_model.parameters(), policy):
        assert torch.equal(ref, p)


def test_beta_where_unset(tmp_path):
    """β unset: rlfuse's GGPO default with rlfuse_loss="ggpo", TRL's with the other losses; a
    β the user sets is kept, and 0 (no GGPO) refused."""
    assert ggpo_trainer(tmp_path).args.beta == BETA > 0
    for loss in ("ppo", "gppo", "gr_opd"):
        assert RLFuseGRPOConfig(**ggpo_config(tmp_path), rlfuse_loss=loss).beta == \
            trl.GRPOConfig(**ggpo_config(tmp_path)).beta
    assert ggpo_trainer(tmp_path, beta=0.25).args.beta == 0.25
    with pytest.raises(ValueError, match=r"beta=0.0 with rlfuse_loss='ggpo' \(beta is GGPO's"):
        ggpo_trainer(tmp_path, beta=0.0)


def test_a_generation_batch_that_splits_a_step_is_refused(tmp_path):
    with pytest.raises(ValueError, match="steps_per_generation not a multiple of "
                                         "gradient_accumulation_steps with rlfuse_loss='ggpo'"):
        ggpo_trainer(tmp_path, gradient_accumulation_steps=2, steps_per_generation=3)


def _two_process_worker(out_dir: str) -> None:
    """One process of ``torchrun --nproc_per_node 2 tests/test_trl_ggpo.py DIR``: each rank's
    step of two micro-batches from its own prompts (different numbers of groups kept), the
    gradients averaged over the ranks as DDP averages them; rank 0 writes them beside the one
    call over every rank's minibatch."""
    import torch.distributed as dist

    trainer = ggpo_trainer(out_dir, gradient_accumulation_steps=2)
    rank = trainer.accelerator.process_index
    even, odd = prompts_by_kind()
    groups = [even[0]] + odd[:3] if rank == 0 else even[1:3] + odd[3:5]
    batches = micro_batches(trainer, 2, groups, seed=4 + rank)
    got, grads = accumulated_step(trainer, batches, autocast=False)
    dist.all_reduce(got)
    for grad in grads.values():
        dist.all_reduce(grad)
        grad /= dist.get_world_size()
    keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
            "ref_per_token_logps", STEP_TOKENS)
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, [{k: b[k].cpu() for k in keys} for b in batches])
    everyone = [b for part in parts for b in part]
    want, want_grads, kept = one_call(trainer, everyone, True, autocast=False)
    if rank == 0:
        torch.save({"processes": dist.get_world_size(), "loss": got / dist.get_world_size(),
                    "want": want, "grads": grads, "want_grads": want_grads, "kept": kept,
                    "step_tokens": [b[STEP_TOKENS] for b in everyone],
                    "tokens": [int(b["completion_mask"].sum()) for b in everyone]},
                   os.path.join(out_dir, "ggpo.pt"))
    dist.barrier()
    dist.destroy_process_group()


def test_two_processes_step_as_one_call(tmp_path):
    """Two gloo processes, two micro-batches each, their prompts keeping different numbers
    of groups: every micro-batch carries the step's token count over both processes, and the
    gradient averaged over them (as DDP averages it) is ``ggpo_loss`` over all four
    micro-batches in one call."""
    env = process_env(OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--standalone", __file__, str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = torch.load(tmp_path / "ggpo.pt")
    assert out["processes"] == 2
    tokens = out["tokens"]           # rank 0's two micro-batches, then rank 1's
    assert tokens[0] + tokens[1] != tokens[2] + tokens[3], tokens
    assert all(t == sum(tokens) for t in out["step_tokens"]), out["step_tokens"]
    assert 0 < out["kept"].sum() < len(out["kept"])
    torch.testing.assert_close(out["loss"], out["want"].float(), **TOL["fp32_chain"])
    assert out["grads"].keys() == out["want_grads"].keys()
    for name in out["want_grads"]:
        torch.testing.assert_close(out["grads"][name], out["want_grads"][name],
                                   **TOL["fp32_matmul"], msg=name)


if __name__ == "__main__":
    _two_process_worker(sys.argv[1])
