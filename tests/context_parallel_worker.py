"""One rank of the context-parallel tests (``tests/test_context_parallel.py`` starts 2 of them
with ``torch.distributed.run`` over ``gloo``; the group is the whole world): every loss of
rlfuse with ``context_parallel_group``, each rank holding its two chunks of every sequence in
Megatron's load-balanced layout, against one process over the whole sequences, in float64 —
the ranks' losses sum to its loss, each rank's gradients are its positions' (a head's weight:
the ranks' sum), the metrics equal on every rank; every objective record, the terms and masks,
every aggregation, GGPO, GR-OPD and its advantages; ``[B, T]`` log-probs, ``Logits`` and
``LinearHead``; both implementations; compiled equal to eager. Bad layouts raise on every
rank.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        tests/context_parallel_worker.py [--impls fused,reference] [--forms logprobs,logits,head] \
        [--dtype float64]
"""
import argparse
import datetime
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")       # before triton is imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import rlfuse  # noqa: E402
import rlfuse.reference  # noqa: E402
from conftest import TOL  # noqa: E402  (this script's folder)
from rlfuse import objectives, terms  # noqa: E402
from rlfuse.scaleout.context import own_positions  # noqa: E402

B, T, V, H, GROUP = 4, 8, 11, 5, 2
IMPLS = {"fused": rlfuse, "reference": rlfuse.reference}


def make_data(dtype=torch.float64):
    """The same whole-sequence data on every rank (``dtype``: the floating tensors')."""
    g = torch.Generator().manual_seed(5)
    f64 = dict(generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[0, :5] = False                    # row 0's actor tokens: the last chunks only
    mask[0, 5:] = True
    mask[1, 0] = True
    d = dict(logits=3 * torch.randn(B, T, V, **f64),
                hidden=torch.randn(B, T, H, **f64),
                weight=torch.randn(V, H, **f64),
                targets=torch.randint(0, V, (B, T), generator=g),
                old=-torch.rand(B, T, **f64) * 3,
                ref=-torch.rand(B, T, **f64) * 3,
                teacher=-torch.rand(B, T, **f64) * 3,
                sampling=-torch.rand(B, T, **f64) * 3,
                adv=torch.randn(B, **f64),
                adv_tokens=torch.randn(B, T, **f64),
                weights=torch.rand(B, T, **f64) + 0.5,
                rewards=torch.randn(B, **f64),
                mask=mask)
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in d.items()}


class Ranks:
    def __init__(self, group):
        self.group, self.rank, self.cp = group, dist.get_rank(group), dist.get_world_size(group)

    def local(self, x):
        """This rank's chunks of a whole ``[B, T, ...]`` tensor (other shapes as they are)."""
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and tuple(x.shape[:2]) == (B, T):
            return own_positions(x, self.rank, self.cp).clone()
        if isinstance(x, terms.OffPolicyMask) and x.sampling_logprobs is not None:
            return terms.OffPolicyMask(x.threshold, self.local(x.sampling_logprobs))
        return x

    def total(self, x):
        x = x.detach().clone()
        dist.all_reduce(x, group=self.group)
        return x


def policy_of(form, d, ranks=None):
    """(policy, its leaves): whole sequences, or this rank's chunks with ``ranks``."""
    local = (lambda x: x) if ranks is None else ranks.local
    if form == "logprobs":
        lp = torch.log_softmax(d["logits"], -1).gather(-1, d["targets"][..., None])[..., 0]
        lp = local(lp).detach().requires_grad_()
        return lp, [lp]
    targets = local(d["targets"])
    if form == "logits":
        logits = local(d["logits"]).requires_grad_()
        return rlfuse.Logits(logits, targets, temperature=0.7), [logits]
    hidden = local(d["hidden"]).requires_grad_()
    weight = d["weight"].clone().requires_grad_()
    return rlfuse.LinearHead(hidden, weight, targets, temperature=0.7, chunk_tokens=3), \
        [hidden, weight]


def compare(name, form, loss_fn, d, ranks, args, kwargs, tol, grad_tol):
    """``loss_fn(policy, *args, **kwargs)`` on one process over whole sequences against the
    same with the group over this rank's chunks (values to ``tol``, gradients to
    ``grad_tol``)."""
    def seeded():   # ClipCov's draw: the same on one process and on every rank
        if "generator" in kwargs:
            kwargs["generator"].manual_seed(3)

    whole_policy, whole_leaves = policy_of(form, d)
    seeded()
    want = loss_fn(whole_policy, *args, **kwargs)
    want_grads = torch.autograd.grad(want.loss, whole_leaves)
    policy, leaves = policy_of(form, d, ranks)
    seeded()
    got = loss_fn(policy, *map(ranks.local, args),
                  **{k: ranks.local(v) for k, v in kwargs.items()},
                  context_parallel_group=ranks.group)
    grads = torch.autograd.grad(got.loss, leaves)
    where = f"rank {ranks.rank} {name} {form}"
    torch.testing.assert_close(ranks.total(got.loss), want.loss.detach(), **tol,
                               msg=lambda m: f"{where} loss: {m}")
    assert set(got.metrics) == set(want.metrics), (where, set(got.metrics), set(want.metrics))
    for key, value in want.metrics.items():
        torch.testing.assert_close(got.metrics[key], value, **tol,
                                   msg=lambda m: f"{where} metric {key}: {m}")
    torch.testing.assert_close(grads[0], ranks.local(want_grads[0]), **grad_tol,
                               msg=lambda m: f"{where} gradient: {m}")
    if len(grads) > 1:   # a head's weight: the ranks' partial sums summed, each rounded once
        g, w = ranks.total(grads[1]).double(), want_grads[1].double()
        bound = grad_tol["rtol"] * (ranks.total(grads[1].abs()).double() + w.abs()) + \
            grad_tol["atol"]
        assert ((g - w).abs() <= bound).all(), (where, (g - w).abs().max())


def loss_cases(d, form):
    """(name, function of the implementation, positional args, keyword args); the entropy's
    terms from logits or a head."""
    old, adv, mask = d["old"], d["adv"], d["mask"]
    entropic = form != "logprobs"
    cases = []
    for name, record in objectives.OBJECTIVES.items():
        kw = {"generator": torch.Generator()} if record.draws else {}
        if record.name == "clip_cov":   # a ratio that cuts some of the tokens
            kw["objective"] = record(clip_cov_ratio=0.3, clip_cov_lb=-10.0, clip_cov_ub=10.0)
        cases.append((name, "policy_loss", (old, adv, mask),
                      {"objective": kw.pop("objective", record.example()), **kw}))
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                "seq-mean-token-sum-norm", "token-sum"):
        cases.append((f"clip {agg} terms", "policy_loss", (old, d["adv_tokens"], mask), dict(
            objective="clip", agg=agg, weights=d["weights"], ref_logprobs=d["ref"],
            kl=terms.KLPenalty(0.1, importance_weighted=True),
            entropy=terms.EntropyBonus(0.01, agg="seq-mean-token-mean") if entropic else None)))
    cases.append(("gspo masks", "policy_loss", (old, adv, mask), dict(
        objective="gspo", entropy_mask=terms.TopEntropyMask(0.5) if entropic else None,
        off_policy_mask=terms.OffPolicyMask(0.05, d["sampling"]))))
    cases.append(("ppo sequence", "ppo_loss", (old, adv, mask), dict(ratio_level="sequence")))
    cases.append(("gppo", "gppo_loss", (old, adv, mask), dict(geometry="kl",
                                                              topology="binary")))
    for rho in (None, 0.5):
        cases.append((f"ggpo {rho}", "ggpo_loss", (d["ref"], d["rewards"], mask),
                      dict(group_size=GROUP, beta=0.3, clip_radius=rho)))
    cases.append(("gr_opd", "gr_opd_loss", (old, d["teacher"], mask),
                  dict(group_size=GROUP)))
    return cases


def check_losses(d, ranks, impls, forms, tols):
    """``tols(form)``: the tolerances of ``compare``."""
    for impl_name in impls:
        impl = IMPLS[impl_name]
        for form in forms:
            cases = loss_cases(d, form)
            if form != "logprobs":   # the interpreter is slow: a few of them from logits
                cases = [c for c in cases if c[0] in ("clip", "clip token-mean terms",
                                                      "gspo masks", "geo_mean", "ggpo 0.5",
                                                      "gr_opd")]
            for name, fn, args, kwargs in cases:
                compare(f"{impl_name} {name}", form, getattr(impl, fn), d, ranks, args, kwargs,
                        *tols(form))


def check_advantages(d, ranks, impls):
    """``gr_opd_advantages`` of whole sequences on every rank."""
    for impl_name in impls:
        fn = IMPLS[impl_name].gr_opd_advantages
        want = fn(d["old"], d["teacher"], d["mask"], group_size=GROUP)
        got = fn(ranks.local(d["old"]), ranks.local(d["teacher"]), ranks.local(d["mask"]),
                 group_size=GROUP, context_parallel_group=ranks.group)
        torch.testing.assert_close(got, want, **TOL["fp64"])


def check_compiled(d, ranks):
    """torch.compile (aot_eager; the collectives and the group's agreement break the graph)
    equal to eager, bit for bit, in place (Clip) and over gathered sequences (GSPO)."""
    targets, old, mask = (ranks.local(d[k]) for k in ("targets", "old", "mask"))

    def step(logits, objective):
        return rlfuse.policy_loss(rlfuse.Logits(logits, targets), old, d["adv"], mask,
                                  objective, context_parallel_group=ranks.group,
                                  validate=False).loss

    compiled = torch.compile(step, backend="aot_eager")
    for objective in ("clip", "gspo"):
        results = []
        for fn in (step, compiled):
            logits = ranks.local(d["logits"]).requires_grad_()
            loss = fn(logits, objective)
            results.append((loss.detach(), torch.autograd.grad(loss, logits)[0]))
        for got, want in zip(*results):
            assert torch.equal(got, want), (ranks.rank, objective)


def expect_error(ranks, match, fn):
    try:
        fn()
    except ValueError as e:
        assert match in str(e), (ranks.rank, match, str(e))
    else:
        raise AssertionError(f"rank {ranks.rank}: no error (expected {match!r})")


def check_bad_layouts(d, ranks):
    """Each raises on every rank, before the loss's own collectives (no hang)."""
    lp = policy_of("logprobs", d, ranks)[0]
    old, adv, mask = ranks.local(d["old"]), d["adv"], ranks.local(d["mask"])
    group = ranks.group
    expect_error(ranks, "T is even", lambda: rlfuse.policy_loss(
        lp[:, :3], old[:, :3], adv, mask[:, :3], context_parallel_group=group))
    cut = 4 if ranks.rank == 0 else 2
    expect_error(ranks, "every rank holds the same [B, T]", lambda: rlfuse.policy_loss(
        lp[:, :cut], old[:, :cut], adv, mask[:, :cut], context_parallel_group=group))
    bad_adv = adv[:3] if ranks.rank == 1 else adv   # one rank's argument is wrong
    expect_error(ranks, "advantages" if ranks.rank == 1 else "rank(s) [1]",
                 lambda: rlfuse.policy_loss(lp, old, bad_adv, mask,
                                            context_parallel_group=group))
    expect_error(ranks, "generator: ClipCov", lambda: rlfuse.policy_loss(
        lp, old, adv, mask, "clip_cov", context_parallel_group=group))
    # an overflowing r A on one rank's chunks only (in place: found after the group's sums)
    far = old.clone()
    if ranks.rank == 0:
        far[mask] = -800.0 + far[mask]
    for fn in (rlfuse.gppo_loss, rlfuse.reference.gppo_loss):
        expect_error(ranks, "overflows", lambda: fn(lp, far, -adv.abs() - 1, mask,
                                                    context_parallel_group=group))
    empty = mask.clone()
    empty[:GROUP] = False       # group 0 without actor tokens: only the whole sequences show it
    # a response without actor tokens on any rank: found from the chunks' counts (the scan)
    for fn in (rlfuse.gr_opd_loss, rlfuse.reference.gr_opd_loss):
        expect_error(ranks, "sequence", lambda: fn(lp, old, ranks.local(d["teacher"]), empty,
                                                   group_size=GROUP,
                                                   context_parallel_group=group))
    expect_error(ranks, "sequence", lambda: rlfuse.gr_opd_advantages(
        old, ranks.local(d["teacher"]), empty, group_size=GROUP, context_parallel_group=group))
    expect_error(ranks, "group", lambda: rlfuse.ggpo_loss(
        lp, ranks.local(d["ref"]), d["rewards"], empty, group_size=GROUP, beta=0.3,
        context_parallel_group=group))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--impls", default="fused,reference")
    p.add_argument("--forms", default="logprobs,logits,head")
    p.add_argument("--dtype", default="float64")
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    ranks = Ranks(dist.group.WORLD)
    impls = args.impls.split(",")
    if args.dtype == "float64":
        d = make_data()
        check_losses(d, ranks, impls, args.forms.split(","),
                     lambda form: (TOL["fp64_chain"], TOL["fp64_chain"]))
        check_advantages(d, ranks, impls)
        check_compiled(d, ranks)
        check_bad_layouts(d, ranks)
    else:
        # The losses and metrics sum the same terms in another order (each rank's chunks, or
        # the single pass against the log-prob kernels); from log-probs every token's gradient
        # is one process's bits (the same weights), from logits a bf16 gradient may round apart.
        check_losses(make_data(getattr(torch, args.dtype)), ranks, impls,
                     args.forms.split(","), lambda form: (
                         TOL["fp32_reduce"],
                         TOL["exact"] if form == "logprobs" else TOL["bf16_grad"]))
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {ranks.rank}: ok", flush=True)
    # every check passed: leave before the interpreter's teardown, where background threads
    # (gloo's, torch.compile's workers') can abort a finished process under load
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
