"""Compile-ready ops: torch.compile(fullgraph=True) over every op and policy form (packed rows
included; the vocabulary split in ``vocab_split_worker.py``, which needs a process group),
opcheck on every custom op, no graph break, no host read with ``validate=False``; CUDA graphs on
a GPU."""
import contextlib
from types import SimpleNamespace

import pytest
import torch

import rlfuse
from rlfuse.divergences import JSD
from rlfuse.fused_losses.logits import distill, logprobs, scale_rows
from rlfuse.fused_losses import ggpo, gr_opd, kl, regions, surrogate, top_k
from rlfuse.fused_losses.head import head_logits, linear_distill, linear_head

from conftest import TOL
from vocab_split_worker import SPLIT_OPS

B, T, V, M, H = 4, 5, 37, 2, 8   # an odd vocabulary; two groups of two; hidden size 8


def make_inputs(device, seed=0, *, batch=B, time=T):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.rand(*shape, generator=gen)

    mask = rand(batch, time) > 0.3
    mask[:, 0] = True
    old = -rand(batch, time) * 3
    x = dict(logits=torch.randn(batch, time + 1, V, generator=gen) * 2,   # policy: [:, :-1]
             lp=torch.cat([old + 0.3 * torch.randn(batch, time, generator=gen), old[:, :1]], 1),
             targets=torch.randint(0, V, (batch, time), generator=gen), mask=mask, old=old,
             ref=old - 0.2 * rand(batch, time), teacher=old - rand(batch, time),
             adv=torch.randn(batch, generator=gen), rewards=(rand(batch) > 0.5).float(),
             hidden=torch.randn(batch, time + 1, H, generator=gen),         # head: rows 1..T
             weight=torch.randn(V, H, generator=gen) * 0.5, bias=0.1 * torch.randn(V, generator=gen))
    return SimpleNamespace(**{k: v.to(device) for k, v in x.items()})


def packed(x, rows: int, first: int):
    """``(targets [B (T+1)], index)`` of the ``[B, T + 1, ...]`` rows flattened: row ``first +
    t`` of each sequence predicts its token t, the other row predicts nothing (-1)."""
    batch, time = x.targets.shape
    s = torch.arange(rows, device=x.targets.device)
    t = s - first
    inside = (t >= 0) & (t < time)
    index = torch.where(inside, torch.arange(batch, device=s.device)[:, None] * time + t, -1)
    targets = x.targets.gather(1, t.clamp(0, time - 1).expand(batch, rows))
    return targets.reshape(-1), index.reshape(-1)


def policy_of(leaf, x, form, **kw):
    """The policy of a leaf: log-probs (a [:, :-1] view), logits (the whole [B, T+1, V], rows
    0..T-1 used) or a linear head over hidden states (rows 1..T, chunks of 7 tokens), and the
    same rows packed (``index``)."""
    if form in ("head", "invariant_head"):
        return rlfuse.LinearHead(leaf, x.weight, x.targets, x.bias, 0.9, offset=1,
                                 chunk_tokens=7, batch_invariant=form == "invariant_head")
    if form == "logits":
        return rlfuse.Logits(leaf, x.targets, 0.9, **kw)
    if form == "packed_logits":
        targets, index = packed(x, leaf.shape[1], 0)
        return rlfuse.Logits(leaf.reshape(-1, leaf.shape[-1]), targets, 0.9, index=index)
    if form == "packed_head":
        targets, index = packed(x, leaf.shape[1], 1)
        return rlfuse.LinearHead(leaf.reshape(-1, leaf.shape[-1]), x.weight, targets, x.bias,
                                 0.9, chunk_tokens=7, index=index)
    return leaf[:, :-1]


def _loss(out):
    return out.loss, dict(out.metrics)


# name -> (forms, step(leaf, x, form) -> (scalar to differentiate, {name: tensor to compare}))
STEPS = {
    "token_logprobs": (("logits",), lambda leaf, x, form: (
        lambda lp, ent: (lp.sum() + 0.5 * ent.sum(), {"logp": lp, "entropy": ent}))(
            *rlfuse.token_logprobs(leaf[:, :-1], x.targets, mask=x.mask, temperature=0.9,
                                   return_entropy=True, validate=False))),
    "token_logprobs_invariant": (("logits",), lambda leaf, x, form: (
        lambda lp, ent: (lp.sum() + 0.5 * ent.sum(), {"logp": lp, "entropy": ent}))(
            *rlfuse.token_logprobs(leaf[:, :-1], x.targets, mask=x.mask, temperature=0.9,
                                   return_entropy=True, validate=False,
                                   batch_invariant=True))),
    "distill_top_k": (("logits", "head", "packed_logits"), lambda leaf, x, form: _loss(
        rlfuse.distill_loss(
            policy_of(leaf, x, form), rlfuse.TopK(x.targets[..., None] % 3 + torch.arange(
                2, device=x.targets.device), torch.full((*x.targets.shape, 2), -1.5,
                                                       device=x.targets.device)),
            x.mask, rlfuse.divergences.ForwardKL(-4.0), validate=False))),
    "distill": (("logits", "head"), lambda leaf, x, form: _loss(rlfuse.distill_loss(
        rlfuse.Logits(leaf, x.targets, 0.9) if form == "logits" else policy_of(leaf, x, form),
        rlfuse.Logits(x.logits.flip(0), x.targets, 1.25) if form == "logits" else
        rlfuse.LinearHead(x.hidden.flip(0), x.weight, x.targets, x.bias, 1.25, offset=1,
                          softcap=2.0),
        x.mask, rlfuse.divergences.JSD(0.3), validate=False))),
    "policy_logprobs": (("logits", "head", "invariant_head", "packed_logits"),
                        lambda leaf, x, form: (
        lambda lp, ent: (lp.sum() + 0.5 * ent.sum(), {"logp": lp, "entropy": ent}))(
            *rlfuse.policy_logprobs(policy_of(leaf, x, form), return_entropy=True,
                                    validate=False))),
    "ggpo": (("logprobs", "logits", "head"), lambda leaf, x, form: _loss(rlfuse.ggpo_loss(
        policy_of(leaf, x, form), x.ref, x.rewards, x.mask, group_size=M, beta=0.5,
        validate=False))),
    "ggpo_clipped": (("logprobs",), lambda leaf, x, form: _loss(rlfuse.ggpo_loss(
        policy_of(leaf, x, form), x.ref, x.rewards, x.mask, group_size=M, beta=0.5,
        clip_radius=0.1, num_tokens=11.0, validate=False))),
    "gppo": (("logprobs", "logits", "head", "packed_head"), lambda leaf, x, form: _loss(
        rlfuse.gppo_loss(
            policy_of(leaf, x, form), x.old, x.adv, x.mask, geometry="tv", topology="binary",
            delta=0.1, agg="seq-mean-token-mean", validate=False))),
    "gppo_inplace": (("logits",), lambda leaf, x, form: _loss(rlfuse.gppo_loss(
        policy_of(leaf, x, form, inplace_backward=True), x.old, x.adv, x.mask,
        validate=False))),
    "gr_opd": (("logprobs", "logits", "head"), lambda leaf, x, form: _loss(rlfuse.gr_opd_loss(
        policy_of(leaf, x, form), x.old, x.teacher, x.mask, group_size=M, validate=False))),
    "ppo": (("logprobs", "logits", "head", "invariant_head", "packed_logits", "packed_head"),
            lambda leaf, x, form: _loss(rlfuse.ppo_loss(
                policy_of(leaf, x, form), x.old, x.adv, x.mask, clip=(0.2, 0.28), dual_clip=3.0,
                agg="seq-mean-token-mean", validate=False))),
    "gspo": (("logits", "head"), lambda leaf, x, form: _loss(rlfuse.ppo_loss(
        policy_of(leaf, x, form), x.old, x.adv, x.mask, ratio_level="sequence",
        validate=False))),
}
CASES = [(name, form) for name, (forms, _) in STEPS.items() for form in forms]


def run_step(step, x, form, dtype=torch.float32):
    leaf = {"logits": x.logits, "head": x.hidden, "invariant_head": x.hidden,
            "packed_logits": x.logits, "packed_head": x.hidden}.get(form, x.lp)
    leaf = leaf.to(dtype).clone().requires_grad_(True)
    scalar, outputs = step(leaf, x, form)
    (grad,) = torch.autograd.grad(scalar * 1.5, leaf)
    return scalar.detach(), {k: v.detach() for k, v in outputs.items()}, grad


def assert_same(eager, compiled, exact):
    kw = TOL["exact"] if exact else TOL["fp32_sum"]
    torch.testing.assert_close(compiled[0], eager[0], **kw)
    assert compiled[1].keys() == eager[1].keys()
    for name in eager[1]:
        torch.testing.assert_close(compiled[1][name], eager[1][name], **kw, msg=name)
    torch.testing.assert_close(compiled[2], eager[2], **kw)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("name, form", CASES)
def test_compiled_step_equals_eager(name, form, backend, device):
    """Forward and backward of every op in every policy form traced into one graph. aot_eager
    runs the same kernels and the same torch ops: bit-identical. Inductor fuses the torch ops
    around the kernels (metrics, weights) in its own order: equal to rounding."""
    torch._dynamo.reset()
    step, x = STEPS[name][1], make_inputs(device)
    eager = run_step(step, x, form)
    compiled = run_step(torch.compile(step, backend=backend, fullgraph=True), x, form)
    assert_same(eager, compiled, exact=backend == "aot_eager")


def test_compiled_step_with_new_shapes(device):
    """A second shape recompiles with symbolic sizes: the fake implementations take them."""
    torch._dynamo.reset()
    step = STEPS["gppo"][1]
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=True)
    for seed, (batch, time) in enumerate([(4, 5), (6, 3), (2, 9)]):
        x = make_inputs(device, seed, batch=batch, time=time)
        for form in ("logprobs", "logits"):
            assert_same(run_step(step, x, form), run_step(compiled, x, form), exact=True)


def test_compiled_fp16_logits_take_the_two_pass_path(device):
    torch._dynamo.reset()
    step, x = STEPS["gr_opd"][1], make_inputs(device, 3)
    eager = run_step(step, x, "logits", torch.float16)
    compiled = run_step(torch.compile(step, backend="aot_eager", fullgraph=True), x, "logits",
                        torch.float16)
    assert_same(eager, compiled, exact=True)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_bounds_and_advantages(backend, device):
    torch._dynamo.reset()
    x = make_inputs(device, 4)

    def fn(old, teacher, mask):
        lo, hi = rlfuse.gppo_bounds(old, geometry="hellinger", topology="binary", delta=0.1)
        adv = rlfuse.gr_opd_advantages(old, teacher, mask, group_size=M, validate=False)
        return lo, hi, adv

    eager = fn(x.old, x.teacher, x.mask)
    compiled = torch.compile(fn, backend=backend, fullgraph=True)(x.old, x.teacher, x.mask)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b, a, **TOL["exact"])


def test_no_graph_break(device):
    """A training step over a model head: one graph, no break."""
    torch._dynamo.reset()
    x = make_inputs(device, 5)
    head = torch.nn.Linear(8, V).to(device)
    hidden = torch.randn(B, T, 8, device=device)

    def train_step(hidden):
        logits = head(hidden)
        lp = rlfuse.token_logprobs(logits, x.targets, mask=x.mask, validate=False)
        out = rlfuse.gppo_loss(rlfuse.Logits(logits, x.targets), lp.detach(), x.adv, x.mask,
                               validate=False)
        return out.loss + rlfuse.ggpo_loss(lp, x.ref, x.rewards, x.mask, group_size=M,
                                           beta=0.5, validate=False).loss

    explanation = torch._dynamo.explain(train_step)(hidden)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, \
        explanation.break_reasons


def test_validate_under_compile_still_checks(device):
    """validate=True reads [B, T] values on the host: under torch.compile that is a graph break
    (so fullgraph=True needs validate=False), and the checks still raise."""
    torch._dynamo.reset()
    x = make_inputs(device, 6)

    def fn(lp, mask):
        return rlfuse.gppo_loss(lp, x.old, x.adv, mask).loss

    lp = x.lp[:, :-1]
    with pytest.raises(Exception, match="[Dd]ata.dependent|graph break|Unsupported"):
        torch.compile(fn, backend="aot_eager", fullgraph=True)(lp, x.mask)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager")
    torch.testing.assert_close(compiled(lp, x.mask), fn(lp, x.mask), **TOL["exact"])
    with pytest.raises(ValueError, match="mask"):
        compiled(lp, x.mask.float() * 2)


# --------------------------------------------------------------------------------------------
# opcheck
# --------------------------------------------------------------------------------------------

def _op_cases(device):
    x = make_inputs(device, 7)
    logits = x.logits[:, :-1].clone().requires_grad_(True)
    lp = x.lp[:, :-1].clone().requires_grad_(True)
    weights = torch.full((B,), 0.1, device=device)
    token_w = torch.rand(B, T, device=device)
    inf = float("inf")
    dlogits = torch.zeros(B, T, V, device=device)
    full = x.logits.clone().requires_grad_(True)      # a model's whole output: rows 1..T
    hidden = x.hidden.clone().requires_grad_(True)
    weight = x.weight.clone().requires_grad_(True)
    jsd = ("jsd", list(JSD(0.3).terms().params))
    top_ids = torch.randint(0, V, (B, T, 3), device=device)
    _, head_entropy, head_stats = linear_head.linear_logprobs_op(
        hidden.detach(), x.weight, x.bias, x.targets, x.mask, 0.9, 0.5, 3.0, 1, 7, False, True)
    stats = logprobs.token_logprobs_op(logits.detach(), x.targets, x.mask, 0.9, False, False,
                                       0)[2]
    return {
        "token_logprobs": [(logits, x.targets, x.mask, 0.9, True, False, 0),
                           (logits.reshape(-1, V), x.targets.reshape(-1), None, 1.0, False,
                            False, 0),
                           (full, x.targets, x.mask, 0.9, True, False, 1),
                           (full, x.targets, x.mask, 0.9, True, False, 1, True)],
        "logits_grad_": [(dlogits, logits.detach(), x.targets, x.mask, stats, None,
                          torch.randn(B, T, device=device), None, 0.9, 0)],
        "surrogate": [
            (lp, x.old, x.adv, x.mask, None, weights, "clip", "chi2", "atomic", 0.04, 0.04,
             [inf, inf], 20.0, "token"),
            (lp, x.old, x.adv[:, None].expand(B, T), x.mask, token_w, weights, "clip",
             "ppo_clip", "mc", 0.2, 0.28, [3.0, inf], 20.0, "token"),
            (lp, None, x.adv, x.mask, token_w, weights, "clip", "ppo_clip", "mc", 0.1, 0.2,
             [inf, inf], inf, "sequence"),
            (lp, x.old, x.adv, x.mask, None, weights, "clip", "ppo_clip", "mc", 0.1, 0.2,
             [inf, inf], inf, "sequence_straight"),
            (lp, x.old, x.adv, x.mask, None, weights, "dppo_kl", "ppo_clip", "mc", 0.1, 0.2,
             [0.1, 0.2, 1.5], 20.0, "token")],
        "surrogate_backward": [
            (lp.detach(), x.old, x.adv, x.mask, token_w, weights, None,
             torch.tensor(2.0, device=device), "clip", "tv", "binary", 0.1, 0.2, [2.0, inf], inf,
             "token"),
            (lp.detach(), x.old, x.adv, x.mask, None, weights, torch.rand(B, device=device),
             torch.tensor(0.5, device=device), "clip", "ppo_clip", "mc", 0.1, 0.2, [inf, inf],
             inf, "sequence")],
        "surrogate_logits": [
            (logits, x.targets, x.mask, x.old, x.adv, None, weights, None, None, None, 0.9,
             "clip", "kl", "binary", 0.1, 0.1, [inf, inf], 20.0, "", False, False, False, True, 0),
            (logits.detach(), x.targets, x.mask, None, x.adv, token_w, weights, None, None, None,
             1.0, "clip", "two_sided_log", "atomic", 0.1, 0.3, [2.0, inf], inf, "", False, False,
             False, False, 0),
            (full, x.targets, x.mask, x.old, x.adv, None, weights, None, None, None, 0.9, "clip",
             "tv", "mc", 0.1, 0.1, [inf, inf], 20.0, "", False, False, False, True, 1),
            # the KL (importance-weighted k3, clamped) and entropy terms in the same pass
            (logits, x.targets, x.mask, x.old, x.adv, None, weights, x.ref, 0.5 * weights,
             0.25 * weights, 0.9, "cispo", "ppo_clip", "mc", 0.2, 0.28, [], 20.0, "k3", False,
             True, True, True, 0)],
        # in place: the gradient written over the logits (declared), a whole output too
        "surrogate_logits_": [
            (logits.detach().clone(), x.targets, x.mask, x.old, x.adv, None, weights, None, None,
             None, 0.9, "clip", "kl", "binary", 0.1, 0.1, [inf, inf], 20.0, "", False, False,
             False, 0),
            (x.logits.clone(), x.targets, x.mask, None, x.adv, token_w, weights, x.ref,
             0.5 * weights, 0.25 * weights, 1.0, "sapo", "ppo_clip", "mc", 1.0, 1.0, [1.0, 1.05],
             20.0, "k1", True, False, False, 1)],
        "kl_penalty": [(x.old, x.ref, "k3", False, True), (x.old, x.ref, "abs", True, False)],
        "kl_penalty_backward": [(x.old, x.ref, torch.randn(B, T, device=device), "k2", False,
                                 False),
                                (x.old, x.ref, torch.randn(B, T, device=device), "k3", True,
                                 True)],
        "scale_rows_": [(torch.randn(B, T, V, device=device), x.mask,
                         torch.tensor(0.5, device=device), 0)],
        "ggpo": [(lp, x.ref, x.rewards, x.mask, M, 0.5, None, 1.0, None),
                 (lp, x.ref, x.rewards, x.mask, M, 0.5, 0.1, 0.25, 11.0)],
        "ggpo_backward": [(torch.randn(B, device=device), x.mask,
                           torch.tensor(1.5, device=device), torch.tensor(9.0, device=device),
                           torch.float64)],
        "gppo_bounds": [(x.old, "kl", "binary", 0.1, 0.3)],
        # (the head's logit scale and softcap, 0: none, after the temperature)
        "head_logits": [(hidden, x.weight, x.bias), (hidden[:, 1:], weight, None)],
        "head_logits_backward": [(torch.randn(B, T + 1, V, device=device), hidden.detach(),
                                  x.weight, [True, True, True]),
                                 (torch.randn(B, T, V, device=device), hidden[:, 1:].detach(),
                                  x.weight, [False, True, False])],
        "linear_logprobs": [(hidden, x.weight, x.bias, x.targets, x.mask, 0.9, 0.5, 3.0, 1, 7,
                             False, True),
                            (hidden, weight, None, x.targets, None, 1.0, 1.0, 0.0, 0, 3, False,
                             False),
                            (hidden, x.weight, x.bias, x.targets, x.mask, 0.9, 0.5, 3.0, 1, 7,
                             False, True, False, True)],   # batch_invariant
        "linear_logprobs_backward": [(hidden.detach(), x.weight, x.bias, x.targets, x.mask,
                                      head_stats, head_entropy, torch.randn(B, T, device=device),
                                      torch.randn(B, T, device=device), 0.9, 0.5, 3.0, 1, 7,
                                      False, [True, True, True]),
                                     (hidden.detach(), x.weight, x.bias, x.targets, x.mask,
                                      head_stats, head_entropy, torch.randn(B, T, device=device),
                                      torch.randn(B, T, device=device), 0.9, 0.5, 3.0, 1, 7,
                                      False, [True, True, True], "", True)],  # batch_invariant
        "linear_surrogate": [
            (hidden, weight, x.bias, x.targets, x.mask, x.old, x.adv, None, weights, None, None,
             None, 0.9, 1.0, 0.0, "clip", "chi2", "atomic", 0.04, 0.04, [inf, inf], 20.0, "",
             False, False, False, 1, 7, False, [True, True, False]),
            (hidden, weight, None, x.targets, x.mask, None, x.adv, token_w, weights, None, None,
             None, 1.0, 2.0, 0.0, "clip", "ppo_clip", "mc", 0.2, 0.28, [3.0, inf], 20.0, "",
             False, False, False, 0, 3, True, [True, True, False]),
            (hidden, weight, x.bias, x.targets, x.mask, x.old, x.adv, None, weights, x.ref,
             0.5 * weights, 0.25 * weights, 0.9, 0.5, 3.0, "sapo", "ppo_clip", "mc", 1.0, 1.0,
             [1.0, 1.05], 20.0, "k1", True, False, False, 1, 7, False, [True, True, True])],
        "gr_opd_advantages": [(x.old, x.teacher, x.mask, M, 0.99, 0.25, 5.0, 5.0, 1e-6,
                               torch.float64)],
        "distill": [(full, x.logits.flip(0), x.mask, 0.9, 1.25, 1, 0, *jsd),
                    (full, x.logits.double(), x.mask, 1.0, 0.5, 0, 1, "reverse_kl", []),
                    (logits.double().detach().requires_grad_(), x.logits, x.mask, 1.0, 1.0, 0,
                     1, "forward_kl", [])],
        "distill_backward": [
            (full.detach(), x.logits.flip(0), x.mask,
             distill.distill_op(full.detach(), x.logits.flip(0), x.mask, 0.9, 1.25, 1, 0,
                                *jsd)[2],
             torch.randn(B, T, device=device), 0.9, 1.25, 1, 0, *jsd)],
        "distill_loss": [(full, x.logits.flip(0), x.mask, x.mask * 0.25, 0.9, 1.25, 1, 0, *jsd),
                         (logits.double().detach().requires_grad_(), x.logits, x.mask,
                          x.mask * 0.5, 1.0, 0.5, 0, 1, "reverse_kl", [], 1.5, 2.0)],
        "linear_distill": [
            (hidden, weight, x.bias, x.hidden.flip(0), x.weight, None, x.mask, 0.9, 0.5, 3.0,
             1.25, 1.0, 0.0, 1, 1, *jsd, 3, False, False),
            (hidden, weight, None, x.logits.double(), None, None, x.mask, 1.0, 1.0, 0.0, 0.8,
             1.0, 0.0, 1, 0, "reverse_kl", [], 7, True, False),
            (hidden, weight, x.bias, x.hidden, x.weight, x.bias, x.mask, 1.0, 1.0, 0.0, 1.0,
             2.0, 4.0, 0, 1, "forward_kl", [], 5, False, True)],
        "linear_distill_backward": [
            (hidden.detach(), x.weight, x.bias, x.hidden.flip(0), x.weight, None, x.mask,
             linear_distill.linear_distill_op(hidden.detach(), x.weight, x.bias, x.hidden.flip(0),
                                       x.weight, None, x.mask, 0.9, 0.5, 3.0, 1.25, 1.0, 0.0,
                                       1, 1, *jsd, 3, False, False)[2],
             torch.randn(B, T, device=device), 0.9, 0.5, 3.0, 1.25, 1.0, 0.0, 1, 1, *jsd, 3,
             False, False, "", [True, True, True]),
            (hidden.detach(), x.weight, None, x.logits, None, None, x.mask,
             torch.zeros(B * T, 5, device=device), torch.randn(B, T, device=device), 1.0, 1.0,
             0.0, 1.0, 1.0, 0.0, 1, 0, "forward_kl", [], 7, True, False, "",
             [False, True, False])],
        "linear_distill_loss": [
            (hidden, weight, x.bias, x.hidden.flip(0), x.weight, None, x.mask,
             x.mask * 0.25, 0.9, 0.5, 3.0, 1.25, 1.0, 0.0, 1, 1, *jsd, 3, False, False,
             [True, True, True]),
            (hidden, weight, None, x.logits.double(), None, None, x.mask, x.mask * 0.5, 1.0,
             1.0, 0.0, 0.8, 1.0, 0.0, 1, 0, "reverse_kl", [], 7, True, True,
             [True, False, False])],
        "logprobs_at": [(full, top_ids, x.mask, 0.9, 1),
                        (x.logits.double().requires_grad_(), top_ids[..., :1], x.mask, 1.0, 0)],
        "logprobs_at_backward": [
            (full.detach(), top_ids, x.mask,
             top_k.logprobs_at_op(full.detach(), top_ids, x.mask, 0.9, 1)[2],
             torch.randn(*top_ids.shape, device=device), 0.9, 1)],
        "linear_logprobs_at": [
            (hidden, weight, x.bias, top_ids, x.mask, 0.9, 0.5, 3.0, 1, 3, False, False),
            (hidden, weight, None, top_ids[..., :1], x.mask, 1.0, 2.0, 0.0, 0, 7, True, True)],
        "linear_logprobs_at_backward": [
            (hidden.detach(), x.weight, x.bias, top_ids, x.mask,
             top_k.linear_logprobs_at_op(hidden.detach(), x.weight, x.bias, top_ids, x.mask, 0.9,
                                         0.5, 3.0, 1, 3, False, False)[2],
             torch.randn(*top_ids.shape, device=device), 0.9, 0.5, 3.0, 1, 3, False, False, "",
             [True, True, True])],
        "scale_cast": [(torch.randn(7, 5, device=device), torch.tensor(0.3, device=device),
                        torch.bfloat16),
                       (torch.randn(3, device=device, dtype=torch.float64),
                        torch.tensor(-2.0, device=device, dtype=torch.float64), torch.float64)],
    }


OPS = {"token_logprobs": logprobs.token_logprobs_op, "logits_grad_": logprobs.logits_grad_op,
       "surrogate": surrogate.surrogate_op, "surrogate_backward": surrogate.surrogate_backward_op,
       "surrogate_logits": surrogate.surrogate_logits_op,
       "surrogate_logits_": surrogate.surrogate_logits_inplace_op,
       "scale_rows_": scale_rows.scale_rows_op,
       "ggpo": ggpo.ggpo_op, "ggpo_backward": ggpo.ggpo_backward_op,
       "gppo_bounds": regions.gppo_bounds_op, "gr_opd_advantages": gr_opd.gr_opd_advantages_op,
       "linear_logprobs": linear_head.linear_logprobs_op,
       "head_logits": head_logits.head_logits_op,
       "head_logits_backward": head_logits.head_logits_backward_op,
       "linear_logprobs_backward": linear_head.linear_logprobs_backward_op,
       "linear_surrogate": linear_head.linear_surrogate_op,
       "scale_cast": linear_head.scale_cast_op, "kl_penalty": kl.kl_penalty_op,
       "kl_penalty_backward": kl.kl_penalty_backward_op, "distill": distill.distill_op,
       "distill_backward": distill.distill_backward_op, "distill_loss": distill.distill_loss_op,
       "linear_distill": linear_distill.linear_distill_op,
       "linear_distill_backward": linear_distill.linear_distill_backward_op,
       "linear_distill_loss": linear_distill.linear_distill_loss_op,
       "logprobs_at": top_k.logprobs_at_op,
       "logprobs_at_backward": top_k.logprobs_at_backward_op,
       "linear_logprobs_at": top_k.linear_logprobs_at_op,
       "linear_logprobs_at_backward": top_k.linear_logprobs_at_backward_op}
ALL_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor",
             "test_aot_dispatch_dynamic")


def test_every_registered_op_is_opchecked(device):
    """Every custom op is opchecked here, or, those of the vocabulary split (which need a
    process group), by ``vocab_split_worker.py`` on every rank."""
    registered = {n.split("::")[1] for n in torch._C._dispatch_get_all_op_names()
                  if n.startswith("rlfuse::")}
    assert set(OPS) == set(_op_cases(device)) and not set(OPS) & set(SPLIT_OPS)
    assert registered == set(OPS) | set(SPLIT_OPS)


# The single passes from logits: their last output, the gradient, goes to their own backward
SINGLE_PASSES = {"surrogate_logits": 2, "distill_loss": 3}


@pytest.mark.parametrize("name", sorted(OPS))
def test_opcheck(name, device):
    """torch.library.opcheck: schema (declared mutations), autograd registration, the fake
    implementation against the real one, and AOT dispatch with dynamic shapes.

    The single passes from logits (``SINGLE_PASSES``) hand their gradient output to their own
    backward, which rescales it in place (no copy, no host sync): opcheck's AOT test returns
    every output to the caller, a use the functional API never makes, so that one test runs
    with the gradient output dropped."""
    for args in _op_cases(device)[name]:
        tests = ALL_TESTS[:3] if name in SINGLE_PASSES else ALL_TESTS
        torch.library.opcheck(OPS[name], args, test_utils=tests)
    if name in SINGLE_PASSES:
        for args in _op_cases(device)[name]:
            def without_gradient(*a):
                return OPS[name](*a)[:SINGLE_PASSES[name]]

            eager = without_gradient(*args)
            aot = torch.compile(without_gradient, backend="aot_eager", dynamic=True,
                                fullgraph=True)(*args)
            for a, b in zip(eager, aot):
                torch.testing.assert_close(b, a, **TOL["exact"])
            if args[0].requires_grad:
                grads = [torch.autograd.grad(out[0] * 0.5, args[0])[0] for out in (eager, aot)]
                torch.testing.assert_close(grads[1], grads[0], **TOL["exact"])


# --------------------------------------------------------------------------------------------
# No host sync
# --------------------------------------------------------------------------------------------

@contextlib.contextmanager
def no_host_reads():
    """Every way a tensor's value reaches Python raises inside the block: on a GPU each is a
    device-to-host sync."""
    names = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def trap(name):
        def read(self, *args, **kwargs):
            raise AssertionError(f"host read of a tensor value: Tensor.{name}")
        return read

    for name in names:
        setattr(torch.Tensor, name, trap(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


@pytest.mark.parametrize("name, form", CASES)
def test_no_host_read_without_validation(name, form, device):
    x = make_inputs(device, 8)
    eager = run_step(STEPS[name][1], x, form)
    with no_host_reads():
        traced = run_step(STEPS[name][1], x, form)
    assert_same(eager, traced, exact=True)


def test_validation_reads_the_host(device):
    """The negative control of the trap above."""
    x = make_inputs(device, 9)
    with no_host_reads(), pytest.raises(AssertionError, match="host read"):
        rlfuse.gppo_loss(x.lp[:, :-1], x.old, x.adv, x.mask)


@pytest.mark.parametrize("fn", ["gppo", "gr_opd"])
def test_overflow_is_a_metric_without_validation(fn, device):
    """validate=True refuses an overflowing unclipped r A; validate=False reports it as the
    'overflow' metric (1), in both policy forms, as the reference does."""
    x = make_inputs(device, 10)
    x.lp[0, 0] = x.old[0, 0] + 100.0      # r = e^100 overflows fp32
    x.adv[0] = -1.0                       # the unclipped branch of a negative advantage
    x.mask[0, 0] = True
    for lib in (rlfuse, rlfuse.reference):
        for validate in (True, False):
            if fn == "gppo":
                call = lambda v: lib.gppo_loss(x.lp[:, :-1], x.old, x.adv, x.mask,  # noqa: E731
                                               geometry="kl", topology="mc", validate=v)
            else:
                call = lambda v: lib.gr_opd_loss(x.lp[:, :-1], x.old, x.teacher, x.mask,  # noqa
                                                 group_size=M, advantages=x.adv, validate=v)
            if validate:
                with pytest.raises(ValueError, match="overflow"):
                    call(True)
            else:
                out = call(False)
                assert out.metrics["overflow"].item() == 1.0
                assert not torch.isfinite(out.loss)
    clean = make_inputs(device, 11)
    out = rlfuse.gppo_loss(clean.lp[:, :-1], clean.old, clean.adv, clean.mask, validate=False)
    assert out.metrics["overflow"].item() == 0.0


# --------------------------------------------------------------------------------------------
# GPU only
# --------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name, form", CASES)
def test_gpu_no_sync_and_cuda_graph(name, form):
    """Without validation a step never syncs (CUDA's sync debug mode errors on one), and a whole
    forward + backward is captured by a CUDA graph and replayed to the eager result."""
    step, x = STEPS[name][1], make_inputs(torch.device("cuda"), 12)
    eager = run_step(step, x, form)
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_step(step, x, form)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    leaf = {"logits": x.logits, "head": x.hidden, "invariant_head": x.hidden,
            "packed_logits": x.logits, "packed_head": x.hidden}.get(form, x.lp).clone().requires_grad_(True)
    static = leaf.detach().clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):          # warm-up: compiles and caches every kernel
        for _ in range(2):
            scalar, _ = step(leaf, x, form)
            torch.autograd.grad(scalar * 1.5, leaf)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        leaf_in = static.requires_grad_(True)
        scalar, outputs = step(leaf_in, x, form)
        (grad,) = torch.autograd.grad(scalar * 1.5, leaf_in)
    graph.replay()
    torch.cuda.synchronize()
    assert_same(eager, (scalar.detach(), {k: v.detach() for k, v in outputs.items()}, grad),
                exact=False)
