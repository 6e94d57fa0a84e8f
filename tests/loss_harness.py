"""Builders and runners shared by the loss parity tests."""
import torch

import rlfuse

from conftest import TOL, assert_three_way


def token_inputs(B, T, *, seed, masked_share=0.3, pad_time=1, lp_scale=1.0):
    """Learner log-probs as a ``[:, :-1]`` view of a float64 buffer, a mask with ~30% masked
    positions (at least one actor token per row), and a generator for the rest."""
    gen = torch.Generator().manual_seed(seed)
    lp_buffer = -torch.rand(B, T + pad_time, generator=gen, dtype=torch.float64) * 3 * lp_scale
    mask = torch.rand(B, T, generator=gen) >= masked_share
    mask[:, 0] = True
    return gen, lp_buffer, mask


def with_garbage(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` with NaN at masked positions: a loss that reads them fails."""
    return torch.where(mask, x, torch.full_like(x, float("nan")))


def run_loss(fn, policy_buffer, *, dtype, logits_targets=None, device="cpu", pad_time=1,
             temperature=1.0, offset=None, args=(), **kw):
    """Runs ``fn`` on the learner log-probs (``policy_buffer[:, :-pad_time]`` cast to ``dtype``)
    or, with ``logits_targets``, on ``rlfuse.Logits`` built from the logits buffer (with
    ``offset``: the whole buffer, a model's full output, whose rows from ``offset`` on predict
    the targets); returns the loss, the metrics and the gradient w.r.t. the buffer."""
    leaf = policy_buffer.detach().clone().to(dtype=dtype, device=device).requires_grad_(True)
    view = leaf[:, : leaf.shape[1] - pad_time] if offset is None else leaf
    if logits_targets is not None:
        policy = rlfuse.Logits(view, logits_targets.to(device), temperature, offset=offset or 0)
    else:
        policy = view
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    out = fn(policy, *args, **kw)
    out.loss.backward()
    return out.loss.detach(), {k: v.detach() for k, v in out.metrics.items()}, leaf.grad


def check_three_way(fused_fn, ref_fn, policy_buffer, *, dtype, args64, args, device,
                    logits_targets=None, metric_names=(), metric_scales=None, loss_scale=None,
                    grad_scale=None, **kw):
    """Fused and same-dtype reference against the float64 reference: loss, gradient, metrics
    (``metric_scales``, ``loss_scale``, ``grad_scale``: see ``assert_three_way``'s ``scale``)."""
    fused = run_loss(fused_fn, policy_buffer, dtype=dtype, args=args, device=device,
                     logits_targets=logits_targets, **kw)
    ref = run_loss(ref_fn, policy_buffer, dtype=dtype, args=args, logits_targets=logits_targets,
                   **kw)
    ref64 = run_loss(ref_fn, policy_buffer, dtype=torch.float64, args=args64,
                     logits_targets=logits_targets, **kw)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert fused[0].dtype == acc and fused[0].dim() == 0
    assert_three_way(fused[0].cpu(), ref[0], ref64[0], "loss", scale=loss_scale)
    assert fused[2].dtype == dtype
    assert_three_way(fused[2].cpu(), ref[2], ref64[2], "gradient", scale=grad_scale)
    assert set(fused[1]) == set(ref64[1]) and set(metric_names) <= set(fused[1])
    for name in fused[1]:
        assert fused[1][name].dim() == 0 and not fused[1][name].requires_grad
        assert_three_way(fused[1][name].cpu(), ref[1][name], ref64[1][name], name,
                         atol_dtype=acc, scale=(metric_scales or {}).get(name))
    return fused, ref64


def constexpr_params(kernel) -> set:
    """Names of a kernel's ``tl.constexpr`` parameters (compiled or interpreted)."""
    import inspect

    params = inspect.signature(kernel.fn).parameters.values()
    return {p.name for p in params if "constexpr" in str(p.annotation)}


class RecomputedInBackward(torch.autograd.Function):
    """``fn(x)`` whose every backward runs ``fn`` again and differentiates that once: gradcheck
    backpropagates one output repeatedly, which a fused loss from ``Logits`` refuses (it hands
    out the gradient it wrote in its forward, once)."""

    @staticmethod
    def forward(ctx, x, fn):
        ctx.save_for_backward(x)
        ctx.fn = fn
        return fn(x).detach()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            (dx,) = torch.autograd.grad(ctx.fn(x), x, grad)
        return dx, None


def shifted_oracle(x, targets, temperature, weights):
    """fp64 log-probs, entropies and the gradient of ``sum w0 lp + w1 H`` from logits shifted
    by their row's max: log_softmax is invariant to the shift, and no large logit is divided by
    the temperature, so the oracle holds at any magnitude."""
    shifted = x.double() - x.double().amax(-1, keepdim=True)
    shifted = torch.where(torch.isnan(shifted), float("-inf"), shifted).requires_grad_()
    lp, ent = rlfuse.reference.token_logprobs(shifted, targets, temperature=temperature,
                                              return_entropy=True)
    grad, = torch.autograd.grad((lp * weights[0] + ent * weights[1]).sum(), shifted)
    return lp.detach(), ent.detach(), grad


def check_against_shifted_oracle(x, targets, temperature, weights, device, where: str):
    """``rlfuse.token_logprobs`` of logits ``x`` (with entropy, and the gradient of
    ``sum w0 lp + w1 H``) against ``shifted_oracle``: log-probs and entropies to a few units of
    the compute dtype, no NaN; the gradient to a few units of its dtype of its largest value
    (bf16: one unit, 2^-7 relative: the interpreter truncates its fp32 -> bf16 casts, where a
    GPU rounds to nearest)."""
    dtype = x.dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    close = dict(rtol=1e-12, atol=1e-12) if acc == torch.float64 else TOL["fp32_logprob"]
    leaf = x.to(device).requires_grad_()
    lp, ent = rlfuse.token_logprobs(leaf, targets.to(device), temperature=temperature,
                                    return_entropy=True)
    grad, = torch.autograd.grad((lp * weights[0].to(device, lp.dtype) +
                                 ent * weights[1].to(device, lp.dtype)).sum(), leaf)
    want = shifted_oracle(x, targets, temperature, weights)
    for got, w, name in zip((lp, ent), want, ("logp", "entropy")):
        got = got.cpu()
        assert not got.isnan().any(), (where, name)
        torch.testing.assert_close(got, w.to(acc), **close,
                                   msg=lambda m: f"{where} {name}: {m}")
    scale = max(1.0, want[2].abs().max().item())
    rtol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 2.0 ** -7}[dtype]
    torch.testing.assert_close(grad.cpu().double(), want[2], rtol=rtol,
                               atol=(1e-12 if dtype == torch.float64 else 4e-7) * scale,
                               msg=lambda m: f"{where} gradient: {m}")
