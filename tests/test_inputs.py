"""What every loss accepts alike in both implementations: an empty batch, non-contiguous views
of every input (each tensor's own strides reach the kernels), a 0/1 mask of any dtype, masked
rows of garbage (NaN / inf logits never read), and errors that name the argument."""
import pytest
import torch

import rlfuse
from rlfuse import reference

from conftest import TOL
from loss_harness import with_garbage


def empty_call(fn, name, device="cpu"):
    kw = dict(dtype=torch.float64, device=device)
    lp = torch.zeros(0, 5, requires_grad=True, **kw)
    z, mask = torch.zeros(0, 5, **kw), torch.zeros(0, 5, dtype=torch.bool, device=device)
    if name == "ggpo":
        out = fn(lp, z, torch.zeros(0, **kw), mask, group_size=2, beta=1.0)
    elif name == "gppo":
        out = fn(lp, z, torch.zeros(0, **kw), mask)
    else:
        out = fn(lp, z, z, mask, group_size=2)
    out.loss.backward()
    return out, lp.grad


@pytest.mark.parametrize("name", ["ggpo", "gppo", "gr_opd"])
def test_empty_batch(name, device):
    fused, grad = empty_call(getattr(rlfuse, f"{name}_loss"), name, device)
    ref, _ = empty_call(getattr(reference, f"{name}_loss"), name)
    assert fused.loss.item() == ref.loss.item() == 0 and grad.shape == (0, 5)
    assert fused.metrics.keys() == ref.metrics.keys()
    for key, value in fused.metrics.items():
        assert value.item() == ref.metrics[key].item() == 0, key


def token_case(name, device, *, seed=20):
    """(policy log-probs, logits, targets, [B, T]/[B] inputs with NaN at masked positions, mask,
    kwargs) of a small loss call."""
    B, T, V = 4, 3, 16
    gen = torch.Generator().manual_seed(seed)

    def rand(*size):
        return torch.rand(*size, generator=gen, dtype=torch.float64).to(device)

    mask = torch.tensor([[1, 1, 0], [1, 0, 1], [1, 1, 1], [0, 1, 0]], dtype=torch.bool,
                        device=device)
    logits = 4 * rand(B, T, V) - 2
    targets = torch.randint(0, V, (B, T), generator=gen).to(device)
    lp = -3 * rand(B, T)
    old, other = (lp + 0.3 * (rand(B, T) - 0.5)).clamp_max(0), -3 * rand(B, T)
    old, other, per_token = (with_garbage(x, mask) for x in (old, other, rand(B, T) - 0.5))
    inputs = {"ggpo": (other, rand(B)), "gppo": (old, per_token), "gr_opd": (old, other)}[name]
    kwargs = {"ggpo": dict(group_size=2, beta=0.5), "gppo": {}, "gr_opd": dict(group_size=2)}[name]
    return lp, logits, targets, inputs, mask, kwargs


def transposed(x):
    """The same values, batch and time swapped in memory: strides (1, B) or (V, B V, 1)."""
    return x.transpose(0, 1).contiguous().transpose(0, 1)


def spaced(x):
    """The same values every other element: strides (2 T, 2) or (2,); for logits stride(-1) = 2."""
    return torch.stack([x, x], -1)[..., 0]


def call(name, policy, inputs, mask, *, impl=rlfuse, validate=True, **kw):
    fn = getattr(impl, f"{name}_loss")
    x = policy.detach().requires_grad_(True)
    pol = rlfuse.Logits(x, kw.pop("targets")) if "targets" in kw else x
    out = fn(pol, *inputs, mask, validate=validate, **kw)
    (grad,) = torch.autograd.grad(out.loss, x)
    return out, grad


def assert_same(a, b):
    (out_a, grad_a), (out_b, grad_b) = a, b
    torch.testing.assert_close(out_a.loss, out_b.loss, **TOL["exact"])
    torch.testing.assert_close(grad_a, grad_b, **TOL["exact"])
    for key, value in out_a.metrics.items():
        torch.testing.assert_close(value, out_b.metrics[key], **TOL["exact"], msg=key)


@pytest.mark.parametrize("from_logits", [False, True])
@pytest.mark.parametrize("name", ["ggpo", "gppo", "gr_opd"])
def test_any_strides(name, from_logits, device):
    """Non-contiguous views of every input, each laid out differently (time stride != 1, batch
    stride != T, logits with stride(-1) != 1) give exactly what contiguous copies give: each
    tensor's own strides reach the kernels."""
    lp, logits, targets, inputs, mask, kw = token_case(name, device)
    policy, strided_policy = (logits, spaced(logits)) if from_logits else (lp, transposed(lp))
    if from_logits:
        kw["targets"] = targets
    contiguous = call(name, policy, inputs, mask, **kw)
    first, second = inputs
    strided_inputs = (spaced(first), transposed(second) if second.dim() == 2 else spaced(second))
    if from_logits:
        kw["targets"] = spaced(targets)
    strided = call(name, strided_policy, strided_inputs, transposed(mask), **kw)
    assert_same(strided, contiguous)


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("name", ["ggpo", "gppo", "gr_opd"])
def test_numeric_mask(name, impl, validate, device):
    """A 0/1 mask of an integer or float dtype acts as its bool (SPEC 2: bool or 0/1)."""
    lp, _, _, inputs, mask, kw = token_case(name, device)
    want = call(name, lp, inputs, mask, impl=impl, **kw)
    for dtype in (torch.int64, torch.float32):
        assert_same(call(name, lp, inputs, mask.to(dtype), impl=impl, validate=validate, **kw),
                    want)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_masked_rows_of_garbage_get_zero_gradient(impl, bad, device):
    """Fully masked attention rows produce NaN logits: a masked row is never read, in either
    path (the reference masks rows before its log_softmax)."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 11, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[True, False, True], [False, True, True]])
    logits[~mask] = bad
    dev = device if impl is rlfuse else "cpu"
    x = logits.to(dev).requires_grad_(True)
    targets = torch.randint(0, 11, (2, 3), generator=gen).to(dev)
    lp, ent = impl.token_logprobs(x, targets, mask=mask.to(dev), return_entropy=True)
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert torch.isfinite(x.grad).all() and (x.grad[~mask.to(dev)] == 0).all()
    old = torch.zeros(2, 3, dtype=torch.float64, device=dev)
    x.grad = None
    impl.gppo_loss(rlfuse.Logits(x, targets), old, torch.ones(2, dtype=torch.float64,
                                                                  device=dev),
                  mask.to(dev)).loss.backward()
    assert torch.isfinite(x.grad).all() and (x.grad[~mask.to(dev)] == 0).all()


def test_clear_type_errors(impl, device):
    logits = torch.randn(2, 5, device=device)
    targets = torch.zeros(2, dtype=torch.long, device=device)
    with pytest.raises(TypeError, match="logits: expected a torch.Tensor"):
        impl.token_logprobs([[0.0, 1.0]], targets)
    for bad in ("1", [1.0], True):
        with pytest.raises(TypeError, match="temperature: expected a number"):
            impl.token_logprobs(logits, targets, temperature=bad)
        with pytest.raises(TypeError, match="temperature: expected a number"):
            impl.gppo_loss(rlfuse.Logits(logits[None], targets[None], bad),
                          torch.zeros(1, 2, device=device), torch.ones(1, device=device),
                          torch.ones(1, 2, dtype=torch.bool, device=device))
    with pytest.raises(TypeError, match="delta: expected a number"):
        impl.gppo_bounds(torch.zeros(3, device=device), geometry="kl", topology="mc", delta="0.1")


def _loss_calls(B, T):
    """``name -> (call(policy, **tensors), tensors)`` of every loss with every ``[B, T]`` /
    ``[B]`` tensor argument it takes."""
    gen = torch.Generator().manual_seed(3)

    def logprobs():
        return -torch.rand(B, T, generator=gen, dtype=torch.float64) - 0.01

    seq = torch.randn(B, generator=gen, dtype=torch.float64)
    O, terms = rlfuse.objectives, rlfuse.terms
    return {
        "policy_loss": (lambda impl, p, old_logprobs, advantages, mask, weights, ref_logprobs,
                        sampling_logprobs: impl.policy_loss(
                            p, old_logprobs, advantages, mask, O.Clip(), weights=weights,
                            ref_logprobs=ref_logprobs, kl=terms.KLPenalty(0.1),
                            off_policy_mask=terms.OffPolicyMask(0.5, sampling_logprobs)),
                        dict(old_logprobs=logprobs(), advantages=seq, weights=logprobs().exp(),
                             ref_logprobs=logprobs(), sampling_logprobs=logprobs())),
        "ppo_loss": (lambda impl, p, old_logprobs, advantages, mask, weights: impl.ppo_loss(
            p, old_logprobs, advantages, mask, weights=weights),
            dict(old_logprobs=logprobs(), advantages=seq, weights=logprobs().exp())),
        "gppo_loss": (lambda impl, p, old_logprobs, advantages, mask: impl.gppo_loss(
            p, old_logprobs, advantages, mask), dict(old_logprobs=logprobs(), advantages=seq)),
        "gr_opd_loss": (lambda impl, p, old_logprobs, teacher_logprobs, mask: impl.gr_opd_loss(
            p, old_logprobs, teacher_logprobs, mask, group_size=2),
            dict(old_logprobs=logprobs(), teacher_logprobs=logprobs())),
        "ggpo_loss": (lambda impl, p, ref_logprobs, rewards, mask: impl.ggpo_loss(
            p, ref_logprobs, rewards, mask, group_size=2, beta=1.0),
            dict(ref_logprobs=logprobs(), rewards=seq)),
    }


@pytest.mark.parametrize("form", ["logprobs", "logits", "head", "packed"])
@pytest.mark.parametrize("loss", ["policy_loss", "ppo_loss", "gppo_loss", "gr_opd_loss",
                                  "ggpo_loss"])
def test_a_shape_error_names_the_argument(loss, form, impl):
    """Every tensor argument of every loss given one batch row or one token too many: a
    ValueError naming that argument (packed rows, whose ``[B, T]`` only the mask and the
    ``[B, T]`` inputs carry: the one the others outvote, or the mask and it when none do)."""
    B, T, V, H = 4, 3, 7, 5
    call, tensors = _loss_calls(B, T)[loss]
    tensors["mask"] = torch.ones(B, T, dtype=torch.bool)
    targets = torch.randint(0, V, (B, T))
    policy = {"logprobs": -torch.rand(B, T, dtype=torch.float64),
              "logits": rlfuse.Logits(torch.randn(B, T, V, dtype=torch.float64), targets),
              "head": rlfuse.LinearHead(torch.randn(B, T, H, dtype=torch.float64),
                                        torch.randn(V, H, dtype=torch.float64), targets),
              "packed": rlfuse.Logits(torch.randn(B * T, V, dtype=torch.float64),
                                      targets.view(-1), index=torch.arange(B * T))}[form]
    call(impl, policy, **tensors)
    for name, good in tensors.items():
        for wrong in (torch.zeros_like(good[:1]).expand(B + 1, *good.shape[1:]),
                      torch.zeros(B, T + 1, dtype=good.dtype)):
            with pytest.raises(ValueError) as error:
                call(impl, policy, **{**tensors, name: wrong})
            assert name in str(error.value).split(":")[0].split(", "), str(error.value)
