"""rlfuse in TRL's distillation (the real package): RLFuseDistillationTrainer's loss, every
parameter's gradient and its ``entropy`` metric against TRL 1.16's own DistillationTrainer on
the same generation batch, for each ``beta`` and temperature, gradient accumulation's global
token count, scaled and soft-capped heads, TRL's default precision (bf16), and the real
training loop."""
import copy
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import TOL, assert_three_way, integration, process_env

trl = integration("trl")
transformers = integration("transformers")
integration("rlfuse.integrations.trl")      # TRL's trainers, with all they import

from rlfuse.integrations.trl import (RLFuseDistillationConfig,  # noqa: E402
                                     RLFuseDistillationTrainer)
from test_trl import (ENGINES, TINY, _fsdp_on_the_cpu, assert_trained_as_trl,  # noqa: E402
                      dataset, eos_model, head_model, tokenizer)


def student(seed=0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))


def teacher(seed=1):
    """A wider teacher over the same vocabulary, its head with a bias."""
    torch.manual_seed(seed)
    net = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **dict(TINY, hidden_size=24, intermediate_size=48)))
    net.lm_head = torch.nn.Linear(24, TINY["vocab_size"], bias=True)
    return net


def config(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4,
                max_completion_length=4, max_steps=2, learning_rate=1e-2, logging_steps=1,
                report_to="none", use_cpu=True, save_strategy="no", seed=0)
    base.update(kw)
    return base


def trainers(tmp_path, nets=None, **kw):
    """TRL's trainer and rlfuse's on copies of one student and one teacher, with one config."""
    nets = nets or (student(), teacher())
    data, tok = dataset(), tokenizer()
    theirs = trl.DistillationTrainer(
        model=copy.deepcopy(nets[0]), teacher_model=copy.deepcopy(nets[1]),
        args=trl.DistillationConfig(**config(tmp_path, **kw)), train_dataset=data,
        processing_class=tok)
    ours = RLFuseDistillationTrainer(
        model=copy.deepcopy(nets[0]), teacher_model=copy.deepcopy(nets[1]),
        args=RLFuseDistillationConfig(**config(tmp_path, **kw), rlfuse_chunk_tokens=5),
        train_dataset=data, processing_class=tok)
    theirs.model.train()
    inputs = theirs._generate_and_score_completions([data[i] for i in range(4)])
    return theirs, ours, inputs


def step(trainer, inputs):
    """The loss, every gradient and the logged entropy of one compute_loss."""
    trainer.model.train()
    trainer.model.zero_grad()
    with trainer.compute_loss_context_manager():
        loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()
             if p.grad is not None}
    return loss.detach(), grads, trainer._metrics["train"]["entropy"][-1]


def assert_same_step(theirs, ours, inputs):
    (want, want_grads, want_entropy), (got, got_grads, got_entropy) = \
        step(theirs, inputs), step(ours, inputs)
    torch.testing.assert_close(got, want, **TOL["fp32_chain"])
    assert got_entropy == pytest.approx(want_entropy, rel=1e-5)
    assert got_grads.keys() == want_grads.keys() and want_grads
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], **TOL["fp32_matmul"],
                                   msg=name)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_reproduces_trl(beta, temperature, tmp_path):
    """fp32: the loss, every gradient and the entropy metric equal TRL's, a wider teacher with
    a biased head."""
    theirs, ours, inputs = trainers(tmp_path, beta=beta, temperature=temperature, bf16=False)
    assert_same_step(theirs, ours, inputs)


def test_gradient_accumulation_divides_by_the_global_count(tmp_path):
    """Under accumulation TRL divides each micro-batch's sum by the tokens of all of them
    (``num_items_in_batch``): so does rlfuse's loss."""
    theirs, ours, inputs = trainers(tmp_path, bf16=False, gradient_accumulation_steps=2)
    inputs["num_items_in_batch"] = inputs["num_items_in_batch"] * 3
    assert_same_step(theirs, ours, inputs)


@pytest.mark.parametrize("name", ["gemma2", "cohere", "granite"])
def test_model_heads_reproduce_trl(name, tmp_path):
    """A student and a teacher whose forwards scale or softcap their logits after the head."""
    theirs, ours, inputs = trainers(tmp_path, nets=(head_model(name), head_model(name, seed=1)),
                                    bf16=False, beta=0.5)
    assert_same_step(theirs, ours, inputs)


def test_default_precision(tmp_path):
    """TRL's default config (bf16 on): the first step's loss and gradients keep the three-way
    rule against TRL's fp32 run, TRL's own bf16 run the yardstick; then the real loop trains,
    its logged losses and entropies finite."""
    default = trl.DistillationConfig(**config(tmp_path))
    assert default.bf16, "TRL's default precision changed"
    nets = (student(), teacher())
    theirs32, _, inputs = trainers(tmp_path, nets=nets, bf16=False)   # one generation batch
    results = [step(theirs32, inputs)]
    theirs, ours, _ = trainers(tmp_path, nets=nets)     # (accelerate's state: the last built)
    assert ours.accelerator.mixed_precision == "bf16"
    for trainer in (ours, theirs):
        with trainer.accelerator.autocast():
            results.append(step(trainer, inputs))
    (ref32, ref32_g, _), (got, got_g, _), (ref, ref_g, _) = results
    assert not torch.equal(ref, ref32)      # TRL's default run is a bf16 one
    assert_three_way(got, ref, ref32, "loss", atol_dtype=torch.bfloat16)
    for name in ref32_g:
        assert_three_way(got_g[name], ref_g[name], ref32_g[name], name,
                         atol_dtype=torch.bfloat16)
    ours.train()
    logged = [h for h in ours.state.log_history if "loss" in h]
    assert len(logged) == 2
    assert all(math.isfinite(h["loss"]) and math.isfinite(h["entropy"]) for h in logged)
    assert all(h["rlfuse/fused"] == 1.0 for h in logged)   # the kernels ran, and it is logged


def test_batch_invariant_heads_under_the_default_precision(tmp_path, monkeypatch):
    """``rlfuse_batch_invariant=True`` with TRL's default config (bf16 autocast): the first
    step's loss and gradients keep the three-way rule against TRL's fp32 run, TRL's own bf16
    run the yardstick, through the batch-invariant heads' tiles."""
    from rlfuse.integrations.trl import distill

    seen, loss_fn = [], distill.chunked_divergence_loss

    def spy(*args, **kwargs):
        seen.append(kwargs["batch_invariant"])
        return loss_fn(*args, **kwargs)

    monkeypatch.setattr(distill, "chunked_divergence_loss", spy)
    nets = (student(), teacher())
    theirs32, _, inputs = trainers(tmp_path, nets=nets, bf16=False)
    results = [step(theirs32, inputs)]
    theirs, ours, _ = trainers(tmp_path, nets=nets)
    ours.args.rlfuse_batch_invariant = True
    assert ours.accelerator.mixed_precision == "bf16"
    for trainer in (ours, theirs):
        with trainer.accelerator.autocast():
            results.append(step(trainer, inputs))
    assert seen == [True], seen
    (ref32, ref32_g, _), (got, got_g, _), (ref, ref_g, _) = results
    assert_three_way(got, ref, ref32, "loss", atol_dtype=torch.bfloat16)
    for name in ref32_g:
        assert_three_way(got_g[name], ref_g[name], ref32_g[name], name,
                         atol_dtype=torch.bfloat16)


def _distributed_worker(out_dir: str, engine: str) -> None:
    """One process of ``torchrun --nproc_per_node 2 tests/test_trl_distill.py DIR ENGINE``: two
    SGD steps of TRL's trainer, then of rlfuse's, under ``engine`` (DDP or FSDP2 through
    accelerate, gloo), each rank on its own prompts, completions of different lengths; rank 0
    writes each one's whole parameters and logs."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if engine.startswith("fsdp"):
        _fsdp_on_the_cpu()
    kw = config(out_dir, optim="sgd", beta=0.5, bf16=False, **ENGINES[engine])
    for kind in ("trl", "rlfuse"):
        make, make_config = ((trl.DistillationTrainer, trl.DistillationConfig) if kind == "trl"
                             else (RLFuseDistillationTrainer, RLFuseDistillationConfig))
        trainer = make(model=eos_model(), teacher_model=teacher(), args=make_config(**kw),
                       train_dataset=dataset(16), processing_class=tokenizer())
        trainer.train()
        state = trainer.accelerator.get_state_dict(trainer.model)
        if trainer.accelerator.is_main_process:
            torch.save({k: v.detach().cpu() for k, v in state.items()},
                       os.path.join(out_dir, f"{engine}-{kind}.pt"))
            with open(os.path.join(out_dir, f"{engine}-{kind}.json"), "w") as f:
                json.dump({"processes": trainer.accelerator.num_processes,
                           "wrapper": "ddp" if isinstance(trainer.model_wrapped,
                                                          DistributedDataParallel)
                           else "fsdp2" if isinstance(trainer.model, FSDPModule) else "none",
                           "logs": trainer.state.log_history}, f)
        trainer.accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_engines_train_as_trl(engine, tmp_path):
    """DDP and FSDP2 (the heads' weights sharded, gathered whole once per step as TRL does) over
    two gloo processes whose completions end at different lengths: rlfuse's trainer ends with
    TRL's own parameters after the same logged losses, gradient norms and entropies."""
    env = process_env(OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--standalone", __file__, str(tmp_path), engine],
        env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (theirs, want), (ours, got) = [
        (json.loads((tmp_path / f"{engine}-{kind}.json").read_text()),
         torch.load(tmp_path / f"{engine}-{kind}.pt")) for kind in ("trl", "rlfuse")]
    assert theirs["processes"] == ours["processes"] == 2
    assert theirs["wrapper"] == ours["wrapper"] == engine
    lengths = [s["completions/mean_length"] for s in theirs["logs"] if "grad_norm" in s]
    assert min(lengths) < 4      # some completions end early: the processes' tokens differ
    assert_trained_as_trl(theirs, want, ours, got, ("loss", "grad_norm", "entropy"))


if __name__ == "__main__":
    _distributed_worker(*sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_batch_invariant_heads(tmp_path):
    """``rlfuse_batch_invariant=True``: the trainer's loss equals TRL's (as without it), and
    its loss function (``chunked_divergence_loss``) gives each position's student hidden-state
    gradient the same bits in the batch and in a sub-batch, for any chunking."""
    from rlfuse.integrations.trl import distill

    theirs, ours, inputs = trainers(tmp_path, beta=0.5, bf16=False)
    ours.args.rlfuse_batch_invariant = True
    seen = []
    loss_fn = distill.chunked_divergence_loss

    def spy(*args, **kwargs):
        seen.append(kwargs["batch_invariant"])
        return loss_fn(*args, **kwargs)

    distill.chunked_divergence_loss = spy
    try:
        assert_same_step(theirs, ours, inputs)
    finally:
        distill.chunked_divergence_loss = loss_fn
    assert seen == [True]
    g = torch.Generator().manual_seed(2)
    h_s = torch.randn(5, 6, TINY["hidden_size"], generator=g)
    h_t = torch.randn(5, 6, 24, generator=g)
    w_s = torch.randn(TINY["vocab_size"], TINY["hidden_size"], generator=g)
    w_t = torch.randn(TINY["vocab_size"], 24, generator=g)
    mask = torch.rand(5, 6, generator=g) > 0.2
    grads = []
    for rows, chunk in ((slice(None), 4), (slice(1, 3), 64), (slice(1, 3), 1)):
        leaf = h_s[rows].clone().requires_grad_()
        loss, _, _ = loss_fn(leaf, h_t[rows], w_s, w_t, mask[rows], 0.5,
                             num_items_in_batch=torch.tensor(20.0), chunk_tokens=chunk,
                             batch_invariant=True)
        (grad,) = torch.autograd.grad(loss, leaf)
        grads.append(grad)
    assert torch.equal(grads[0][1:3], grads[1]) and torch.equal(grads[1], grads[2])
