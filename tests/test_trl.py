"""rlfuse in TRL (the real package): RLFuseGRPOTrainer's loss and gradients against TRL's own
GRPOTrainer on the same batch, and a few training steps with each rlfuse loss."""
import copy
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import APPROX, TOL, assert_three_way, integration, process_env  # noqa: E402

trl = integration("trl")
transformers = integration("transformers")
datasets = integration("datasets")
integration("rlfuse.integrations.trl")      # TRL's trainers, with all they import
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

import rlfuse  # noqa: E402
from rlfuse.integrations.model_heads import add_head_forward, model_head  # noqa: E402
from rlfuse.integrations.trl import RLFuseGRPOConfig, RLFuseGRPOTrainer  # noqa: E402

WORDS = [f"w{i}" for i in range(40)]


def tokenizer():
    vocab = {"<pad>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                                eos_token="<eos>", padding_side="left")


# every test model's size: one layer of width 16 over the test vocabulary
TINY = dict(vocab_size=len(WORDS) + 2, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
            pad_token_id=0, eos_token_id=1, bos_token_id=None, tie_word_embeddings=False)


def model(seed=0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))


def eos_model():
    """The test Llama with its end-of-sequence logit made large, of either sign by the hidden
    state: completions end at different lengths, so that the processes hold different numbers
    of tokens (TRL's metrics weigh each process by them)."""
    net = model()
    with torch.no_grad():
        net.lm_head.weight[TINY["eos_token_id"]] *= 20.0
    return net


def head_model(name, seed=0):
    """A tiny model of a family whose forward scales or softcaps the logits after the output
    head, the head's weight large enough for the softcap to bend them."""
    torch.manual_seed(seed)
    net = {
        "gemma2": lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            **TINY, head_dim=8, final_logit_softcapping=2.0, attn_implementation="eager")),
        "gemma3": lambda: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **TINY, head_dim=8, final_logit_softcapping=2.0, attn_implementation="eager")),
        "cohere": lambda: transformers.CohereForCausalLM(transformers.CohereConfig(
            **TINY, logit_scale=0.25)),
        "granite": lambda: transformers.GraniteForCausalLM(transformers.GraniteConfig(
            **TINY, logits_scaling=4.0)),
    }[name]()
    with torch.no_grad():
        net.lm_head.weight.mul_(100.0)
    return net


HEAD_MODELS = ("gemma2", "gemma3", "cohere", "granite")


def moe_model(seed=0):
    """A tiny Mixtral: four experts, two per token, a router loss weighted to matter."""
    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **TINY, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.5))


def dataset(n=8):
    gen = torch.Generator().manual_seed(0)
    prompts = [" ".join(WORDS[int(i)] for i in torch.randint(0, 40, (3,), generator=gen))
               for _ in range(n)]
    return datasets.Dataset.from_dict({"prompt": prompts})


def reward(completions, **kwargs):
    return [float(sum(int(w[1:]) % 3 == 0 for w in c.split() if w.startswith("w")))
            for c in completions]


def config(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                max_completion_length=4, max_steps=2, learning_rate=1e-2, logging_steps=1,
                report_to="none", use_cpu=True, save_strategy="no", seed=0,
                temperature=1.0, beta=0.0, bf16=False)
    base.update(kw)
    return base


def test_ggpo_takes_the_rewards_whatever_trls_scaling(tmp_path):
    """rlfuse_loss="ggpo" under TRL's default scale_rewards ("group"), "batch" and "none": GGPO
    gets each group's rewards, centred (TRL's advantages with "none"), so the three give one
    loss and one gradient on the same generation batch."""
    model().save_pretrained(tmp_path / "policy")
    data, tok = dataset(), tokenizer()
    results = []
    for scale in ("group", "batch", "none"):
        kw = dict(loss_type="bnpo", beta=0.1, scale_rewards=scale)
        trainer = RLFuseGRPOTrainer(model=str(tmp_path / "policy"), reward_funcs=reward,
                                    train_dataset=data, processing_class=tok,
                                    args=RLFuseGRPOConfig(**config(tmp_path, **kw),
                                                          rlfuse_loss="ggpo"))
        trainer.model.train()
        torch.manual_seed(5)
        inputs = trainer._generate_and_score_completions([data[i] for i in range(4)])
        rewards = torch.tensor(reward(tok.batch_decode(inputs["completion_ids"],
                                                       skip_special_tokens=True)))
        centred = rewards - rewards.view(-1, 2).mean(1).repeat_interleave(2)
        torch.testing.assert_close(inputs["advantages"], centred, rtol=0, atol=0)
        results.append(loss_and_grads(trainer, inputs, 1))
    assert results[0][1]
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, results[0][0], rtol=0, atol=0)
        for name in grads:
            torch.testing.assert_close(grads[name], results[0][1][name], rtol=0, atol=0)


def trainers(tmp_path, path=None, net=None, ours=None, **kw):
    """TRL's trainer and rlfuse's, on copies of one model (``net``, else a Llama; loaded from
    ``path``: a reference model is), with one config (and the ``rlfuse_*`` fields ``ours``)."""
    data, tok = dataset(), tokenizer()
    net = (net or model()) if path is None else str(path)
    copy_of = copy.deepcopy if path is None else (lambda x: x)
    theirs = trl.GRPOTrainer(model=copy_of(net), reward_funcs=reward, train_dataset=data,
                             processing_class=tok, args=trl.GRPOConfig(**config(tmp_path, **kw)))
    fields = ours
    ours = RLFuseGRPOTrainer(model=copy_of(net), reward_funcs=reward, train_dataset=data,
                             processing_class=tok,
                             args=RLFuseGRPOConfig(**config(tmp_path, **kw),
                                                   **(fields or dict(rlfuse_loss="ppo"))))
    return theirs, ours, data


def loss_and_grads(trainer, inputs, accumulation):
    trainer.model.train()
    trainer.model.zero_grad()
    trainer.current_gradient_accumulation_steps = accumulation
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters()
                           if p.grad is not None}


def off_policy_batch(theirs, ours, data, case):
    """A generation batch of TRL's trainer with old log-probs off the policy (enough to clip:
    more for a sequence's mean ratio) and random advantages."""
    theirs.model.train()
    inputs = theirs._generate_and_score_completions([data[i] for i in range(4)])
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        lp = ours._completion_logprobs(ours.model, inputs)
    noise = 1.0 if case.get("importance_sampling_level") == "sequence" else 0.3
    inputs["old_per_token_logps"] = lp + noise * torch.randn(lp.shape, generator=gen)
    inputs["advantages"] = torch.randn(lp.shape[0], generator=gen)
    return inputs, gen


def assert_same_step(theirs, ours, inputs, accumulation):
    """TRL's loss and every parameter's gradient, from both trainers on ``inputs``."""
    want, want_grads = loss_and_grads(theirs, inputs, accumulation)
    got, got_grads = loss_and_grads(ours, inputs, accumulation)
    torch.testing.assert_close(got, want, **TOL["fp32_chain"])
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], **TOL["fp32_matmul"],
                                   msg=name)


CASES = [dict(loss_type=t) for t in ("grpo", "bnpo", "dr_grpo", "dapo")] + [
    dict(loss_type="dapo", epsilon_high=0.28),
    dict(loss_type="grpo", importance_sampling_level="sequence"),
    dict(loss_type="bnpo", epsilon=0.1, epsilon_high=0.3),
]


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_ppo_reproduces_trl(case, accumulation, tmp_path):
    """Same generation batch, same weights: rlfuse's loss (through LinearHead, no logits) and
    every parameter's gradient equal TRL's, with an old policy off enough to clip, on rows of
    different lengths (a tool mask: a sequence-level ratio's clip ratios are means over the
    sequences)."""
    theirs, ours, data = trainers(tmp_path, gradient_accumulation_steps=accumulation, **case)
    inputs, gen = off_policy_batch(theirs, ours, data, case)
    # rows clipped below, above, not at all (r near 1; r < 1 with A > 0): every token of a row
    # on the same side, by a margin, token ratio or sequence ratio alike
    with torch.no_grad():
        lp = ours._completion_logprobs(ours.model, inputs)
    B, T = lp.shape
    shift = torch.tensor([0.5, -0.5, 0.0, 0.5])[:, None]
    inputs["old_per_token_logps"] = lp + shift + 0.05 * torch.randn(lp.shape, generator=gen)
    inputs["advantages"] = torch.tensor([-1.0, 1.0, 0.5, 1.0])
    # a tool mask keeps 4, 3, 3, 1 tokens of the rows: a share of the tokens clipped is then a
    # share of the sequences only when none or all are clipped
    inputs["tool_mask"] = (torch.arange(T) < torch.tensor([4, 3, 3, 1])[:, None]).long()
    assert (inputs["completion_mask"] * inputs["tool_mask"]).sum(-1).tolist() == [4, 3, 3, 1]
    assert_same_step(theirs, ours, inputs, accumulation)
    assert theirs._metrics["train"]["clip_ratio/region_mean"][-1] > 0    # the clip is active
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                 "clip_ratio/low_min", "clip_ratio/high_max"):
        assert ours._metrics["train"][name][-1] == pytest.approx(
            theirs._metrics["train"][name][-1], **APPROX["fp32_metric_abs"]), name


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
@pytest.mark.parametrize("ratio_shape", ["token", "sequence"])
def test_per_token_multipliers(loss_type, ratio_shape, tmp_path):
    """TRL's per-token multipliers: the vLLM importance-sampling correction (a [B, T] or [B, 1]
    ratio; set on both trainers, since vLLM does not run here) and a tool mask (tokens of tool
    results, out of the loss)."""
    theirs, ours, data = trainers(tmp_path, loss_type=loss_type, epsilon_high=0.28)
    theirs.model.train()
    inputs = theirs._generate_and_score_completions([data[i] for i in range(4)])
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        lp = ours._completion_logprobs(ours.model, inputs)
    B, T = lp.shape
    inputs["old_per_token_logps"] = lp + 0.3 * torch.randn(lp.shape, generator=gen)
    inputs["advantages"] = torch.randn(B, generator=gen)
    inputs["importance_sampling_ratio"] = torch.rand(B, T if ratio_shape == "token" else 1,
                                                     generator=gen) * 2
    inputs["tool_mask"] = (torch.rand(B, T, generator=gen) > 0.3).to(torch.long)
    for trainer in (theirs, ours):
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    assert_same_step(theirs, ours, inputs, 1)


@pytest.mark.parametrize("loss, extra", [
    ("ppo", dict(loss_type="dapo", epsilon_high=0.28)),
    ("gppo", dict(loss_type="grpo")),
    ("ggpo", dict(loss_type="bnpo", beta=0.1, sync_ref_model=True,
                  ref_model_sync_steps=1)),
    ("gr_opd", dict(loss_type="grpo")),
])
def test_each_rlfuse_loss_trains(loss, extra, tmp_path):
    kw = config(tmp_path, **extra)
    teacher = model(seed=1) if loss == "gr_opd" else None
    policy = model()     # built in memory (GGPO's reference: a copy of it)
    trainer = RLFuseGRPOTrainer(model=policy, reward_funcs=reward, train_dataset=dataset(),
                                processing_class=tokenizer(), teacher_model=teacher,
                                args=RLFuseGRPOConfig(**kw, rlfuse_loss=loss))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert any(f"rlfuse/{name}" in h for h in trainer.state.log_history
               for name in ("ratio_mean", "gap", "adv_mean"))
    fused = [h["rlfuse/fused"] for h in trainer.state.log_history if "rlfuse/fused" in h]
    assert fused and set(fused) == {1.0}                 # the kernels ran, and it is logged
    moved = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert moved


# Every loss_type with its own settings, and every loss option, through rlfuse.policy_loss
OPTION_CASES = [
    dict(loss_type="cispo", epsilon_high=1.25),
    dict(loss_type="cispo", epsilon_high=1.25, importance_sampling_level="sequence"),
    dict(loss_type="sapo", sapo_temperature_pos=0.75, sapo_temperature_neg=1.25),
    dict(loss_type="sapo", importance_sampling_level="sequence"),
    dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_pos=2.5),
    dict(loss_type="luspo", importance_sampling_level="sequence"),
    dict(loss_type="bnpo", delta=1.25),
    dict(loss_type="grpo", beta=0.125),
    dict(loss_type="dapo", beta=0.125, use_bias_correction_kl=False),
    dict(loss_type="dr_grpo", entropy_coef=0.0625),
    dict(loss_type="dapo", entropy_coef=0.0625, top_entropy_quantile=0.5),
    dict(loss_type="grpo", top_entropy_quantile=0.75),
    dict(loss_type="dapo", off_policy_mask_threshold=0.05),
    dict(loss_type="grpo", beta=0.125, delta=1.5, entropy_coef=0.0625, top_entropy_quantile=0.75,
         off_policy_mask_threshold=0.1),
    dict(loss_type="dapo", mask_truncated_completions=True, num_iterations=2),
]


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("case", OPTION_CASES, ids=[str(c) for c in OPTION_CASES])
def test_every_loss_option_reproduces_trl(case, accumulation, tmp_path):
    """rlfuse_loss="ppo" with each TRL loss_type and loss option: TRL's loss, every parameter's
    gradient and the metrics TRL logs, on the same batch, whose rows a tool mask cuts to
    different lengths."""
    kw = dict(case, gradient_accumulation_steps=accumulation)
    if case.get("beta"):      # TRL's own trainer reloads its reference from the policy's path
        model().save_pretrained(tmp_path / "policy")
    theirs, ours, data = trainers(tmp_path, path=tmp_path / "policy" if case.get("beta") else None,
                                  **kw)
    inputs, gen = off_policy_batch(theirs, ours, data, case)
    T = inputs["completion_mask"].shape[1]
    inputs["tool_mask"] = (torch.arange(T) < torch.tensor([4, 3, 3, 1])[:, None]).long()
    if case.get("beta"):   # the reference is the policy's copy: moved, so that the KL acts
        ref = inputs["ref_per_token_logps"]
        inputs["ref_per_token_logps"] = ref + 0.5 * torch.randn(ref.shape, generator=gen)
    assert_same_step(theirs, ours, inputs, accumulation)
    if case.get("beta"):
        assert theirs._metrics["train"]["kl"][-1] > 1e-2
    names = {"cispo": ["cispo_clip_ratio"], "vespo": ["vespo/phi_seq_mean"],
             "sapo": []}.get(case["loss_type"], ["clip_ratio/low_mean", "clip_ratio/high_mean",
                                                  "clip_ratio/region_mean", "clip_ratio/low_min",
                                                  "clip_ratio/high_max"])
    names += ["kl"] if case.get("beta") else []
    names += ["entropy"]                 # TRL logs it with or without the bonus
    for name in names:
        assert ours._metrics["train"][name][-1] == pytest.approx(
            theirs._metrics["train"][name][-1], **APPROX["fp32_metric_abs"]), name


# GPPO's total-variation region of sizes eps / 2 (mc) is PPO's clip [1 - eps_low, 1 + eps_high]
GPPO_AS_CLIP = dict(rlfuse_loss="gppo", rlfuse_geometry="tv", rlfuse_topology="mc",
                    rlfuse_delta=(0.1, 0.14))
TERM_CASES = [
    dict(loss_type="grpo", beta=0.125),
    dict(loss_type="dapo", entropy_coef=0.0625, top_entropy_quantile=0.5),
    dict(loss_type="bnpo", off_policy_mask_threshold=0.05, use_adaptive_entropy=True,
         entropy_coef=0.05),
]


@pytest.mark.parametrize("case", TERM_CASES, ids=str)
def test_gppo_terms_reproduce_trl(case, tmp_path):
    """rlfuse_loss="gppo" with TRL's KL penalty, entropy bonus (static and adaptive) and masks:
    over the region that is PPO's clip, TRL's loss, every gradient and metric."""
    kw = dict(case, epsilon=0.2, epsilon_high=0.28)
    if case.get("beta"):
        model().save_pretrained(tmp_path / "policy")
    theirs, ours, data = trainers(tmp_path, path=tmp_path / "policy" if case.get("beta") else None,
                                  ours=GPPO_AS_CLIP, **kw)
    inputs, gen = off_policy_batch(theirs, ours, data, case)
    if case.get("beta"):
        ref = inputs["ref_per_token_logps"]
        inputs["ref_per_token_logps"] = ref + 0.5 * torch.randn(ref.shape, generator=gen)
    assert_same_step(theirs, ours, inputs, 1)
    names = ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy"]
    names += ["kl"] if case.get("beta") else []
    names += ["policy_loss"] if case.get("entropy_coef") else []
    for name in names:
        assert ours._metrics["train"][name][-1] == pytest.approx(
            theirs._metrics["train"][name][-1], **APPROX["fp32_metric_abs"]), name
    assert theirs._metrics["train"]["clip_ratio/region_mean"][-1] > 0


def test_gr_opd_terms_are_the_clip_over_its_advantages(tmp_path):
    """rlfuse_loss="gr_opd" with a KL penalty, an entropy bonus, a mask and TRL's ratio cap:
    the clip over GR-OPD's advantages with those terms, as rlfuse_loss="ppo" (TRL's own loss)
    computes it from the same advantages: loss, every gradient, the metrics."""
    model().save_pretrained(tmp_path / "policy")
    kw = dict(loss_type="grpo", beta=0.125, entropy_coef=0.0625, top_entropy_quantile=0.75,
              delta=1.5)
    data, tok, teacher = dataset(), tokenizer(), model(seed=1)
    pair = [RLFuseGRPOTrainer(model=str(tmp_path / "policy"), reward_funcs=reward,
                              train_dataset=data, processing_class=tok,
                              teacher_model=teacher if loss == "gr_opd" else None,
                              args=RLFuseGRPOConfig(**config(tmp_path, **kw), rlfuse_loss=loss))
            for loss in ("gr_opd", "ppo")]
    pair[0].model.train()
    inputs = pair[0]._generate_and_score_completions([data[i] for i in range(4)])
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        lp = pair[0]._completion_logprobs(pair[0].model, inputs)
    inputs["old_per_token_logps"] = lp + 0.3 * torch.randn(lp.shape, generator=gen)
    ref = inputs["ref_per_token_logps"]
    inputs["ref_per_token_logps"] = ref + 0.5 * torch.randn(ref.shape, generator=gen)
    got, got_grads = loss_and_grads(pair[0], inputs, 1)
    want, want_grads = loss_and_grads(pair[1], inputs, 1)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=0, atol=0, msg=name)
    for name in ("kl", "entropy", "policy_loss", "clip_ratio/region_mean"):
        assert pair[0]._metrics["train"][name] == pair[1]._metrics["train"][name], name
    assert pair[0]._metrics["train"]["kl"][-1] > 1e-2


@pytest.mark.parametrize("case", [dict(entropy_target=5.0), dict(entropy_target=1.0),
                                  dict(entropy_target=5.0, top_entropy_quantile=0.5,
                                       loss_type="dapo")], ids=str)
def test_adaptive_entropy_reproduces_trl(case, tmp_path):
    """``use_adaptive_entropy``: over three optimizer steps on one batch, TRL's controller state
    (``entropy_coef``, the last world entropy), its gating of the bonus, the loss, the gradients
    and the logged ``policy_loss`` / ``entropy_coef`` equal TRL's."""
    kw = dict(dict(loss_type="grpo", use_adaptive_entropy=True, entropy_coef=0.05,
                   entropy_coef_delta=0.02), **case)
    theirs, ours, data = trainers(tmp_path, **kw)
    theirs.model.train()
    inputs = theirs._generate_and_score_completions([data[i] for i in range(4)])
    gen = torch.Generator().manual_seed(5)
    inputs["advantages"] = torch.randn(inputs["completion_ids"].shape[0], generator=gen)
    for step in range(3):
        assert_same_step(theirs, ours, inputs, 1)
        assert ours.entropy_coef == pytest.approx(theirs.entropy_coef, abs=1e-12), step
        assert ours._last_world_entropy == pytest.approx(theirs._last_world_entropy,
                                                         **APPROX["fp32_metric"]), step
        for name in ("policy_loss", "entropy_coef"):
            assert ours._metrics["train"][name][-1] == pytest.approx(
                theirs._metrics["train"][name][-1], **APPROX["fp32_metric"]), name
    assert theirs.entropy_coef != 0.05                      # the controller moved


def test_default_precision(tmp_path):
    """TRL's default precision, bf16 autocast (a GPU run's default; on the CPU ``bf16=True``
    with ``use_cpu``): the trainer trains, and its first-step loss and gradients keep the
    three-way rule against TRL's own fp32 run, with TRL's own bf16 run as the yardstick."""
    kw = config(tmp_path, loss_type="dapo", bf16=True)
    results = {}
    for name, precision, side in (("ours", {}, 1), ("theirs", {}, 0),
                                  ("theirs32", dict(bf16=False), 0)):
        pair = trainers(tmp_path, **dict(kw, **precision))
        trainer = pair[side]
        if "inputs" not in results:    # one generation batch for the three runs
            pair[0].model.train()
            inputs = pair[0]._generate_and_score_completions([pair[2][i] for i in range(4)])
            with torch.no_grad():
                lp = pair[1]._completion_logprobs(pair[1].model, inputs).float()
            gen = torch.Generator().manual_seed(3)
            inputs["old_per_token_logps"] = lp + 0.3 * torch.randn(lp.shape, generator=gen)
            inputs["advantages"] = torch.randn(lp.shape[0], generator=gen)
            results["inputs"] = inputs
        assert trainer.accelerator.mixed_precision == ("no" if precision else "bf16")
        with trainer.accelerator.autocast():
            results[name] = loss_and_grads(trainer, results["inputs"], 1)
    (got, got_g), (ref, ref_g), (ref32, ref32_g) = (results[k] for k in
                                                    ("ours", "theirs", "theirs32"))
    assert_three_way(got, ref, ref32, "loss", atol_dtype=torch.bfloat16)
    for name in ref32_g:
        assert got_g[name].dtype == torch.float32
        assert_three_way(got_g[name], ref_g[name], ref32_g[name], name,
                         atol_dtype=torch.bfloat16)
    _, ours, _ = trainers(tmp_path, **kw)
    ours.train()                                           # the real loop, under autocast
    losses = [h["loss"] for h in ours.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)


def test_cast_lm_head_to_fp32(tmp_path):
    """A bf16 model with TRL's ``cast_lm_head_to_fp32``: the head in fp32 from the bf16 hidden
    states; the loss and gradients keep the three-way rule against TRL's run of the fp32 model,
    with TRL's own bf16 run as the yardstick."""
    runs = {}
    for name, dtype, side in (("ours", torch.bfloat16, 1), ("theirs", torch.bfloat16, 0),
                              ("theirs32", torch.float32, 0)):
        net, data, tok = model().to(dtype), dataset(), tokenizer()
        kw = config(tmp_path, loss_type="bnpo", cast_lm_head_to_fp32=True)
        trainer = (trl.GRPOTrainer(model=net, reward_funcs=reward, train_dataset=data,
                                   processing_class=tok, args=trl.GRPOConfig(**kw))
                   if side == 0 else
                   RLFuseGRPOTrainer(model=net, reward_funcs=reward, train_dataset=data,
                                     processing_class=tok, args=RLFuseGRPOConfig(**kw)))
        assert trainer.model.lm_head.weight.dtype == torch.float32
        if "inputs" not in runs:
            trainer.model.train()
            inputs = trainer._generate_and_score_completions([data[i] for i in range(4)])
            gen = torch.Generator().manual_seed(4)
            inputs["advantages"] = torch.randn(inputs["completion_ids"].shape[0], generator=gen)
            runs["inputs"] = inputs
        runs[name] = loss_and_grads(trainer, runs["inputs"], 1)
    (got, got_g), (ref, ref_g), (ref32, ref32_g) = (runs[k] for k in
                                                    ("ours", "theirs", "theirs32"))
    assert_three_way(got.float(), ref.float(), ref32, "loss", atol_dtype=torch.bfloat16)
    for name in ref32_g:
        assert got_g[name].dtype == ref_g[name].dtype
        assert_three_way(got_g[name].float(), ref_g[name].float(), ref32_g[name], name,
                         atol_dtype=torch.bfloat16)


@pytest.mark.parametrize("name", HEAD_MODELS)
def test_model_heads_equal_their_own_logits(name):
    """In float64, the head the trainer reads from a model's config (Gemma's softcap, Cohere's
    logit scale, Granite's logits scaling) gives the log-probs of the model's own logits, and
    their gradient to every parameter."""
    net = head_model(name).double()
    add_head_forward(net)
    fields = model_head(net)
    assert fields != dict(logit_scale=1.0, softcap=None)
    ids = torch.randint(2, len(WORDS) + 2, (2, 7), generator=torch.Generator().manual_seed(0))
    targets = ids[:, 1:]
    ours = net(input_ids=ids, rlfuse_head=lambda h, w, b: rlfuse.policy_logprobs(
        rlfuse.LinearHead(h, w, targets, b, **fields)))
    own = torch.log_softmax(net(input_ids=ids).logits[:, :-1], -1).gather(
        -1, targets[..., None])[..., 0]
    assert (own - torch.log_softmax(
        torch.nn.functional.linear(net.model(input_ids=ids).last_hidden_state,
                                   net.lm_head.weight)[:, :-1], -1).gather(
        -1, targets[..., None])[..., 0]).abs().max() > 1e-2      # the head's transform matters
    torch.testing.assert_close(ours, own, **TOL["fp64_head"])
    params = [p for p in net.parameters() if p.requires_grad]
    for got, want in zip(torch.autograd.grad(ours.sum(), params, allow_unused=True),
                         torch.autograd.grad(own.sum(), params, allow_unused=True)):
        if want is None:
            assert got is None or (got == 0).all()
        else:
            torch.testing.assert_close(got, want, **TOL["fp64_head"])


@pytest.mark.parametrize("name", ["gemma2", "cohere"])
def test_model_heads_reproduce_trl(name, tmp_path):
    theirs, ours, data = trainers(tmp_path, net=head_model(name), loss_type="dapo")
    inputs, _ = off_policy_batch(theirs, ours, data, {})
    assert_same_step(theirs, ours, inputs, 1)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_router_aux_loss_reproduces_trl(accumulation, tmp_path):
    """An MoE policy: TRL adds the router's load-balancing loss (its coefficient over the
    accumulation) to the policy loss; rlfuse's trainer computes it from the same backbone
    pass that gives the hidden states, with the model's own function: the same loss, every
    gradient (the router's included) and TRL's aux_loss metric."""
    theirs, ours, data = trainers(tmp_path, net=moe_model(), loss_type="dapo")
    assert theirs.aux_loss_enabled and ours.aux_loss_enabled
    inputs, _ = off_policy_batch(theirs, ours, data, {})
    assert_same_step(theirs, ours, inputs, accumulation)
    want, got = theirs._metrics["train"]["aux_loss"], ours._metrics["train"]["aux_loss"]
    assert len(got) == len(want) >= 1 and got[-1] == pytest.approx(want[-1], rel=1e-6)
    assert want[-1] > 0.1


def test_a_head_rlfuse_does_not_know_is_refused(tmp_path):
    """A model whose forward does something after the backbone that its config does not say
    (MiniCPM divides the hidden states before its head) is refused at construction."""
    net = model()
    original = net.forward

    def forward(*args, **kwargs):
        out = original(*args, **kwargs)
        out.logits = out.logits * 0.5
        return out

    net.forward = forward
    with pytest.raises(ValueError, match="does something after the backbone"):
        RLFuseGRPOTrainer(model=net, reward_funcs=reward, train_dataset=dataset(),
                          processing_class=tokenizer(), args=RLFuseGRPOConfig(**config(tmp_path)))


def test_a_default_or_plain_config_is_taken(tmp_path, monkeypatch):
    """As GRPOTrainer: no args builds TRL's default (output in "<model name>-GRPO"); a plain
    GRPOConfig keeps its fields, with rlfuse's defaults for its own (TRL's test_init_minimal)."""
    monkeypatch.chdir(tmp_path)
    model().save_pretrained(tmp_path / "policy")

    def build(cls):   # TRL's default config asks for bf16, which a CPU-only machine refuses
        try:
            return cls(str(tmp_path / "policy"), reward, train_dataset=dataset(),
                       processing_class=tokenizer()), None
        except ValueError as error:
            return None, str(error)

    (theirs, their_error), (ours, our_error) = build(trl.GRPOTrainer), build(RLFuseGRPOTrainer)
    assert our_error == their_error
    if ours is not None:
        assert isinstance(ours.args, RLFuseGRPOConfig)
        assert ours.args.output_dir == theirs.args.output_dir
    plain = trl.GRPOConfig(**config(tmp_path, learning_rate=3e-4, loss_type="bnpo"))
    trainer = RLFuseGRPOTrainer(str(tmp_path / "policy"), reward, plain,
                                train_dataset=dataset(), processing_class=tokenizer())
    assert isinstance(trainer.args, RLFuseGRPOConfig)
    assert (trainer.args.learning_rate, trainer.args.loss_type) == (3e-4, "bnpo")


def test_reference_of_a_model_built_in_memory(tmp_path):
    """beta > 0 with a policy built in memory (no checkpoint to reload): TRL's reference model is
    a copy of the policy, equal in weights, sharing none."""
    policy = model()
    trainer = RLFuseGRPOTrainer(model=policy, reward_funcs=reward, train_dataset=dataset(),
                                processing_class=tokenizer(),
                                args=RLFuseGRPOConfig(**config(tmp_path, beta=0.1)))
    reference = trainer.accelerator.unwrap_model(trainer.ref_model)
    pairs = list(zip(trainer.model.parameters(), reference.parameters()))
    assert pairs and all(torch.equal(a, b) and a.data_ptr() != b.data_ptr() for a, b in pairs)


def test_lora_policy(tmp_path):
    """A PEFT LoRA policy (TRL wraps the model): the head and the backbone are found under the
    adapters, the loss equals TRL's on the same batch and only the adapters train."""
    peft = integration("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    net, data, tok = model(), dataset(), tokenizer()
    kw = config(tmp_path, loss_type="grpo", epsilon_high=0.28)
    theirs = trl.GRPOTrainer(model=copy.deepcopy(net), reward_funcs=reward, train_dataset=data,
                             processing_class=tok, peft_config=lora, args=trl.GRPOConfig(**kw))
    ours = RLFuseGRPOTrainer(model=copy.deepcopy(net), reward_funcs=reward, train_dataset=data,
                             processing_class=tok, peft_config=lora,
                             args=RLFuseGRPOConfig(**kw, rlfuse_loss="ppo"))
    theirs.model.train()
    inputs = theirs._generate_and_score_completions([data[i] for i in range(4)])
    inputs["advantages"] = torch.randn(inputs["completion_ids"].shape[0],
                                       generator=torch.Generator().manual_seed(2))
    want, want_grads = loss_and_grads(theirs, inputs, 1)
    got, got_grads = loss_and_grads(ours, inputs, 1)
    torch.testing.assert_close(got, want, **TOL["fp32_chain"])
    assert got_grads.keys() == want_grads.keys() and all("lora_" in n for n in got_grads)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], **TOL["fp32_matmul"],
                                   msg=name)


def test_unsupported_options_are_listed(tmp_path):
    with pytest.raises(ValueError, match="cannot honour.*loss_type='sapo' with rlfuse_loss='gppo'"
                                         ".*delta=2.0 with rlfuse_loss='gppo'"):
        RLFuseGRPOTrainer(model=model(), reward_funcs=reward, train_dataset=dataset(),
                          processing_class=tokenizer(),
                          args=RLFuseGRPOConfig(**config(tmp_path, loss_type="sapo", beta=0.5,
                                                         delta=2.0, use_adaptive_entropy=True),
                                                rlfuse_loss="gppo"))
    with pytest.raises(ValueError, match="cannot honour.*top_entropy_quantile=0.5 with "
                                         "rlfuse_loss='ggpo' \\(GGPO takes no terms.*"
                                         "use_adaptive_entropy=True with rlfuse_loss='ggpo'"):
        RLFuseGRPOTrainer(model=model(), reward_funcs=reward, train_dataset=dataset(),
                          processing_class=tokenizer(),
                          args=RLFuseGRPOConfig(**config(tmp_path, beta=0.1, scale_rewards="none",
                                                         top_entropy_quantile=0.5,
                                                         use_adaptive_entropy=True),
                                                rlfuse_loss="ggpo"))
    with pytest.raises(ValueError, match="rlfuse_geometry: expected one of .*got 'chi'.*"
                                         "rlfuse_delta: expected a value finite and > 0, got "
                                         "-0.1.*rlfuse_chunk_tokens: expected None or an int > 0, "
                                         "got 0"):
        RLFuseGRPOTrainer(model=model(), reward_funcs=reward, train_dataset=dataset(),
                          processing_class=tokenizer(),
                          args=RLFuseGRPOConfig(**config(tmp_path), rlfuse_loss="gppo",
                                                rlfuse_geometry="chi", rlfuse_delta=-0.1,
                                                rlfuse_chunk_tokens=0))
    with pytest.raises(ValueError, match="gr_opd' without teacher_model"):
        RLFuseGRPOTrainer(model=model(), reward_funcs=reward, train_dataset=dataset(),
                          processing_class=tokenizer(),
                          args=RLFuseGRPOConfig(**config(tmp_path), rlfuse_loss="gr_opd"))


ENGINES = {"ddp": {}, "fsdp2": dict(fsdp=True, fsdp_config={"version": 2}),
           "zero3": dict(deepspeed={"zero_optimization": {
                                        "stage": 3,
                                        "stage3_gather_16bit_weights_on_model_save": True,
                                        # every parameter partitioned, however small
                                        "stage3_param_persistence_threshold": 0},
                                    "zero_allow_untested_optimizer": True,
                                    "train_micro_batch_size_per_gpu": "auto",
                                    "gradient_accumulation_steps": "auto",
                                    "gradient_clipping": "auto"})}


def _fsdp_on_the_cpu() -> None:
    """accelerate 1.15 turns its FSDP plugin on only for accelerators (a CPU run falls back to
    DDP). The test lifts that gate, nothing else: what then runs is accelerate's FSDP
    preparation and torch's FSDP (fully_shard's all-gathers in the forward and reduce-scatters
    of the gradients) over gloo."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = __init__


def _distributed_worker(out_dir: str, engine: str) -> None:
    """One process of ``torchrun --nproc_per_node 2 tests/test_trl.py DIR ENGINE``: two
    training steps (SGD: the parameters move by the gradients themselves) of TRL's trainer,
    then of rlfuse's, under ``engine`` (through accelerate, gloo), each rank on its own
    prompts; rank 0 writes each one's whole parameters, logs and what it saw.
    ``engine``: a key of ``ENGINES`` (DDP, FSDP2, DeepSpeed ZeRO-3)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if engine.startswith("fsdp"):
        _fsdp_on_the_cpu()
    kw = config(out_dir, loss_type="dapo", epsilon_high=0.28, optim="sgd", **ENGINES[engine])
    for kind in ("trl", "rlfuse"):
        trainer = (trl.GRPOTrainer(model=eos_model(), reward_funcs=reward,
                                   train_dataset=dataset(16), processing_class=tokenizer(),
                                   args=trl.GRPOConfig(**kw))
                   if kind == "trl" else
                   RLFuseGRPOTrainer(model=eos_model(), reward_funcs=reward,
                                     train_dataset=dataset(16), processing_class=tokenizer(),
                                     args=RLFuseGRPOConfig(**kw, rlfuse_loss="ppo")))
        trainer.train()
        wrapped = trainer.model_wrapped
        # gathered whole on rank 0 (from ZeRO-3's engine, which holds the partitions)
        state = trainer.accelerator.get_state_dict(wrapped if engine == "zero3" else
                                                   trainer.model)
        local = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
        ranks = trainer.accelerator.gather(local[None]) if engine == "ddp" else local[None]
        if trainer.accelerator.is_main_process:
            torch.save({k: v.detach().cpu() for k, v in state.items()},
                       os.path.join(out_dir, f"{engine}-{kind}.pt"))
            with open(os.path.join(out_dir, f"{engine}-{kind}.json"), "w") as f:
                json.dump({"processes": trainer.accelerator.num_processes,
                           "wrapper": "ddp" if isinstance(wrapped, DistributedDataParallel)
                           else "fsdp2" if isinstance(trainer.model, FSDPModule) else
                           "zero3" if getattr(wrapped, "zero_optimization_stage", int)() == 3
                           else type(wrapped).__name__,
                           "rank_spread": (ranks - ranks[0]).abs().sum().item(),
                           "logs": trainer.state.log_history}, f)
        trainer.accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()


def _run_distributed(tmp_path, engine: str):
    """Both trainers' results under ``engine``: ``[(TRL's run, its parameters), (rlfuse's)]``."""
    env = process_env(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")   # DeepSpeed over gloo
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--standalone", __file__, str(tmp_path), engine],
        env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = []
    for kind in ("trl", "rlfuse"):
        result = json.loads((tmp_path / f"{engine}-{kind}.json").read_text())
        assert result["processes"] == 2 and result["wrapper"] == engine, result
        runs.append((result, torch.load(tmp_path / f"{engine}-{kind}.pt")))
    return runs


@pytest.mark.parametrize("engine", ["ddp", "fsdp2",
                                    pytest.param("zero3", marks=pytest.mark.slow)])
def test_engines_train_as_trl(engine, tmp_path):
    """DDP, FSDP2 (fully_shard: the head's weight sharded, gathered by FSDP inside the model's
    forward, where the loss runs) and DeepSpeed ZeRO-3 (every parameter partitioned, the
    head's gathered by ZeRO-3's hooks around the head module, which runs the loss as its
    forward) over two gloo processes whose completions end at different lengths: rlfuse's
    trainer ends with TRL's own parameters, after the same logged losses, gradient norms and
    metrics (TRL's means over every process's tokens). Under DDP the loss runs inside the
    wrapped model's forward, so DDP averages the gradients and the ranks hold the same
    parameters after each step (a loss outside that forward would leave them drifting)."""
    (theirs, want), (ours, got) = _run_distributed(tmp_path, engine)
    if engine == "ddp":
        assert ours["rank_spread"] == 0, ours
    lengths = [s["completions/mean_length"] for s in theirs["logs"] if "grad_norm" in s]
    assert min(lengths) < 4      # some completions end early: the processes' tokens differ
    assert_trained_as_trl(theirs, want, ours, got,
                          ("loss", "grad_norm", "entropy", "clip_ratio/region_mean"))


def assert_trained_as_trl(theirs, want, ours, got, keys):
    """Two trainers' runs from ``eos_model()`` (logs, final parameters): the parameters moved
    and are TRL's, the two steps logged the same ``keys``."""
    start = eos_model().state_dict()
    assert got.keys() == want.keys() == start.keys()
    assert max((want[k] - start[k]).abs().max().item() for k in start) > 1e-4
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL["fp32_matmul"], msg=name)
    steps = [(a, b) for a, b in zip(theirs["logs"], ours["logs"]) if "grad_norm" in a]
    assert len(steps) == 2
    for a, b in steps:
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key


if __name__ == "__main__":
    _distributed_worker(*sys.argv[1:])
    # Every result is on disk; the interpreter's shutdown is skipped. Under ZeRO-3 on the CPU a
    # C++ thread can outlive the work, joinable, and its destructor aborts the process at exit
    # ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _rows_of(inputs: dict, rows: list) -> dict:
    """The rows ``rows`` of a generation batch (its per-row tensors; the rest as it is)."""
    n = inputs["completion_ids"].shape[0]
    return {k: v[rows] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n else v
            for k, v in inputs.items()}


def test_batch_invariant_old_logprobs_are_the_training_passes(tmp_path):
    """``rlfuse_batch_invariant=True`` under TRL's default bf16: TRL's old log-probs (its
    generation batch of 8 in micro-batches of 4) equal, bit for bit, the training pass's of
    the same completions in micro-batches of 3, 1 and 4 in another order, so every ratio is
    exactly 1 on policy (the loss's ratio metrics); without it TRL's own old log-probs differ
    from the training pass's."""
    data, tok = dataset(), tokenizer()
    olds = {}
    for invariant in (True, False):
        trainer = RLFuseGRPOTrainer(
            model=model(), reward_funcs=reward, train_dataset=data, processing_class=tok,
            args=RLFuseGRPOConfig(**config(tmp_path, loss_type="dapo", bf16=True,
                                           steps_per_generation=2),
                                  rlfuse_batch_invariant=invariant))
        assert trainer.accelerator.mixed_precision == "bf16"
        trainer.model.train()
        torch.manual_seed(5)
        inputs = trainer._generate_and_score_completions([data[i] for i in range(8)])
        old = inputs["old_per_token_logps"]
        assert old is not None and old.shape[0] == 8
        with trainer.accelerator.autocast():
            new = torch.empty_like(old)
            for rows in ([5, 2, 7], [0], [1, 3, 4, 6]):
                new[rows] = trainer._completion_logprobs(trainer.model, _rows_of(inputs, rows))
        olds[invariant] = torch.equal(new, old)
        if invariant:
            trainer.current_gradient_accumulation_steps = 1
            with trainer.accelerator.autocast():
                trainer._compute_loss(trainer.model, _rows_of(inputs, [6, 1, 2]))
            assert trainer._metrics["train"]["rlfuse/ratio_mean"][-1] == 1.0
            assert trainer._metrics["train"]["clip_ratio/region_mean"][-1] == 0.0
    assert olds == {True: True, False: False}
