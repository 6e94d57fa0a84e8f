"""Distillation (``rlfuse.distill_loss``, ``rlfuse.token_divergence``, ``rlfuse.divergences``,
``rlfuse.TopK``): against TRL 1.16's own ``generalized_jsd_loss`` (GKD) and
``_chunked_divergence_loss`` (the ``DistillationTrainer``'s, from both models' heads) and verl
0.9.1's ``forward_kl_topk`` on the same batches, against float64, masked positions inert, and
bad input refused by name."""
import dataclasses
import math
import types
from typing import ClassVar

import pytest
import torch
import triton
import triton.language as tl

import rlfuse
import rlfuse.reference
from conftest import TOL, assert_three_way, matmul_rounding
from rlfuse import divergences
from rlfuse.divergences import JSD, ForwardKL, ReverseKL
from rlfuse.kernels.lib import divergence_functions as kernel_divergences
from rlfuse.reference import divergence_functions as reference_divergences

B, S, V, H = 3, 6, 37, 8
T = S - 1
LIBS = [rlfuse, rlfuse.reference]
BETAS = [0.0, 0.1, 0.5, 0.9, 1.0]


def _batch(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    student = (2 * torch.randn(B, S, V, generator=g, dtype=torch.float64)).to(dtype)
    teacher = (2 * torch.randn(B, S, V, generator=g, dtype=torch.float64)).to(dtype)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = True
    return student, teacher, mask


def _positions():
    return torch.zeros(B, T, dtype=torch.long)     # distillation reads no target


@pytest.mark.parametrize("lib", LIBS, ids=["fused", "reference"])
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trl_generalized_jsd(lib, beta, temperature):
    """TRL's GKD loss (``batchmean`` over the labelled tokens) and its gradient: TRL's own
    function in fp32 the yardstick and in float64 the truth (the three-way rule)."""
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    student, teacher, mask = _batch()
    leaf = student.clone().requires_grad_()
    out = lib.distill_loss(rlfuse.Logits(leaf, _positions(), temperature),
                           rlfuse.Logits(teacher, _positions(), temperature), mask, JSD(beta))
    (grad,) = torch.autograd.grad(out.loss, leaf)
    labels = torch.where(mask, 1, -100)
    trl = []
    for dtype in (torch.float32, torch.float64):
        trl_leaf = student.to(dtype).requires_grad_()
        want = GKDTrainer.generalized_jsd_loss(trl_leaf[:, :-1], teacher.to(dtype)[:, :-1],
                                               labels=labels, beta=beta,
                                               temperature=temperature)
        trl.append((want, *torch.autograd.grad(want, trl_leaf)))
    for name, got, want32, want64 in zip(("loss", "grad"), (out.loss, grad), *trl):
        assert_three_way(got, want32, want64, name)


def _heads(seed=1):
    g = torch.Generator().manual_seed(seed)
    h_s = torch.randn(B, T, H, generator=g)
    h_t = torch.randn(B, T, 2 * H + 1, generator=g)                 # a wider teacher
    w_s, w_t = torch.randn(V, H, generator=g) / 2, torch.randn(V, 2 * H + 1, generator=g) / 3
    b_s, b_t = torch.randn(V, generator=g), torch.randn(V, generator=g)
    return h_s, h_t, w_s, w_t, b_s, b_t


@pytest.mark.parametrize("lib", LIBS, ids=["fused", "reference"])
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("style", ["plain", "cohere", "gemma"])
def test_trl_distillation_trainer_heads(lib, beta, style):
    """TRL's ``_chunked_divergence_loss`` over both models' hidden states and heads (a student
    with a bias, logit scale and softcap, a wider teacher with its own): the loss, every
    student gradient, and its ``entropy`` metric (entropy sum / valid tokens)."""
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    scale, cap = {"plain": (1.0, None), "cohere": (0.25, None), "gemma": (1.0, 3.0)}[style]
    h_s, h_t, w_s, w_t, b_s, b_t = _heads()
    _, _, mask = _batch()
    leaves = [x.clone().requires_grad_() for x in (h_s, w_s, b_s)]
    student = rlfuse.LinearHead(leaves[0], leaves[1], _positions(), bias=leaves[2],
                                temperature=0.8, logit_scale=scale, softcap=cap)
    teacher = rlfuse.LinearHead(h_t, w_t, _positions(), bias=b_t, temperature=0.8,
                                logit_scale=2 * scale, softcap=cap and 2 * cap)
    out = lib.distill_loss(student, teacher, mask, JSD(beta))
    grads = torch.autograd.grad(out.loss, leaves)
    trl_leaves = [x.clone().requires_grad_() for x in (h_s, w_s, b_s)]
    want, entropy_sum, valid = _chunked_divergence_loss(
        trl_leaves[0], h_t, trl_leaves[1], w_t, mask.long(), beta,
        student_lm_head_bias=trl_leaves[2], teacher_lm_head_bias=b_t,
        student_logit_scale=scale, teacher_logit_scale=2 * scale,
        student_final_logit_softcapping=cap, teacher_final_logit_softcapping=cap and 2 * cap,
        temperature=0.8)
    want_grads = torch.autograd.grad(want, trl_leaves)
    torch.testing.assert_close(out.loss, want, **TOL["fp32_matmul"])
    torch.testing.assert_close(out.metrics["entropy"], entropy_sum / valid, **TOL["fp32_matmul"])
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, **TOL["fp32_matmul"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bf16_heads_no_less_accurate_than_trl(seed):
    """bf16 heads (JSD 0.5), both against float64 on the same rounded inputs: rlfuse's loss and
    its hidden-state and weight gradients are at least as accurate as TRL's
    ``_chunked_divergence_loss`` (both form the logits in fp32; the gradients round the
    student's logit gradient to bf16 for the head's matmuls, then to bf16)."""
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    g = torch.Generator().manual_seed(seed)
    n, h_size, v = 64, 64, 512
    tensors = [torch.randn(*size, generator=g).div(d).bfloat16()
               for size, d in (((n, h_size), 1), ((n, h_size), 1), ((v, h_size), 4),
                               ((v, h_size), 4))]
    mask = torch.rand(1, n, generator=g) > 0.2
    positions = torch.zeros(1, n, dtype=torch.long)

    def run(lib, dtype):
        h_s, h_t, w_s, w_t = (x.to(dtype) for x in tensors)
        leaves = [h_s.requires_grad_(), w_s.requires_grad_()]
        if lib == "trl":
            loss = _chunked_divergence_loss(h_s[None], h_t[None], w_s, w_t, mask.long(), 0.5)[0]
        else:
            loss = lib.distill_loss(lib.LinearHead(h_s[None], w_s, positions),
                                    lib.LinearHead(h_t[None], w_t, positions), mask,
                                    JSD(0.5)).loss
        return [loss.double(), *(x.double() for x in torch.autograd.grad(loss, leaves))]

    truth = run(rlfuse.reference, torch.float64)
    ours, trl_out = run(rlfuse, torch.bfloat16), run("trl", torch.bfloat16)
    for name, a, b, t in zip(("loss", "dhidden", "dweight"), ours, trl_out, truth):
        assert (a - t).abs().max() <= (b - t).abs().max(), name


@pytest.mark.parametrize("lib", LIBS, ids=["fused", "reference"])
@pytest.mark.parametrize("min_logprob", [None, -4.0])
def test_verl_forward_kl_topk(lib, min_logprob):
    """verl's ``forward_kl_topk`` (FSDP's logits processor, then the loss's clamp at 0): the
    per-token losses and their gradient, ``student_mass`` and ``teacher_mass``."""
    from verl.trainer.distillation.fsdp.losses import compute_forward_kl_topk

    student, teacher, _ = _batch()
    k = 4
    top = torch.log_softmax(teacher[:, :-1].double(), -1).topk(k, -1)
    ids, logprobs = top.indices, top.values.float()
    mask = torch.ones(B, T, dtype=torch.bool)
    leaf = student.clone().requires_grad_()
    got = lib.token_divergence(rlfuse.Logits(leaf, _positions()), rlfuse.TopK(ids, logprobs),
                               ForwardKL(min_logprob), mask)
    (grad,) = torch.autograd.grad(got.sum(), leaf)
    out = lib.distill_loss(rlfuse.Logits(student, _positions()), rlfuse.TopK(ids, logprobs),
                           mask, ForwardKL(min_logprob))

    def nested(x):
        return torch.nested.nested_tensor(list(x), layout=torch.jagged)

    config = types.SimpleNamespace(distillation_loss=types.SimpleNamespace(
        log_prob_min_clamp=min_logprob, use_chunked_topk=False))
    verl_leaf = student.clone().requires_grad_()
    verl = compute_forward_kl_topk(verl_leaf[:, :-1].reshape(1, B * T, V), nested(logprobs),
                                   nested(ids), config, "thd")
    want = verl["distillation_losses"].clamp_min(0.0).view(B, T)
    (want_grad,) = torch.autograd.grad(want.sum(), verl_leaf)
    torch.testing.assert_close(got, want, **TOL["fp32"])
    torch.testing.assert_close(grad, want_grad, **TOL["fp32"])
    for name in ("student_mass", "teacher_mass"):
        torch.testing.assert_close(out.metrics[name], verl[name].mean(), **TOL["fp32"])


def _run(lib, student, teacher, mask, divergence, dtype):
    leaf = student.to(dtype).requires_grad_()
    out = lib.distill_loss(rlfuse.Logits(leaf, _positions(), 0.9),
                           rlfuse.Logits(teacher.to(dtype), _positions(), 1.25), mask,
                           divergence, agg="seq-mean-token-mean")
    (grad,) = torch.autograd.grad(out.loss, leaf)
    return (out.loss, *out.metrics.values(), grad)


def _assert_against_float64(names, fused, ref, ref64, dtype):
    """Each result of the kernels against float64: the three-way rule in fp32 / bf16, fp64's
    rounding in fp64."""
    for name, a, b, b64 in zip(names, fused, ref, ref64):
        if dtype == torch.float64:
            torch.testing.assert_close(a, b64, **TOL["fp64_chain"])
        else:
            assert_three_way(a, b, b64, name)


# An instance of every record of rlfuse.divergences (test_objectives holds the table to it)
DIVERGENCES = [ForwardKL(), ReverseKL(), JSD(0.3)]


@pytest.mark.parametrize("divergence", DIVERGENCES, ids=repr)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_against_float64_and_masked_positions_inert(divergence, dtype):
    """The kernels against float64 (the three-way rule; fp64 to fp64's rounding): loss,
    metrics, the student logits' gradient; NaN in the masked rows of both models' logits
    reaches nothing; a masked position has zero gradient."""
    student, teacher, mask = _batch()
    for logits in (student, teacher):    # the masked rows of the window, the row after it
        logits[:, :-1][~mask] = float("nan")
        logits[:, -1] = float("nan")
    student, teacher = student.to(dtype), teacher.to(dtype)    # the inputs, rounded
    fused = _run(rlfuse, student, teacher, mask, divergence, dtype)
    ref64 = _run(rlfuse.reference, student, teacher, mask, divergence, torch.float64)
    ref = _run(rlfuse.reference, student, teacher, mask, divergence, dtype)
    _assert_against_float64(("loss", "entropy", "loss_min", "loss_max", "grad"), fused, ref,
                            ref64, dtype)
    grad = fused[-1]
    assert (grad[:, :-1][~mask] == 0).all() and (grad[:, -1] == 0).all()


def _head_z(y, scale, cap, temperature):
    y = y * scale
    return (cap * torch.tanh(y / cap) if cap else y) / temperature


HEAD_STYLES = {"student": dict(temperature=0.8, logit_scale=0.7, softcap=3.0),
               "teacher": dict(temperature=1.25, logit_scale=1.3, softcap=None)}


def _floors(loss_of, models, dtype):
    """The rounding floors in ``dtype`` of the loss and the gradients of the student's hidden,
    weight and bias, for ``loss_of`` the models' log-softmaxes (``models``: each one's ``(h, W,
    b)``, the student's first, in ``HEAD_STYLES``' order): each model's logits ``y = h W^T + b``
    rounded by its matmul move the loss by at most ``|dL/dy|`` times that; the gradients are
    matmuls of ``dL/dy_s`` with W (V terms) and h (N terms) and its sum over N. ``dL/dy`` from
    float64 autograd over the exact logits."""
    ys = [(h @ w.T + b).requires_grad_() for h, w, b in models]
    loss = loss_of(*(torch.log_softmax(_head_z(y, style["logit_scale"], style["softcap"],
                                                style["temperature"]), -1)
                     for y, style in zip(ys, HEAD_STYLES.values())))
    dys = torch.autograd.grad(loss, ys)
    loss_floor = sum((dy.abs() * matmul_rounding(h, w.T, dtype)).sum().item()
                     for dy, (h, w, _) in zip(dys, models))
    dy, (h_s, w_s, _) = dys[0].reshape(-1, V), models[0]
    u = torch.finfo(dtype).eps / 2
    return (loss_floor, matmul_rounding(dy, w_s, dtype).max().item(),
            matmul_rounding(dy.T, h_s.reshape(-1, H), dtype).max().item(),
            math.sqrt(dy.shape[0]) * u * dy.abs().sum(0).max().item())


def _head_floors(divergence, h_s, w_s, b_s, h_t, w_t, b_t, mask, dtype):
    """``_floors`` of a loss between two heads: the divergence's reference function."""
    function, params = divergence.terms()

    def loss_of(s, t):
        value = reference_divergences.divergence_function(function)(s, t, params)
        return torch.where(mask, value, 0.0).sum() / mask.sum()

    return _floors(loss_of, ((h_s, w_s, b_s), (h_t, w_t, b_t)), dtype)


def _run_heads(lib, divergence, tensors, mask, dtype, validate):
    h_s, w_s, b_s, h_t, w_t, b_t = (x.to(dtype) for x in tensors)
    leaves = [x.clone().requires_grad_() for x in (h_s, w_s, b_s)]
    student = rlfuse.LinearHead(leaves[0], leaves[1], _positions(), bias=leaves[2],
                                chunk_tokens=4, **HEAD_STYLES["student"])
    teacher = rlfuse.LinearHead(h_t, w_t, _positions(), bias=b_t, **HEAD_STYLES["teacher"])
    out = lib.distill_loss(student, teacher, mask, divergence, validate=validate)
    return (out.loss, out.metrics["entropy"], *torch.autograd.grad(out.loss, leaves))


@pytest.mark.parametrize("divergence", DIVERGENCES, ids=repr)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("validate", [True, False], ids=["actor_rows", "every_row"])
def test_heads_against_float64(divergence, dtype, validate):
    """A LinearHead student (bias, logit scale, softcap; chunks of 4 positions) and a wider
    LinearHead teacher (its own bias, scale, temperature): the loss, the student's entropy and
    the gradients of hidden, weight and bias against float64 by the three-way rule, with the
    floors of the matmuls' own rounding; fp64 to fp64's rounding. Masked positions get a zero
    hidden-state gradient and their hidden rows change nothing: with validate they are never
    read (NaN there), without it their logits are formed and given a zero gradient (large
    finite values there)."""
    # the inputs, rounded to the dtype: float64 computes from the same numbers
    h_s, h_t, w_s, w_t, b_s, b_t = (x.to(dtype).double() for x in _heads())
    _, _, mask = _batch()
    tensors = (h_s, w_s, b_s, h_t, w_t, b_t)     # the reference's: every row finite
    garbage = [x.clone() for x in (h_s, h_t)]
    for x in garbage:
        x[~mask] = float("nan") if validate else 1e3
    fused = _run_heads(rlfuse, divergence, (garbage[0], w_s, b_s, garbage[1], w_t, b_t), mask,
                       dtype, validate)
    ref64 = _run_heads(rlfuse.reference, divergence, tensors, mask, torch.float64, True)
    assert (fused[2][~mask] == 0).all()
    if dtype == torch.float64:
        for a, b in zip(fused, ref64):
            torch.testing.assert_close(a, b, **TOL["fp64_chain"])
        return
    ref = _run_heads(rlfuse.reference, divergence, tensors, mask, dtype, True)
    floors = _head_floors(divergence, h_s, w_s, b_s, h_t, w_t, b_t, mask, dtype)
    names = ("loss", "entropy", "dhidden", "dweight", "dbias")
    for name, a, b, b64, floor in zip(names, fused, ref, ref64, (floors[0], 0.0, *floors[1:])):
        assert_three_way(a, b, b64, name, floor=floor)


@pytest.mark.parametrize("agg, loss_scale, weighted", [
    ("token-mean", 1.0, False), ("seq-mean-token-mean", 2.5, True), ("token-sum", 0.5, False)])
@pytest.mark.parametrize("frozen_weight", [False, True], ids=["weight", "frozen_weight"])
def test_head_loss_single_pass_is_the_two_passes(agg, loss_scale, weighted, frozen_weight):
    """distill_loss from a LinearHead student forms each chunk once (the aggregation's weights
    are each position's upstream gradient, known before the kernels): its loss and gradients
    equal those of the per-token divergence (two passes: its backward forms the chunks again)
    aggregated by hand, float64; a frozen weight (LoRA) gets no gradient, no bias none."""
    h_s, h_t, w_s, w_t, b_s, b_t = (x.double() for x in _heads())
    _, _, mask = _batch()
    weights = torch.rand(B, T, generator=torch.Generator().manual_seed(3),
                         dtype=torch.float64) if weighted else None
    results = []
    for single_pass in (True, False):
        hidden = h_s.clone().requires_grad_()
        weight = w_s.clone().requires_grad_(not frozen_weight)
        student = rlfuse.LinearHead(hidden, weight, _positions(), chunk_tokens=4,
                                    **HEAD_STYLES["student"])
        teacher = rlfuse.LinearHead(h_t, w_t, _positions(), bias=b_t, **HEAD_STYLES["teacher"])
        if single_pass:
            loss = rlfuse.distill_loss(student, teacher, mask, JSD(0.3), agg=agg,
                                       loss_scale=loss_scale, weights=weights).loss
        else:
            value = rlfuse.token_divergence(student, teacher, JSD(0.3), mask)
            rows = mask.sum(-1, keepdim=True).clamp_min(1).double()
            row_w = {"token-mean": 1 / mask.sum().double(), "token-sum": 1.0,
                     "seq-mean-token-mean": 1 / (rows * B)}[agg]
            per_token = value * (1.0 if weights is None else weights)
            loss = loss_scale * (torch.where(mask, per_token, 0.0) * row_w).sum()
        leaves = [hidden] + ([] if frozen_weight else [weight])
        results.append((loss, *torch.autograd.grad(loss, leaves)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, **TOL["fp64_chain"])


def _by_hand(value, mask, agg, loss_scale, weights):
    """The loss of per-token divergences ``value`` aggregated by hand (``agg``'s weights)."""
    rows = mask.sum(-1, keepdim=True).clamp_min(1).double()
    row_w = {"token-mean": 1 / mask.sum().double(), "token-sum": 1.0,
             "seq-mean-token-mean": 1 / (rows * B)}[agg]
    per_token = value * (1.0 if weights is None else weights)
    return loss_scale * (torch.where(mask, per_token, 0.0) * row_w).sum()


class _Counted:
    """A function wrapped to count its calls."""

    def __init__(self, function):
        self.function, self.calls = function, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.function(*args, **kwargs)


@pytest.mark.parametrize("agg, loss_scale, weighted", [
    ("token-mean", 1.0, False), ("seq-mean-token-mean", 2.5, True), ("token-sum", 0.5, False)])
@pytest.mark.parametrize("teacher_form", ["logits", "head"])
def test_logits_loss_single_pass_is_the_two_passes(monkeypatch, agg, loss_scale, weighted,
                                                   teacher_form):
    """distill_loss from a Logits student whose gradient is wanted runs in one launch
    (``kernels.rows.distill.distill_single_pass``: each position's upstream gradient is its weight
    in the loss): its loss, metrics and gradient for an upstream gradient of 3 (the gradient
    rescaled in place) equal those of the per-token divergence (two passes) aggregated by
    hand, float64; the student a model's whole output (offset 1): the row before the window
    and masked rows get zeros."""
    from rlfuse.fused_losses.logits import distill as fused_distill

    single = _Counted(fused_distill.distill_single_pass)
    monkeypatch.setattr(fused_distill, "distill_single_pass", single)
    student, teacher, mask = (x.double() if x.is_floating_point() else x for x in _batch())
    h_t, w_t, b_t = (x.double() for x in _heads()[1::2])
    teacher = rlfuse.Logits(teacher, _positions(), 1.25) if teacher_form == "logits" else \
        rlfuse.LinearHead(h_t, w_t, _positions(), bias=b_t, **HEAD_STYLES["teacher"])
    weights = torch.rand(B, T, generator=torch.Generator().manual_seed(3),
                         dtype=torch.float64) if weighted else None
    results = []
    for one_launch in (True, False):
        leaf = student.clone().requires_grad_()
        model = rlfuse.Logits(leaf, _positions(), 0.9, offset=1)
        if one_launch:
            out = rlfuse.distill_loss(model, teacher, mask, JSD(0.3), agg=agg,
                                      loss_scale=loss_scale, weights=weights)
            loss, entropy = out.loss, out.metrics["entropy"]
            assert single.calls == 1
        else:
            value, metrics = rlfuse.token_divergence(model, teacher, JSD(0.3), mask,
                                                     return_metrics=True)
            loss = _by_hand(value, mask, agg, loss_scale, weights)
            entropy = metrics["entropy"].sum() / mask.sum()
            assert single.calls == 1
        (grad,) = torch.autograd.grad(3.0 * loss, leaf)
        results.append((loss, entropy, grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, **TOL["fp64_chain"])
    grad = results[0][-1]
    assert (grad[:, 0] == 0).all() and (grad[:, 1:][~mask] == 0).all()
    assert (grad[:, 1:][mask] != 0).any(dim=-1).all()


def test_logits_loss_single_pass_only_where_it_serves(monkeypatch):
    """The single pass runs only when the student's gradient is wanted, and not for fp16
    logits (a gradient rounded to fp16 at upstream 1 would lose what a loss scaler keeps):
    there the two passes give the same loss and gradient as float64 (the three-way rule);
    its gradient is handed out once (a second backward raises)."""
    from rlfuse.fused_losses.logits import distill as fused_distill

    single = _Counted(fused_distill.distill_single_pass)
    monkeypatch.setattr(fused_distill, "distill_single_pass", single)
    student, teacher, mask = _batch(seed=4)

    def loss_of(lib, logits, dtype=None):
        dtype = dtype or logits.dtype
        return lib.distill_loss(rlfuse.Logits(logits, _positions(), 0.9),
                                rlfuse.Logits(teacher.to(dtype), _positions()), mask,
                                ReverseKL()).loss

    with torch.no_grad():
        no_grad = loss_of(rlfuse, student.clone().requires_grad_())
    assert single.calls == 0
    results = []
    for lib, dtype in ((rlfuse, torch.float16), (rlfuse.reference, torch.float16),
                       (rlfuse.reference, torch.float64)):
        leaf = student.to(dtype).requires_grad_()
        loss = loss_of(lib, leaf, torch.float64 if dtype == torch.float64 else torch.float32)
        results.append((loss, *torch.autograd.grad(loss * 1024.0, leaf)))
    assert single.calls == 0
    for name, got, ref, ref64 in zip(("loss", "grad"), *results):
        assert_three_way(got, ref, ref64, name)
    leaf = student.clone().requires_grad_()
    loss = loss_of(rlfuse, leaf)
    assert single.calls == 1
    torch.testing.assert_close(loss, no_grad, **TOL["exact"])
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backpropagated twice"):
        loss.backward()


@pytest.mark.parametrize("teacher_form", ["head", "logits"])
def test_mixed_forms_against_float64(teacher_form):
    """A Logits student beside a LinearHead teacher (its window's logits formed once), and a
    LinearHead student beside a Logits teacher: fp64 to fp64's rounding, values and the
    student's gradient."""
    h_s, h_t, w_s, w_t, b_s, b_t = (x.double() for x in _heads())
    student, teacher, mask = _batch(torch.float64)
    results = []
    for lib in LIBS:
        if teacher_form == "head":
            leaf = student.clone().requires_grad_()
            s = rlfuse.Logits(leaf, _positions(), 0.9, offset=1)
            t = rlfuse.LinearHead(h_t, w_t, _positions(), bias=b_t, **HEAD_STYLES["teacher"])
        else:
            leaf = h_s.clone().requires_grad_()
            s = rlfuse.LinearHead(leaf, w_s, _positions(), bias=b_s, chunk_tokens=3,
                                  **HEAD_STYLES["student"])
            t = rlfuse.Logits(teacher, _positions(), 1.25, offset=1)
        out = lib.distill_loss(s, t, mask, JSD(0.4))
        results.append((out.loss, out.metrics["entropy"], *torch.autograd.grad(out.loss, leaf)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, **TOL["fp64_chain"])


def _run_top_k(lib, student, ids, logprobs, mask, min_logprob, dtype):
    leaf = student.to(dtype).requires_grad_()
    out = lib.distill_loss(rlfuse.Logits(leaf, _positions(), 0.8, offset=1),
                           rlfuse.TopK(ids, logprobs.to(dtype)), mask, ForwardKL(min_logprob))
    (grad,) = torch.autograd.grad(out.loss, leaf)
    return (out.loss, *out.metrics.values(), grad)


@pytest.mark.parametrize("min_logprob", [None, -3.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_top_k_against_float64(min_logprob, dtype):
    """A TopK teacher (verl's top-k forward KL) on the kernels (the student's log-probs at the
    teacher's ids from one read of its rows): loss, metrics and the logits' gradient against
    float64 by the three-way rule; NaN in the masked rows of the student's logits and of the
    teacher's top-k reaches nothing; a masked row's gradient is zero."""
    student, teacher, mask = _batch()
    top = torch.log_softmax(teacher[:, 1:].double() / 0.9, -1).topk(6, -1)
    ids, logprobs = top.indices, top.values
    logprobs[~mask] = float("nan")
    student[:, 1:][~mask] = float("nan")
    fused = _run_top_k(rlfuse, student, ids, logprobs, mask, min_logprob, dtype)
    ref = _run_top_k(rlfuse.reference, student, ids, logprobs, mask, min_logprob, dtype)
    ref64 = _run_top_k(rlfuse.reference, student, ids, logprobs, mask, min_logprob,
                       torch.float64)
    _assert_against_float64(("loss", "entropy", "loss_min", "loss_max", "student_mass",
                             "teacher_mass", "grad"), fused, ref, ref64, dtype)
    grad = fused[-1]
    assert (grad[:, 1:][~mask] == 0).all() and (grad[:, 0] == 0).all()


def _run_top_k_head(lib, tensors, ids, logprobs, mask, divergence, dtype, validate):
    leaves = [x.to(dtype).requires_grad_() for x in tensors]
    student = rlfuse.LinearHead(leaves[0], leaves[1], _positions(), bias=leaves[2],
                                chunk_tokens=4, **HEAD_STYLES["student"])
    out = lib.distill_loss(student, rlfuse.TopK(ids, logprobs.to(dtype)), mask, divergence,
                           validate=validate)
    return (out.loss, *out.metrics.values(), *torch.autograd.grad(out.loss, leaves))


@pytest.mark.parametrize("min_logprob", [None, -3.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("validate", [True, False], ids=["actor_rows", "every_row"])
def test_top_k_heads_against_float64(min_logprob, dtype, validate):
    """A LinearHead student (bias, logit scale, softcap; chunks of 4 positions) with a TopK
    teacher: loss, metrics and the gradients of hidden, weight and bias against float64 by the
    three-way rule with the matmuls' floors; fp64 to fp64's rounding. The masked positions'
    hidden rows (NaN with validate, never read; large without, their logits formed and given a
    zero gradient) and the teacher's ids and log-probs there (out of range, NaN) reach
    nothing."""
    h_s, _, w_s, _, b_s, _ = (x.to(dtype).double() for x in _heads())
    _, teacher, mask = _batch()
    top = torch.log_softmax(teacher[:, 1:].double() / 0.9, -1).topk(6, -1)
    ids, logprobs = top.indices, top.values
    ids[~mask], logprobs[~mask] = -7, float("nan")
    garbage = h_s.clone()
    garbage[~mask] = float("nan") if validate else 1e3
    divergence = ForwardKL(min_logprob)
    fused = _run_top_k_head(rlfuse, (garbage, w_s, b_s), ids, logprobs, mask, divergence,
                            dtype, validate)
    ref64 = _run_top_k_head(rlfuse.reference, (h_s, w_s, b_s), ids.clamp_min(0), logprobs,
                            mask, divergence, torch.float64, True)
    assert (fused[-3][~mask] == 0).all()
    names = ("loss", "entropy", "loss_min", "loss_max", "student_mass", "teacher_mass",
             "dhidden", "dweight", "dbias")
    if dtype == torch.float64:
        for name, a, b in zip(names, fused, ref64):
            torch.testing.assert_close(a, b, **TOL["fp64_chain"], msg=name)
        return
    ref = _run_top_k_head(rlfuse.reference, (h_s, w_s, b_s), ids.clamp_min(0), logprobs,
                          mask, divergence, dtype, True)

    def loss_of(s):
        value, _ = rlfuse.reference.distill.top_k_divergence(
            s.gather(-1, ids.clamp_min(0)), logprobs.nan_to_num(0.0), divergence)
        return torch.where(mask, value, 0.0).sum() / mask.sum()

    loss_floor, *grad_floors = _floors(loss_of, ((h_s, w_s, b_s),), dtype)
    for name, a, b, b64, floor in zip(names, fused, ref, ref64,
                                      (loss_floor, *[0.0] * 5, *grad_floors)):
        assert_three_way(a, b, b64, name, floor=floor)


def test_token_divergence_is_the_loss_per_token():
    """``token_divergence`` in ``distill_loss``'s order (mask, then divergence) is the loss per
    token; the earlier order (divergence, then mask) and keywords give the same bits."""
    student, teacher, mask = _batch()
    leaf = student.clone().requires_grad_()
    args = (rlfuse.Logits(leaf, _positions()), rlfuse.Logits(teacher, _positions()))
    per_token = rlfuse.token_divergence(*args, mask, JSD(0.5))
    assert per_token.shape == (B, T) and (per_token[~mask] == 0).all()
    for same in (rlfuse.token_divergence(*args, JSD(0.5), mask),
                 rlfuse.token_divergence(*args, divergence=JSD(0.5), mask=mask)):
        assert torch.equal(same, per_token)
    whole = rlfuse.token_divergence(*args, divergence=JSD(0.5))
    assert torch.equal(whole, rlfuse.token_divergence(*args, JSD(0.5)))
    with pytest.raises(TypeError, match="divergence: expected"):
        rlfuse.token_divergence(*args, mask)
    out = rlfuse.distill_loss(*args, mask, JSD(0.5), agg="token-sum", loss_scale=2.0,
                              weights=mask.float() * 0.5)
    torch.testing.assert_close(out.loss, per_token.sum(), **TOL["fp32"])
    assert out.metrics["loss_max"] == per_token[mask].max()


@pytest.mark.parametrize("lib", LIBS, ids=["fused", "reference"])
@pytest.mark.parametrize("top_k", [False, True], ids=["logits", "top_k"])
def test_token_divergence_metrics_are_the_losses_per_token(lib, top_k):
    """``return_metrics``: the per-token entropy (and a TopK teacher's masses), 0 at masked
    positions, whose means over the mask are ``distill_loss``'s metrics."""
    student, teacher, mask = _batch()
    top = torch.log_softmax(teacher[:, :-1], -1).topk(4, -1)
    args = (rlfuse.Logits(student, _positions()),
            rlfuse.TopK(top.indices, top.values) if top_k else
            rlfuse.Logits(teacher, _positions()))
    divergence = ForwardKL(-3.0) if top_k else JSD(0.5)
    value, metrics = lib.token_divergence(*args, divergence, mask, return_metrics=True)
    out = lib.distill_loss(*args, mask, divergence)
    assert set(metrics) == {"entropy"} | ({"student_mass", "teacher_mass"} if top_k else set())
    for name, x in (("value", value), *metrics.items()):
        assert x.shape == (B, T) and (x[~mask] == 0).all(), name
    for name, x in metrics.items():
        torch.testing.assert_close(x.sum() / mask.sum(), out.metrics[name], **TOL["fp32"])
    torch.testing.assert_close(value, lib.token_divergence(*args, divergence, mask), rtol=0,
                               atol=0)


BAD = [
    (dict(divergence="forward_kl"), TypeError, "divergence: expected"),
    (dict(divergence=ReverseKL(), topk=True), ValueError, "divergence: a TopK teacher"),
    (dict(divergence=ForwardKL(-3.0)), ValueError, "divergence.min_logprob"),
    (dict(teacher_vocab=V + 1), ValueError, "teacher: the vocabularies must match"),
    (dict(teacher_rows=T - 1), ValueError, "teacher"),
    (dict(mask=torch.ones(B, T + 1, dtype=torch.bool)), ValueError, "mask"),
    (dict(topk=True, ids_shift=V), ValueError, r"teacher.ids: ids must lie in \[0, 37\)"),
    (dict(topk=True, logprob_shift=1.5), ValueError, "teacher.logprobs: expected log-probs"),
    (dict(student="logprobs"), TypeError, "student: expected rlfuse.Logits"),
    (dict(packed=True), ValueError, "teacher.index: expected the student.s packed rows"),
]


@pytest.mark.parametrize("lib", LIBS, ids=["fused", "reference"])
@pytest.mark.parametrize("bad,error,match", BAD, ids=[m for _, _, m in BAD])
def test_bad_input(lib, bad, error, match):
    student, teacher, mask = _batch()
    s = rlfuse.Logits(student, _positions())
    if bad.get("student") == "logprobs":
        s = torch.zeros(B, T)
    if bad.get("packed"):
        s = rlfuse.Logits(student.reshape(-1, V)[:B * T], torch.zeros(B * T, dtype=torch.long),
                          index=torch.arange(B * T))
    rows = S - (T - bad.get("teacher_rows", T))
    t = rlfuse.Logits(torch.zeros(B, rows, bad.get("teacher_vocab", V)),
                      torch.zeros(B, rows - 1, dtype=torch.long))
    if bad.get("topk"):
        ids = torch.zeros(B, T, 2, dtype=torch.long) + bad.get("ids_shift", 0)
        t = rlfuse.TopK(ids, torch.full((B, T, 2), -1.0) + bad.get("logprob_shift", 0.0))
    with pytest.raises(error, match=match):
        lib.distill_loss(s, t, bad.get("mask", mask), bad.get("divergence", ForwardKL()))


@pytest.mark.parametrize("beta", [-0.1, 1.5, float("nan")])
def test_beta_outside_the_unit_interval(beta):
    with pytest.raises(ValueError, match=r"divergence.beta: expected a number in \[0, 1\]"):
        JSD(beta)
    with pytest.raises(TypeError, match="divergence.beta"):
        JSD("0.5")


def test_a_teacher_of_another_dtype_and_strides():
    """A bf16 student over a window of a model's whole output (offset 1), an fp32 teacher as
    a non-contiguous view: the kernels against float64 (the three-way rule)."""
    student, teacher, mask = _batch(seed=5)
    wide = torch.cat([teacher, teacher], -1)[..., ::2]          # every other column
    assert not wide.is_contiguous()
    results = []
    for lib, s_dtype, t_dtype in ((rlfuse, torch.bfloat16, torch.float32),
                                  (rlfuse.reference, torch.bfloat16, torch.float32),
                                  (rlfuse.reference, torch.float64, torch.float64)):
        leaf = student.to(torch.bfloat16).to(s_dtype).requires_grad_()
        value = lib.token_divergence(
            rlfuse.Logits(leaf, _positions()[:, 1:], offset=1),
            rlfuse.Logits(wide.to(t_dtype), _positions()[:, 1:], 0.8, offset=1), JSD(0.7),
            mask[:, 1:])
        results.append((value, *torch.autograd.grad(value.sum(), leaf)))
    for name, got, ref, ref64 in zip(("divergence", "grad"), *results):
        assert_three_way(got, ref, ref64, name)


@triton.jit
def total_variation(s, t, aux, params):
    p_s, p_t = kernel_divergences.prob(s), kernel_divergences.prob(t)
    sign = tl.where(p_s > p_t, 1.0, tl.where(p_s < p_t, -1.0, 0.0))
    return 0.5 * tl.abs(p_s - p_t), sign * p_s, 0.5 * p_s * (sign - aux)


def reference_total_variation(s, t, params):
    return 0.5 * (s.exp() - t.exp()).abs().sum(-1)


def test_a_divergence_is_added_by_its_record_and_its_functions_alone(monkeypatch):
    """docs/layout.md's worked example, run: a record, its Triton function and its reference
    function registered, and nothing else, give a fused divergence equal to its definition in
    float64 (value and the student's gradient)."""
    @dataclasses.dataclass(frozen=True)
    class TotalVariation(divergences.Divergence):
        function: ClassVar[str] = "total_variation"

    monkeypatch.setattr(divergences, "DIVERGENCES", divergences.DIVERGENCES + (TotalVariation,))
    monkeypatch.setitem(kernel_divergences.DIVERGENCE_FUNCTIONS, "total_variation",
                        total_variation)
    reference_total_variation.__name__ = "total_variation"
    monkeypatch.setitem(reference_divergences.DIVERGENCE_FUNCTIONS, "total_variation",
                        reference_total_variation)
    student, teacher, mask = _batch(torch.float64)
    results = []
    for lib in LIBS:
        leaf = student.clone().requires_grad_()
        out = lib.distill_loss(rlfuse.Logits(leaf, _positions(), 0.8),
                               rlfuse.Logits(teacher, _positions(), 1.25), mask,
                               TotalVariation())
        results.append((out.loss, *torch.autograd.grad(out.loss, leaf)))
    for fused, ref in zip(*results):
        torch.testing.assert_close(fused, ref, **TOL["fp64_chain"])
    assert results[0][0] > 0


def _packed_case(seed=3):
    """Padded rows (window offset P) of a student and a teacher, as logits and as heads, and the
    same rows packed back to back (``rlfuse.packed_index``), sequences of different lengths."""
    g = torch.Generator().manual_seed(seed)
    P, lengths = 2, torch.tensor([5, 2, 4])
    n, S = len(lengths), P + T + 1
    mask = torch.arange(T) < lengths[:, None]
    rows = {name: torch.randn(n, S, width, generator=g, dtype=torch.float64) * scale
            for name, width, scale in (("s", V, 2), ("t", V, 2), ("h_s", H, 1),
                                       ("h_t", 2 * H + 1, 1))}
    n_rows = P + lengths + 1
    seq = torch.repeat_interleave(torch.arange(n), n_rows)
    pos = torch.cat([torch.arange(int(k)) for k in n_rows])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), n_rows.cumsum(0)])
    index = rlfuse.packed_index(cu, torch.full((n,), P + 1), T)
    top = torch.log_softmax(rows["t"][:, P:P + T], -1).topk(4, -1)
    return dict(P=P, mask=mask, rows=rows, seq=seq, pos=pos, index=index, top=top)


def _packed_models(case, form, teacher_form, packed, leaf):
    """(student over ``leaf``, teacher) padded or packed."""
    P, index, w = case["P"], case["index"], torch.Generator().manual_seed(9)
    w_s, w_t = torch.randn(V, H, generator=w, dtype=torch.float64) / 3, \
        torch.randn(V, 2 * H + 1, generator=w, dtype=torch.float64) / 3
    n, S = case["mask"].shape[0], P + T + 1
    y = torch.zeros(len(index) if packed else n * T, dtype=torch.long)
    y = y if packed else y.view(n, T)
    where = dict(index=index) if packed else dict(offset=P)

    def rows_of(x):
        return x[case["seq"], case["pos"]] if packed else x

    student = rlfuse.Logits(leaf, y, 0.9, **where) if form == "logits" else \
        rlfuse.LinearHead(leaf, w_s, y, chunk_tokens=3, temperature=0.9, softcap=2.5, **where)
    if teacher_form == "top_k":
        teacher = rlfuse.TopK(case["top"].indices, case["top"].values)
    elif teacher_form == "logits":
        teacher = rlfuse.Logits(rows_of(case["rows"]["t"]), y, 1.2, **where)
    else:
        teacher = rlfuse.LinearHead(rows_of(case["rows"]["h_t"]), w_t, y, temperature=1.2,
                                    logit_scale=0.5, **where)
    return student, teacher


@pytest.mark.parametrize("lib", LIBS, ids=["fused", "reference"])
@pytest.mark.parametrize("form", ["logits", "head"])
@pytest.mark.parametrize("teacher_form", ["logits", "head", "top_k"])
def test_packed_rows_equal_padded(lib, form, teacher_form):
    """Packed rows (``index``; a TopK teacher at the ``[B, T]`` positions) give the padded
    layout's loss, metrics and per-token divergence, and each row the gradient of its padded
    row (float64)."""
    case = _packed_case()
    divergence = ForwardKL(-5.0) if teacher_form == "top_k" else JSD(0.3)
    results = []
    for packed in (False, True):
        full = case["rows"]["s" if form == "logits" else "h_s"]
        leaf = (full[case["seq"], case["pos"]] if packed else full).clone().requires_grad_()
        student, teacher = _packed_models(case, form, teacher_form, packed, leaf)
        out = lib.distill_loss(student, teacher, case["mask"], divergence,
                               agg="seq-mean-token-mean")
        (grad,) = torch.autograd.grad(out.loss, leaf)
        per_token = lib.token_divergence(student, teacher, divergence, case["mask"])
        results.append((out.loss, out.metrics, per_token.detach(),
                        grad if packed else grad[case["seq"], case["pos"]]))
    (loss, metrics, per_token, grad), packed = results
    torch.testing.assert_close(packed[0], loss, **TOL["fp64_chain"])
    assert packed[1].keys() == metrics.keys()
    for name, value in metrics.items():
        torch.testing.assert_close(packed[1][name], value, **TOL["fp64_chain"], msg=name)
    torch.testing.assert_close(packed[2], per_token, **TOL["fp64_chain"])
    torch.testing.assert_close(packed[3], grad, **TOL["fp64_chain"])
    assert grad.abs().sum() > 0


def test_packed_rows_bad_input():
    case = _packed_case()
    leaf = case["rows"]["s"][case["seq"], case["pos"]]
    student, teacher = _packed_models(case, "logits", "logits", True, leaf)
    with pytest.raises(ValueError, match="mask: packed rows"):
        rlfuse.token_divergence(student, teacher, JSD(0.5))
    padded = rlfuse.Logits(case["rows"]["t"], torch.zeros(3, T, dtype=torch.long), offset=2)
    with pytest.raises(ValueError, match="teacher.index"):
        rlfuse.distill_loss(student, padded, case["mask"], JSD(0.5))
    with pytest.raises(ValueError, match="teacher.index"):
        rlfuse.distill_loss(student, teacher._replace(index=case["index"].flip(0)),
                            case["mask"], JSD(0.5))
    with pytest.raises(ValueError, match="teacher.index"):
        rlfuse.distill_loss(padded, teacher, case["mask"], JSD(0.5))
