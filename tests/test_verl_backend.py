"""rlfuse as verl's fused-kernel backend (the real verl 0.9.1): ``fused_kernels_backend="rlfuse"``
through verl's ``apply_monkey_patch`` gives verl's patched forward the log-probs and entropy of
verl's ``torch`` backend, and their gradients to every parameter, in verl's packed (rmpad)
layout with each of its label conventions; verl's own actor loss (``ppo_loss``: policy loss,
KL loss, entropy bonus) from them equals verl's from its own backend."""
import copy
import functools
import types

import pytest
import torch

from conftest import APPROX, TOL, assert_three_way, integration  # noqa: E402

transformers = integration("transformers")

monkey_patch = integration("verl.models.transformers.monkey_patch")
from tensordict import TensorDict  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.experimental import torch_functional  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

import rlfuse  # noqa: E402
from rlfuse.integrations import verl as rlfuse_verl  # noqa: E402  (installs the backend)
from rlfuse.integrations.verl import backend as rlfuse_backend  # noqa: E402

V = 53
TINY = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
# three sequences packed as verl's remove-padding packs them: prompt and response back to back
PROMPTS, RESPONSES = (3, 2, 4), (4, 5, 2)


def tiny(name, dtype, seed=0):
    torch.manual_seed(seed)
    net = {
        "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            **TINY, tie_word_embeddings=False)),
        "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **TINY, tie_word_embeddings=True)),
        "gemma2": lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            **TINY, head_dim=8, final_logit_softcapping=2.0, attn_implementation="eager")),
    }[name]()
    with torch.no_grad():
        net.get_output_embeddings().weight.mul_(8.0)     # logits large enough to matter
    return net.to(dtype)


# each class's own forward, before verl replaces it on the class
_OWN = {cls: cls.forward for cls in (transformers.Qwen2ForCausalLM, transformers.LlamaForCausalLM,
                                     transformers.Gemma2ForCausalLM)}


@pytest.fixture(autouse=True)
def verl_patches_undone(monkeypatch):
    """verl's patch replaces the forward of the model's class: each class gets its own back
    after the test (the next tests in the process build these models too).

    verl 0.9.1's ``apply_monkey_patch`` imports TRL's value-head model whenever TRL is
    installed, and TRL 1.16 (installed for the TRL tests) no longer has it: the two packages
    clash with each other, whatever the backend. That step concerns PPO critics only."""
    for cls, forward in _OWN.items():
        monkeypatch.setattr(cls, "forward", forward)
    monkeypatch.setattr(monkey_patch, "is_trl_available", lambda: False)


def patched(net, backend):
    monkey_patch.apply_monkey_patch(net, use_remove_padding=False, use_fused_kernels=True,
                                    fused_kernels_backend=backend)
    return net


def packed_batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, V, (p,), generator=gen) for p in PROMPTS]
    responses = [torch.randint(0, V, (r,), generator=gen) for r in RESPONSES]
    ids = torch.cat([torch.cat(pair) for pair in zip(prompts, responses)])[None]
    positions = torch.cat([torch.arange(p + r) for p, r in zip(PROMPTS, RESPONSES)])[None]
    return prompts, responses, ids, positions


def labels_inputs(form, ids, seed=0):
    """The model's inputs besides ids for each way verl hands it the labels, and the labels
    the forward must use."""
    if form == "input_ids":
        return {}, torch.roll(ids, -1, -1)
    other = torch.randint(0, V, ids.shape, generator=torch.Generator().manual_seed(seed + 1))
    if form == "labels":
        return {"labels": other}, torch.roll(other, -1, -1)
    return {"shift_labels": other}, other       # the engine's globally rolled labels (Ulysses)


def forward_and_grads(net, ids, positions, inputs, temperature, seed=0):
    out = net(input_ids=ids, position_ids=positions, temperature=temperature, use_cache=False,
              return_dict=True, **inputs)
    gen = torch.Generator().manual_seed(seed + 2)
    w_logp, w_ent = (torch.randn(ids.shape, generator=gen, dtype=torch.float64) for _ in "ab")
    objective = (out.log_probs.double() * w_logp + out.entropy.double() * w_ent).sum()
    params = [p for p in net.parameters() if p.requires_grad]
    grads = torch.autograd.grad(objective, params)
    return out.log_probs.detach(), out.entropy.detach(), grads, (w_logp, w_ent)


def oracle(net64, ids, positions, labels, temperature, weights):
    """float64 log-probs and entropy of the model's own logits, and the gradients."""
    logits = _OWN[type(net64)](net64, input_ids=ids, position_ids=positions, use_cache=False).logits
    z = torch.log_softmax(logits / temperature, -1)
    logp = z.gather(-1, labels[..., None])[..., 0]
    entropy = -(z.exp() * z).sum(-1)
    objective = (logp * weights[0] + entropy * weights[1]).sum()
    grads = torch.autograd.grad(objective, list(net64.parameters()))
    return logp.detach(), entropy.detach(), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name, form, temperature", [
    ("qwen2", "input_ids", 1.0), ("qwen2", "labels", 0.7), ("llama", "shift_labels", 0.7),
    ("llama", "input_ids", 1.3)])
def test_backend_is_verls_torch_backend(name, form, temperature, dtype):
    """The same model and packed inputs through verl's torch backend and through rlfuse: the
    log-probs, the entropy and the gradient of a random combination of both to every parameter
    (tied embeddings in Llama), each held to the three-way rule against the model's own float64
    logits (for bf16 the three share the bf16 backbone's rounding)."""
    base = tiny(name, dtype)
    theirs_net, ours_net = patched(copy.deepcopy(base), "torch"), patched(copy.deepcopy(base),
                                                                           "rlfuse")
    _, _, ids, positions = packed_batch()
    inputs, labels = labels_inputs(form, ids)
    ours = forward_and_grads(ours_net, ids, positions, inputs, temperature)
    theirs = forward_and_grads(theirs_net, ids, positions, inputs, temperature)
    ref64 = oracle(copy.deepcopy(base).double(), ids, positions, labels, temperature, ours[3])
    assert ours[0].dtype == ours[1].dtype == torch.float32
    assert_three_way(ours[0], theirs[0], ref64[0], "log_probs", atol_dtype=dtype)
    assert_three_way(ours[1], theirs[1], ref64[1], "entropy", atol_dtype=dtype)
    for (pname, _), got, want, want64 in zip(base.named_parameters(), ours[2], theirs[2],
                                              ref64[2]):
        assert got.dtype == dtype, pname
        assert_three_way(got.float(), want.float(), want64, pname, atol_dtype=dtype,
                         scale=max(1.0, want64.abs().max().item()))


def test_softcapped_head_is_the_models_own():
    """Gemma 2's softcap, which verl's own backends leave out: rlfuse's log-probs and entropy
    are those of the model's own logits (float64), and so are their gradients."""
    base = tiny("gemma2", torch.float64)
    net = patched(copy.deepcopy(base), "rlfuse")
    assert net._rlfuse_head == dict(logit_scale=1.0, softcap=2.0)
    _, _, ids, positions = packed_batch()
    logp, entropy, grads, weights = forward_and_grads(net, ids, positions, {}, 0.7)
    want = oracle(base, ids, positions, torch.roll(ids, -1, -1), 0.7, weights)
    uncapped = patched(copy.deepcopy(base), "torch")
    assert (forward_and_grads(uncapped, ids, positions, {}, 0.7)[0] - want[0]).abs().max() > 1e-2
    torch.testing.assert_close(logp, want[0], **TOL["fp64_head"])
    torch.testing.assert_close(entropy, want[1], **TOL["fp64_head"])
    for got, expected in zip(grads, want[2]):
        torch.testing.assert_close(got, expected, **TOL["fp64_head"])


def actor_data(prompts, responses, dtype, seed=0):
    """verl's micro-batch as its ``ppo_loss`` reads it: nested prompts and responses, padded
    per-response fields, the global batch info."""
    gen = torch.Generator().manual_seed(seed + 3)
    B, R = len(responses), max(RESPONSES)
    mask = (torch.arange(R)[None] < torch.tensor(RESPONSES)[:, None]).float()
    old = -torch.rand(B, R, generator=gen) * 3
    data = TensorDict({
        "prompts": torch.nested.as_nested_tensor(prompts, layout=torch.jagged),
        "responses": torch.nested.as_nested_tensor(responses, layout=torch.jagged),
        "response_mask": mask, "old_log_probs": old.to(dtype),
        "ref_log_prob": (old + 0.3 * torch.randn(B, R, generator=gen)).to(dtype),
        "advantages": torch.randn(B, 1, generator=gen).expand(B, R).to(dtype)},
        batch_size=[B])
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=None, global_batch_size=None)
    return data


@pytest.mark.parametrize("loss_agg_mode, kl_loss_type", [
    ("token-mean", "low_var_kl"), ("seq-mean-token-mean", "k1"), ("token-mean", "mse"),
    ("seq-mean-token-sum", "k3+")])
def test_actor_loss_is_verls(loss_agg_mode, kl_loss_type):
    """verl's own actor loss (``ppo_loss``: the policy loss, ``use_kl_loss`` with
    ``kl_loss_type`` / ``kl_loss_coef``, ``entropy_coeff``) on the log-probs and entropy of
    each backend: verl's ``vanilla`` on its torch backend against ``rlfuse_vanilla`` on
    rlfuse's, each against verl's ``vanilla`` on the model's own float64 logits (three-way);
    the total loss, every metric and every parameter's gradient."""
    base = tiny("qwen2", torch.float32)
    prompts, responses, ids, positions = packed_batch()
    labels = torch.roll(ids, -1, -1)[0]

    def own_outputs(net, **inputs):
        z = torch.log_softmax(_OWN[type(net)](net, **inputs).logits[0] / 0.7, -1)
        return z.gather(-1, labels[:, None])[:, 0], -(z.exp() * z).sum(-1)

    def backend_outputs(net, **inputs):
        out = net(temperature=0.7, return_dict=True, **inputs)
        return out.log_probs[0], out.entropy[0]

    results = []
    for backend, mode, dtype in (("torch", "vanilla", torch.float32),
                                 ("rlfuse", "rlfuse_vanilla", torch.float32),
                                 (None, "vanilla", torch.float64)):
        net = copy.deepcopy(base).to(dtype)
        outputs = own_outputs if backend is None else backend_outputs
        if backend is not None:
            patched(net, backend)
        config = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                             ppo_mini_batch_size=1, loss_agg_mode=loss_agg_mode,
                             use_kl_loss=True, kl_loss_type=kl_loss_type, kl_loss_coef=0.1,
                             entropy_coeff=0.01, policy_loss={"loss_mode": mode})
        logp, entropy = outputs(net, input_ids=ids, position_ids=positions, use_cache=False)
        loss, metrics = ppo_loss(config, {"log_probs": logp, "entropy": entropy},
                                 actor_data(prompts, responses, dtype))
        grads = torch.autograd.grad(loss, list(net.parameters()))
        metrics = {key: float(m.aggregate()) if hasattr(m, "aggregate") else m
                   for key, m in metrics.items()}
        results.append((loss.detach(), metrics, grads))
    theirs, ours, ref64 = results
    assert_three_way(ours[0], theirs[0], ref64[0], "loss")
    assert set(ours[1]) == set(theirs[1]) | {"actor/rlfuse_overflow", "actor/rlfuse_fused"}
    assert ours[1]["actor/rlfuse_fused"] == 1.0          # the kernels ran
    for key, want in theirs[1].items():
        assert ours[1][key] == pytest.approx(want, **APPROX["fp32_metric"]), key
    for (name, _), got, want, want64 in zip(base.named_parameters(), ours[2], theirs[2],
                                             ref64[2]):
        assert_three_way(got, want, want64, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_backend(dtype, monkeypatch):
    """``fused_kernels_backend="rlfuse_batch_invariant"``: a batch-invariant head
    (``LinearHead(..., batch_invariant=True)``), so a sequence's log-probs and entropy are the
    same bits alone and in a batch (verl's old-log-prob and training passes over other
    micro-batches); they equal the ``rlfuse`` backend's within the three-way rule."""
    heads = []
    monkeypatch.setattr(rlfuse, "LinearHead", lambda *a, _cls=rlfuse.LinearHead, **k:
                        heads.append(_cls(*a, **k)) or heads[-1])
    base = tiny("qwen2", dtype)
    net = patched(copy.deepcopy(base), rlfuse_backend.BATCH_INVARIANT)
    assert net._verl_fused_kernels_backend == "rlfuse_batch_invariant"
    ids = torch.randint(0, V, (3, 7), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(7).expand(3, 7)

    def results(model, rows):
        out = model(input_ids=ids[rows], position_ids=positions[rows], use_cache=False,
                    return_dict=True)
        return out.log_probs.detach(), out.entropy.detach()

    batch = results(net, slice(None))
    assert heads and all(head.batch_invariant for head in heads)
    for rows in (slice(1, 2), slice(0, 2), slice(2, 3)):
        for got, want in zip(results(net, rows), batch):
            assert torch.equal(got, want[rows])
    plain = results(patched(copy.deepcopy(base), "rlfuse"), slice(None))
    own = _OWN[type(base)](copy.deepcopy(base).double(), input_ids=ids, position_ids=positions,
                           use_cache=False).logits
    z = torch.log_softmax(own, -1)
    ref64 = (z[:, :-1].gather(-1, ids[:, 1:, None])[..., 0], -(z.exp() * z).sum(-1))
    for name, got, want, want64 in zip(("log_probs", "entropy"), batch, plain, ref64):
        got, want = (x[:, :-1] if name == "log_probs" else x for x in (got, want))
        assert_three_way(got, want, want64, name, atol_dtype=dtype)


def test_other_backends_stay_verls():
    """Every other backend is verl's own choice (``triton``, ``torch``, none)."""
    net = patched(tiny("qwen2", torch.float32), "torch")
    assert net._verl_fused_kernels_backend == "torch" and not hasattr(net, "_rlfuse_head")
    net = tiny("qwen2", torch.float32)
    monkey_patch.patch_forward_with_backends(net, use_fused_kernels=False,
                                             fused_kernels_backend="rlfuse")
    assert not hasattr(net, "_verl_fused_kernels_backend")
    with pytest.raises(ValueError, match="Unsupported FusedLinearForPPO backend"):
        torch_functional.FusedLinearForPPO(impl_backend="nope")


def test_a_head_rlfuse_does_not_know_is_refused():
    """A model whose forward does something after its output head that its config does not
    say: the patch raises, naming what differs."""
    class Doubled(transformers.Qwen2ForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = 2 * out.logits
            return out

    torch.manual_seed(0)
    net = Doubled(transformers.Qwen2Config(**TINY))
    with pytest.raises(ValueError, match="does something after the backbone"):
        patched(net, "rlfuse")


def test_a_model_that_cannot_run_here_is_patched_with_a_warning():
    """Where the model's own forward cannot run the check's short input (a flash-attention
    model on the CPU, where verl patches it), the patch warns that the head is its config's."""
    class CudaOnly(transformers.Qwen2ForCausalLM):
        def forward(self, *args, **kwargs):
            raise RuntimeError("FlashAttention only supports CUDA")

    torch.manual_seed(0)
    net = CudaOnly(transformers.Qwen2Config(**TINY))
    with pytest.warns(UserWarning, match="without the check against its own logits"):
        patched(net, "rlfuse")
    assert net._verl_fused_kernels_backend == "rlfuse"


def test_bad_calls():
    net = patched(tiny("qwen2", torch.float32), "rlfuse")
    hidden = torch.randn(1, 5, 16)
    ids = torch.randint(0, V, (1, 5))
    with pytest.raises(ValueError, match="impl_backend"):
        torch_functional.FusedLinearForPPO(impl_backend="rlfuse")(hidden, net.lm_head.weight, ids)
    fused = torch_functional.FusedLinearForPPO(impl_backend=net._verl_fused_kernels_backend)
    with pytest.raises(ValueError, match="vocab_weights"):
        fused(hidden, net.lm_head.weight.clone(), ids)
    with pytest.raises(ValueError, match="labels"):
        fused(hidden, net.lm_head.weight, ids[:, :4])
    with pytest.raises(ValueError, match="reduction"):
        rlfuse_verl.linear_cross_entropy(hidden, net.lm_head.weight, ids, 1.0, "max")


# --------------------------------------------------------------------------------------------
# Distillation in verl's FSDP engine
# --------------------------------------------------------------------------------------------

K = 5


class OwnForward(torch.nn.Module):
    """A model through its own forward (its logits: verl's engine without fused kernels)."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, **inputs):
        return _OWN[type(self.net)](self.net, **inputs)


def engine_of(module):
    """verl's FSDP engine (its ``prepare_model_inputs`` / ``prepare_model_outputs``, as its
    ``forward_step`` runs them) around ``module``, one process, no sequence parallelism."""
    from verl.utils import torch_functional as verl_F
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    engine = FSDPEngineWithLMHead.__new__(FSDPEngineWithLMHead)
    engine.compute_entropy_from_logits = verl_F.entropy_from_logits
    engine.module, engine.use_ulysses_sp, engine.pad_to_length = module, False, None
    engine.engine_config = types.SimpleNamespace(entropy_checkpointing=False,
                                                 entropy_from_logits_with_chunking=False)
    return engine


def distill_data(prompts, responses, loss_mode, dtype, fused, seed=0):
    """verl's packed micro-batch with the teacher's outputs as its distillation pipeline hands
    them over: top-k ids and log-probs ``[len, K]`` per sequence (``forward_kl_topk``), or the
    sampled tokens' log-probs ``[len, 1]`` (the estimators)."""
    from verl.utils.dataset.dataset_utils import DatasetPadMode

    gen = torch.Generator().manual_seed(seed + 5)
    seqs = [torch.cat(pair) for pair in zip(prompts, responses)]
    top = [torch.log_softmax(3 * torch.randn(len(s), V, generator=gen, dtype=torch.float64), -1)
           .topk(K if loss_mode == "forward_kl_topk" else 1, -1) for s in seqs]
    data = actor_data(prompts, responses, dtype, seed)

    def nested(xs):
        return torch.nested.as_nested_tensor(xs, layout=torch.jagged)

    data["input_ids"] = nested(seqs)
    data["position_ids"] = nested([torch.arange(len(s)) for s in seqs])
    data["teacher_ids"] = nested([t.indices for t in top])
    data["teacher_logprobs"] = nested([t.values.to(dtype) for t in top])
    tu.assign_non_tensor(data, use_remove_padding=True, use_fused_kernels=fused,
                         distillation_use_topk=loss_mode == "forward_kl_topk",
                         calculate_entropy=True, temperature=0.7,
                         pad_mode=DatasetPadMode.NO_PADDING)
    return data


def distill_loss_fn(loss_mode, task_rewards, min_clamp=-4.0):
    from verl.trainer.distillation import distillation_ppo_loss
    from verl.workers.config import DistillationLossConfig

    loss = DistillationLossConfig(loss_mode=loss_mode, topk=K, use_task_rewards=task_rewards,
                                  use_policy_gradient=False, log_prob_min_clamp=min_clamp,
                                  distillation_loss_coef=0.5)
    config = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                         ppo_mini_batch_size=1, loss_agg_mode="token-mean", entropy_coeff=0.01,
                         policy_loss={"loss_mode": "vanilla"})
    return functools.partial(distillation_ppo_loss, config=config,
                             distillation_config=types.SimpleNamespace(distillation_loss=loss))


def engine_step(engine, data, loss_fn):
    """One micro-batch through the engine as ``forward_step`` runs it: the loss, metrics and
    the model's outputs."""
    inputs, args = engine.prepare_model_inputs(micro_batch=data)
    output = engine.module(**inputs, use_cache=False)
    model_output = engine.prepare_model_outputs(output, args, data, loss_fn)
    return (*loss_fn(model_output=model_output, data=data), model_output)


def float64_step(net64, data, loss_fn, loss_mode):
    """verl's loss on outputs computed in float64 from the model's own logits (the definition
    of ``compute_forward_kl_topk``, clamped as verl clamps)."""
    values = data["input_ids"].values()[None]
    logits = _OWN[type(net64)](net64, input_ids=values, position_ids=data["position_ids"]
                               .values()[None], use_cache=False).logits[0]
    z = torch.log_softmax(logits / 0.7, -1)
    offsets = data["input_ids"].offsets()

    def nested(x):
        return torch.nested.nested_tensor_from_jagged(x, offsets)

    labels = torch.roll(values[0], -1)
    out = {"log_probs": nested(z.gather(-1, labels[:, None])[:, 0]),
           "entropy": nested(-(z.exp() * z).sum(-1))}
    if loss_mode == "forward_kl_topk":
        ids, t = data["teacher_ids"].values(), data["teacher_logprobs"].values().double()
        s = z.gather(-1, ids)
        out["student_mass"], out["teacher_mass"] = nested(s.exp().sum(-1)), nested(t.exp().sum(-1))
        s, t = s.clamp_min(-4.0), t.clamp_min(-4.0)
        out["distillation_losses"] = nested((t.exp() * (t - s)).sum(-1))
    return (*loss_fn(model_output=out, data=data), out)


@pytest.mark.parametrize("loss_mode, task_rewards, autocast", [
    ("forward_kl_topk", False, False), ("forward_kl_topk", True, False), ("k3", False, False),
    ("forward_kl_topk", False, True)])
def test_distillation_is_verls(loss_mode, task_rewards, autocast):
    """verl's distillation (``distillation_ppo_loss``) in its FSDP engine's packed forward:
    with the ``rlfuse`` backend (fused kernels: the top-k divergence and its masses from the
    head by rlfuse, the teacher's top-k handed to the model as verl's veomni engine hands it;
    the estimators from rlfuse's log-probs) against verl's own forward from the logits (its
    logits processor), each against float64 (three-way): the loss, every metric, every
    parameter's gradient; with task rewards the policy loss and entropy bonus beside it; under
    bf16 autocast (verl's default mixed precision) the fused kernels' fp32 beside verl's bf16
    logits."""
    base = tiny("qwen2", torch.float32)
    prompts, responses, _, _ = packed_batch()
    loss_fn = distill_loss_fn(loss_mode, task_rewards)
    results = []
    for backend, dtype in (("rlfuse", torch.float32), (None, torch.float32),
                           (None, torch.float64)):
        net = copy.deepcopy(base).to(dtype)
        data = distill_data(prompts, responses, loss_mode, dtype, backend is not None)
        if dtype == torch.float64:
            loss, metrics, outputs = float64_step(net, data, loss_fn, loss_mode)
        else:
            module = patched(net, backend) if backend else OwnForward(net)
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                loss, metrics, outputs = engine_step(engine_of(module), data, loss_fn)
        grads = torch.autograd.grad(loss, list(net.parameters()))
        metrics = {key: float(m.aggregate()) if hasattr(m, "aggregate") else float(m)
                   for key, m in metrics.items()}
        per_token = {key: x.values().detach().float() for key, x in outputs.items()
                     if key in ("distillation_losses", "student_mass", "teacher_mass")}
        results.append((loss.detach(), metrics, grads, per_token))
    ours, theirs, ref64 = results
    assert_three_way(ours[0], theirs[0], ref64[0], "loss")
    for key in ours[3]:
        assert_three_way(*(r[3][key] for r in results), key)
    # the top-k overlap diagnostics need the student's own top-k ids: verl's logits path only
    # (its fused veomni path does not give them either)
    overlap = {"distillation/overlap_ratio", "distillation/overlap_token_advantage"}
    assert set(ours[1]) == set(theirs[1]) - overlap
    assert ref64[1].keys() == ours[1].keys()
    for key in ours[1] if not autocast else ():   # under autocast: the per-token values
        assert_three_way(*(torch.tensor(r[1][key]) for r in results), key)
    for (name, _), got, want, want64 in zip(base.named_parameters(), ours[2], theirs[2],
                                             ref64[2]):
        assert_three_way(got, want, want64, name)


def test_distillation_refuses_what_it_cannot_do():
    """Top-k distillation with fused kernels takes verl's packed rows; the outputs need the
    distillation config the engine's loss function is bound to."""
    prompts, responses, _, _ = packed_batch()
    net = patched(tiny("qwen2", torch.float32), "rlfuse")
    data = distill_data(prompts, responses, "forward_kl_topk", torch.float32, True)
    tu.assign_non_tensor(data, use_remove_padding=False)
    with pytest.raises(ValueError, match="use_remove_padding"):
        engine_of(net).prepare_model_inputs(micro_batch=data)
    teacher = rlfuse.TopK(data["teacher_ids"].values()[None],
                          data["teacher_logprobs"].values()[None])
    with pytest.raises(ValueError, match="logits_processor_func"):
        rlfuse_backend.top_k_distillation(None, teacher, lambda **kw: None)
