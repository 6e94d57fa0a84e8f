"""One rank of the vocabulary-split tests (``tests/test_vocab_split.py`` starts W of them with
``torch.distributed.run`` over ``gloo``): every loss and ``policy_logprobs``, in every policy
form (``Logits`` with a whole output and ``offset``, ``LinearHead``, both packed, a
``LinearHead`` with a logit scale, a softcap, both, an fp32 ``head_dtype``, and randomised
heads), with the
vocabulary split over the group, against the same call on the whole vocabulary in this process
— values, metrics, the shard's gradient, a ``LinearHead``'s full hidden-state gradient — for the
fused path and the reference; the split under ``torch.compile(fullgraph=True)`` equal to eager
and its custom ops opchecked (they need a process group); the collectives per call; the
data-parallel counts; bad input raised on every rank.

    python -m torch.distributed.run --standalone --nproc_per_node W tests/vocab_split_worker.py
        [--dtype float64] [--impls fused,reference]
        [--forms logits,head,packed,packed_head,scaled_head,softcapped_head,capped_head,fp32_head]
        [--random-heads N]
"""
import argparse
import datetime
import math
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import rlfuse  # noqa: E402
from conftest import SPLIT_GRAD_TOL, SPLIT_TOL  # noqa: E402  (this script's folder)

# The custom ops of the split, opchecked here (``tests/test_compile.py`` opchecks the others).
SPLIT_OPS = ("vocab_split_logprobs", "vocab_split_linear_logprobs", "gather_rows",
             "vocab_split_distill")
B, T, P, V_LOCAL, H, GROUP = 4, 5, 2, 7, 6, 2   # P prompt rows before the window (offset)
TOL, GRAD_TOL = SPLIT_TOL, SPLIT_GRAD_TOL


def make_data(world: int, dtype: torch.dtype):
    """The same data on every rank: a whole output [B, P + T + 1, V] with right padding, its
    packed rows, the head that makes it, the loss inputs; targets on every rank's shard."""
    g = torch.Generator().manual_seed(1234)
    V = V_LOCAL * world
    lengths = torch.tensor([5, 3, 4, 1])
    mask = torch.arange(T) < lengths[:, None]
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[0, :world] = torch.arange(world) * V_LOCAL + 1   # every shard holds some target
    hidden = torch.randn(B, P + T + 1, H, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) / H ** 0.5).to(dtype)
    bias = (0.1 * torch.randn(V, generator=g, dtype=torch.float64)).to(dtype)
    logits = (3 * torch.randn(B, P + T + 1, V, generator=g, dtype=torch.float64)).to(dtype)
    own = rlfuse.reference.token_logprobs(logits[:, P:P + T].double(), targets, mask=mask)
    old = torch.where(mask, own + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64),
                      0).clamp_max(0)
    # packed: sequence b's rows 0 .. P + len_b (prompt, response, the last row predicts nothing)
    rows = [torch.arange(P + int(n) + 1) for n in lengths]
    cu = torch.tensor([0] + torch.cumsum(torch.tensor([len(r) for r in rows]), 0).tolist())
    index = rlfuse.packed_index(cu, torch.full((B,), P + 1), T)
    seq = torch.repeat_interleave(torch.arange(B), torch.tensor([len(r) for r in rows]))
    pos = torch.cat(rows)
    t = (pos - P).clamp(0, T - 1)
    packed_targets = torch.where(index >= 0, targets[seq, t], torch.randint(0, V, seq.shape,
                                                                             generator=g))
    # sequence parallelism's packed rows: padded to a multiple of every group size (4) with
    # rows no loss position uses, as Megatron pads a packed batch to the tensor-parallel size
    pad = -len(seq) % 4
    sp = dict(sp_packed_hidden=torch.cat([hidden[seq, pos], hidden[0, :pad]]),
              sp_packed_targets=torch.cat([packed_targets, torch.zeros(pad, dtype=torch.long)]),
              sp_index=torch.cat([index, torch.full((pad,), -1)]))
    return dict(V=V, mask=mask, targets=targets, hidden=hidden, weight=weight, bias=bias, **sp,
                logits=logits, old=old.clamp_max(0), teacher=(own - 0.5).clamp_max(0),
                rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]),
                adv=torch.randn(B, generator=g, dtype=torch.float64),
                packed_logits=logits[seq, pos], packed_hidden=hidden[seq, pos],
                packed_targets=packed_targets, index=index)


def policy(lib, form, d, leaves, group):
    """The policy of ``form`` on ``leaves`` (whole or shard) with ``group`` (None: unsplit)."""
    kw = dict(vocab_parallel_group=group)
    if form == "logits":
        return lib.Logits(leaves[0], d["targets"], offset=P, **kw)
    if form == "packed":
        return lib.Logits(leaves[0], d["packed_targets"], index=d["index"], **kw)
    targets = {"packed_head": d["packed_targets"],
               "sp_packed_head": d["sp_packed_targets"]}.get(form, d["targets"])
    extra = {"packed_head": dict(index=d["index"]),
             "sp_packed_head": dict(index=d["sp_index"])}.get(form, dict(offset=P))
    extra.update(HEAD_OPTIONS.get(form, {}))
    if form.startswith("sp_"):   # sequence parallelism: this rank's rows of the hidden states
        extra["sequence_parallel"] = group is not None
    return lib.LinearHead(leaves[0], leaves[1], targets, leaves[2], chunk_tokens=3, **kw,
                          **extra)


# A model's head after its matmul: a logit scale (Cohere's 0.0625, Granite's), a softcap (Gemma),
# both, each with a temperature; the head's matmul in fp32 from the weight's dtype.
HEAD_OPTIONS = {
    "scaled_head": dict(logit_scale=0.0625, temperature=0.7),
    "softcapped_head": dict(softcap=1.25, temperature=1.3),
    "capped_head": dict(logit_scale=1.5, softcap=1.25),
    "fp32_head": dict(head_dtype=torch.float32, temperature=0.8),
}

CALLS = {
    "policy_logprobs": lambda lib, pol, d: lib.policy_logprobs(pol, return_entropy=True),
    "ggpo": lambda lib, pol, d: lib.ggpo_loss(pol, d["old"], d["rewards"], d["mask"],
                                              group_size=GROUP, beta=0.5),
    "gppo": lambda lib, pol, d: lib.gppo_loss(pol, d["old"], d["adv"], d["mask"]),
    "gr_opd": lambda lib, pol, d: lib.gr_opd_loss(pol, d["old"], d["teacher"], d["mask"],
                                                  group_size=GROUP),
    "gspo": lambda lib, pol, d: lib.ppo_loss(pol, d["old"], d["adv"], d["mask"],
                                             clip=(0.2, 0.28), ratio_level="sequence"),
    "ppo_dual": lambda lib, pol, d: lib.ppo_loss(pol, d["old"], d["adv"], d["mask"], clip=0.2,
                                                 dual_clip=3.0, agg="seq-mean-token-mean"),
    "policy_terms": lambda lib, pol, d: lib.policy_loss(
        pol, d["old"], d["adv"], d["mask"], rlfuse.objectives.SAPOTRL(),
        ref_logprobs=d["teacher"], kl=rlfuse.terms.KLPenalty(0.25, importance_weighted=True),
        entropy=rlfuse.terms.EntropyBonus(0.125)),
}


# the head's scale and softcap ride in the row kernels that every split LinearHead call shares:
# the log-probs (their backward) and one loss suffice
CALLS_OF = {form: ("policy_logprobs", "policy_terms") for form in HEAD_OPTIONS}


def scalar(out, d):
    """A scalar of every output (random weights on the per-token ones) to differentiate."""
    if not isinstance(out, rlfuse.LossOutput):     # (log-probs, entropy)
        g = torch.Generator().manual_seed(7)
        return sum((x * torch.randn(x.shape, generator=g, dtype=x.dtype)).sum() for x in out)
    return out.loss


def own_rows(form, hidden, rank, world):
    """This rank's rows of ``hidden`` (whole, or its gradient) under sequence parallelism: a
    slice of the rows of every sequence (``[B, S, H]``) or of the packed rows (``[N, H]``)."""
    if not form.startswith("sp_"):
        return hidden
    dim = hidden.dim() - 2
    n = hidden.shape[dim] // world
    return hidden.narrow(dim, rank * n, n)


def leaves_of(form, d, rank, world):
    """(whole leaves, shard leaves, the shard's slice): fresh leaves that require grad."""
    lo, hi = rank * V_LOCAL, (rank + 1) * V_LOCAL
    if form in ("logits", "packed"):
        whole = (d["packed_logits" if form == "packed" else "logits"],)
        shard = (whole[0][..., lo:hi],)
    else:
        h = {"packed_head": d["packed_hidden"],
             "sp_packed_head": d["sp_packed_hidden"]}.get(form, d["hidden"])
        whole = (h, d["weight"], d["bias"])
        shard = (own_rows(form, h, rank, world), d["weight"][lo:hi], d["bias"][lo:hi])
    fresh = lambda xs: tuple(x.detach().clone().requires_grad_() for x in xs)  # noqa: E731
    return fresh(whole), fresh(shard), slice(lo, hi)


def check_case(lib, form, name, d, group, rank, world, dtype):
    whole, shard, cols = leaves_of(form, d, rank, world)
    out_w = CALLS[name](lib, policy(lib, form, d, whole, None), d)
    out_s = CALLS[name](lib, policy(lib, form, d, shard, group), d)
    tol = TOL[dtype]
    where = f"rank {rank}/{world} {lib.__name__} {form} {name}"
    values_w, values_s = (out if not isinstance(out, rlfuse.LossOutput) else
                          (out.loss,) + tuple(out.metrics.values()) for out in (out_w, out_s))
    for a, b in zip(values_w, values_s):
        torch.testing.assert_close(b, a, rtol=tol, atol=tol, msg=lambda m: f"{where}: {m}")
    grads_w = torch.autograd.grad(scalar(out_w, d), whole)
    grads_s = torch.autograd.grad(scalar(out_s, d), shard)
    # dhidden: the whole (summed) one, of this rank's rows under sequence parallelism
    expected = [grads_w[0][..., cols]] if len(whole) == 1 else \
        [own_rows(form, grads_w[0], rank, world), grads_w[1][cols], grads_w[2][cols]]
    for i, (a, b) in enumerate(zip(expected, grads_s)):
        scale = max(1.0, a.double().abs().max().item())
        torch.testing.assert_close(b.double(), a.double(), rtol=0,
                                   atol=GRAD_TOL[dtype] * scale,
                                   msg=lambda m: f"{where} gradient {i}: {m}")


def check_distill(d, group, rank, world, dtype, impls):
    """Distillation over the split (both models' vocabularies split alike) against the whole
    vocabulary in this process: the loss, metrics, per-token divergence and the shard's
    gradient; a Logits and a LinearHead student beside a Logits, a LinearHead and a TopK
    teacher, the fused path and the reference."""
    from rlfuse.divergences import JSD, ForwardKL, ReverseKL

    g = torch.Generator().manual_seed(99)
    V = d["V"]
    lo, hi = rank * V_LOCAL, (rank + 1) * V_LOCAL
    t_logits = (2 * torch.randn(B, P + T, V, generator=g, dtype=torch.float64)).to(dtype)
    t_hidden = torch.randn(B, T, H + 1, generator=g, dtype=torch.float64).to(dtype)
    t_weight = torch.randn(V, H + 1, generator=g, dtype=torch.float64).to(dtype)
    top = torch.log_softmax(t_logits[:, P:].double(), -1).topk(3, -1)

    def teacher(form, split):
        kw = dict(vocab_parallel_group=group) if split else {}
        cols = slice(lo, hi) if split else slice(None)
        if form == "logits":
            return rlfuse.Logits(t_logits[..., cols], d["targets"], 1.2, offset=P, **kw)
        if form == "head":
            return rlfuse.LinearHead(t_hidden, t_weight[cols], d["targets"], temperature=1.2,
                                     logit_scale=0.5, softcap=2.0, **kw)
        return rlfuse.TopK(top.indices, top.values.to(dtype))

    libs = {"fused": rlfuse, "reference": rlfuse.reference}
    cases = [(s_form, t_form, div) for s_form in ("logits", "head")
             for t_form, div in (("logits", JSD(0.3)), ("head", ReverseKL()),
                                 ("top_k", ForwardKL(-4.0)))]
    for impl in impls:
        lib = libs[impl]
        for s_form, t_form, div in cases:
            where = f"rank {rank}/{world} {impl} distill {s_form}/{t_form}"
            whole, shard, cols = leaves_of(s_form, d, rank, world)
            s_whole, s_shard = (policy(lib, s_form, d, leaves, grp)
                                for leaves, grp in ((whole, None), (shard, group)))
            outs = [lib.distill_loss(s, teacher(t_form, split), d["mask"], div)
                    for s, split in ((s_whole, False), (s_shard, True))]
            per_token = [lib.token_divergence(s, teacher(t_form, split), div, d["mask"])
                         for s, split in ((s_whole, False), (s_shard, True))]
            tol = TOL[dtype]
            for a, b in zip((outs[0].loss, *outs[0].metrics.values(), per_token[0]),
                            (outs[1].loss, *outs[1].metrics.values(), per_token[1])):
                torch.testing.assert_close(b, a, rtol=tol, atol=tol,
                                           msg=lambda m: f"{where}: {m}")
            grads_w = torch.autograd.grad(outs[0].loss, whole)
            grads_s = torch.autograd.grad(outs[1].loss, shard)
            expected = [grads_w[0][..., cols]] if len(whole) == 1 else \
                [grads_w[0], grads_w[1][cols], grads_w[2][cols]]
            for i, (a, b) in enumerate(zip(expected, grads_s)):
                scale = max(1.0, a.double().abs().max().item())
                torch.testing.assert_close(b.double(), a.double(), rtol=0,
                                           atol=GRAD_TOL[dtype] * scale,
                                           msg=lambda m: f"{where} gradient {i}: {m}")
    # a teacher split over no group, or another group's, is refused on every rank
    s_shard = policy(rlfuse, "logits", d, leaves_of("logits", d, rank, world)[1], group)
    for bad in (teacher("logits", False), teacher("logits", True)._replace(
            vocab_parallel_group=dist.new_group(list(range(world))))):
        try:
            rlfuse.distill_loss(s_shard, bad, d["mask"], JSD(0.5))
        except ValueError as e:
            assert "teacher.vocab_parallel_group" in str(e), e
        else:
            raise AssertionError(f"rank {rank}: a teacher not split alike is not refused")


def check_random_heads(group, rank, world, draws: int):
    """Randomised heads over the split, the same draws on every rank: a shard width, a batch,
    a logit scale (or none), a softcap (or none), a temperature, a bias (or none), fp64 or
    fp32; the split's log-probs, entropy and every gradient equal to the whole head's."""
    g = torch.Generator().manual_seed(99)
    pick = lambda *xs: xs[int(torch.randint(len(xs), (1,), generator=g))]  # noqa: E731
    uniform = lambda lo, hi: lo + (hi - lo) * float(torch.rand((), generator=g))  # noqa: E731
    for draw in range(draws):
        dtype = pick(torch.float64, torch.float32)
        v_local, h, b, t = (int(torch.randint(lo, hi, (1,), generator=g))
                            for lo, hi in ((2, 12), (2, 9), (1, 4), (1, 6)))
        head = dict(logit_scale=pick(1.0, uniform(0.05, 3.0)), softcap=pick(None, uniform(0.5, 30)),
                    temperature=pick(1.0, uniform(0.3, 2.0)))
        V = v_local * world
        hidden = torch.randn(b, t, h, generator=g, dtype=torch.float64).to(dtype)
        weight = (4 * torch.randn(V, h, generator=g, dtype=torch.float64) / h ** 0.5).to(dtype)
        bias = pick(None, torch.randn(V, generator=g, dtype=torch.float64).to(dtype))
        targets = torch.randint(0, V, (b, t), generator=g)
        upstream = torch.randn(2, b, t, generator=g, dtype=torch.float64).to(dtype)
        lo, hi = rank * v_local, (rank + 1) * v_local
        results = []
        for w, bb, grp in ((weight, bias, None),
                           (weight[lo:hi], None if bias is None else bias[lo:hi], group)):
            leaves = [x.detach().clone().requires_grad_() for x in (hidden, w) +
                      (() if bb is None else (bb,))]
            policy = rlfuse.LinearHead(leaves[0], leaves[1], targets, *leaves[2:],
                                       chunk_tokens=pick(2, 64), vocab_parallel_group=grp,
                                       **head)
            logp, entropy = rlfuse.policy_logprobs(policy, return_entropy=True)
            grads = torch.autograd.grad((logp * upstream[0] + entropy * upstream[1]).sum(),
                                        leaves)
            results.append((logp, entropy, *grads))
        whole, split = results
        whole = whole[:3] + tuple(x[lo:hi] for x in whole[3:])   # this rank's rows of the head
        where = f"rank {rank}/{world} draw {draw} {dtype} V_l={v_local} {head} bias={bias is not None}"
        for i, (a, c) in enumerate(zip(whole, split)):
            scale = max(1.0, a.double().abs().max().item())
            torch.testing.assert_close(c.double(), a.double(), rtol=0,
                                       atol=SPLIT_GRAD_TOL[dtype] * scale,
                                       msg=lambda m: f"{where} output {i}: {m}")


def check_bad_input(group, rank, world):
    """Shards of different sizes, ragged sequence-parallel rows and a target beyond the split
    vocabulary raise on every rank (the size checks are themselves collectives: no rank is left
    waiting)."""
    V_l = V_LOCAL + (1 if rank == world - 1 else 0)
    logits = torch.randn(1, 3, V_l)
    targets = torch.zeros(1, 3, dtype=torch.long)
    for lib in (rlfuse, rlfuse.reference):
        try:
            lib.policy_logprobs(lib.Logits(logits, targets, vocab_parallel_group=group))
        except ValueError as e:
            assert "same size V_local" in str(e), e
        else:
            raise AssertionError(f"rank {rank}: ragged shards were accepted")
    # sequence parallelism with ragged row slices: raised by the gather's own count, every rank
    hidden = torch.randn(1, 2 + (rank == world - 1), 3)
    for lib in (rlfuse, rlfuse.reference):
        head = lib.LinearHead(hidden, torch.randn(V_LOCAL, 3), torch.zeros(1, 2, dtype=torch.long),
                              vocab_parallel_group=group, sequence_parallel=True)
        try:
            lib.policy_logprobs(head)
        except ValueError as e:
            assert "holds as many rows" in str(e), e
        else:
            raise AssertionError(f"rank {rank}: ragged sequence-parallel rows were accepted")
    logits = torch.randn(1, 3, V_LOCAL)
    targets = torch.tensor([[0, V_LOCAL * world, 1]])
    try:
        rlfuse.policy_logprobs(rlfuse.Logits(logits, targets, vocab_parallel_group=group))
    except ValueError as e:
        assert f"[0, {V_LOCAL * world})" in str(e), e
    else:
        raise AssertionError(f"rank {rank}: a target beyond the vocabulary was accepted")


def check_collectives(d, group, rank, world):
    """Per fused call, the collectives and the head's matmuls that form logits (``linear``):
    one all-gather of the shard sizes (validate=True only). Logits: one all-gather of the
    [N, 4] statistics forward, nothing backward. A LinearHead's two passes (GGPO): the
    statistics forward, each chunk formed forward and backward, one all-reduce of the
    hidden-state gradient backward; its single pass (GPPO): each chunk formed once, its
    statistics gathered, the hidden-state gradient's all-reduce forward, nothing backward.
    Sequence parallelism: the hidden-state gradient reduce-scattered instead of all-reduced.
    Nothing else crosses ranks."""
    calls = []
    originals = {name: getattr(dist, name)
                 for name in ("all_gather", "all_reduce", "reduce_scatter_tensor")}
    linear = torch.nn.functional.linear

    def counted(name, fn):
        def call(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return call

    for name, fn in originals.items():
        setattr(dist, name, counted(name, fn))
    torch.nn.functional.linear = counted("linear", linear)
    chunks = -(-int(d["mask"].sum()) // 3)       # the actor rows (validate) in chunks of 3
    gppo = lambda pol, validate: rlfuse.gppo_loss(  # noqa: E731
        pol, d["old"], d["adv"], d["mask"], validate=validate)
    ggpo = lambda pol, validate: rlfuse.ggpo_loss(  # noqa: E731
        pol, d["old"], d["rewards"], d["mask"], group_size=GROUP, beta=0.5, validate=validate)
    try:
        for form, loss, validate, forward, backward in (
                ("logits", gppo, True, ["all_gather"] * 2, []),
                ("logits", gppo, False, ["all_gather"], []),
                ("head", ggpo, True, ["all_gather"] + ["linear"] * chunks + ["all_gather"],
                 ["linear"] * chunks + ["all_reduce"]),
                ("head", gppo, True,
                 ["all_gather"] + ["linear", "all_gather"] * chunks + ["all_reduce"], []),
                # sequence parallelism: the row counts compared, the rows gathered, then the
                # split over every row, whose hidden-state gradient is reduce-scattered to
                # each rank's rows (the gather's backward: no collective)
                ("sp_head", gppo, False,
                 ["all_gather"] * 2 + ["linear", "all_gather"] * (-(-B * T // 3)) +
                 ["reduce_scatter_tensor"], []),
                ("sp_head", ggpo, True, ["all_gather"] * 3 + ["linear"] * chunks +
                 ["all_gather"], ["linear"] * chunks + ["reduce_scatter_tensor"])):
            _, shard, _ = leaves_of(form, d, rank, world)
            calls.clear()
            out = loss(policy(rlfuse, form, d, shard, group), validate)
            assert calls == forward, (form, validate, calls)
            calls.clear()
            torch.autograd.grad(out.loss, shard[0])
            assert calls == backward, (form, calls)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        torch.nn.functional.linear = linear


def check_traffic(d, group, rank, world):
    """What a LinearHead's chunks of shard logits move over the split, counted in the Triton
    interpreter (``tools.traffic``) in rows of ``V_l`` elements per actor row, the matmuls
    that form the chunks apart (``check_collectives`` counts them): the single pass (GPPO)
    reads each row of its one formation for the statistics (and the target logit), then in
    the write pass, and writes its gradient once; the two passes (GGPO) read the forward's
    formation once (and the target logit) and the backward's once, and write the gradient
    once. The same kernel bytes: the single pass saves a formation, its matmul and its write.
    Sequence parallelism (``sp_head``) moves the same bytes: its gather is of hidden rows."""
    from tools import traffic     # the repository root is on PYTHONPATH (test_vocab_split)

    actor = int(d["mask"].sum())
    gppo = lambda pol: rlfuse.gppo_loss(pol, d["old"], d["adv"], d["mask"])  # noqa: E731
    ggpo = lambda pol: rlfuse.ggpo_loss(  # noqa: E731
        pol, d["old"], d["rewards"], d["mask"], group_size=GROUP, beta=0.5)
    for form, name, loss in (("head", "gppo", gppo), ("head", "ggpo", ggpo),
                             ("sp_head", "gppo", gppo), ("sp_head", "ggpo", ggpo)):
        _, shard, _ = leaves_of(form, d, rank, world)
        with traffic.KernelCounter() as counter:
            torch.autograd.grad(loss(policy(rlfuse, form, d, shard, group)).loss, shard[0])
        moved = [0, 0]
        for launch in counter.launches:
            chunks = {t.data_ptr(): t.numel() * t.element_size() for t in launch.tensors
                      if t.dim() == 3 and tuple(t.shape[1:]) == (1, V_LOCAL)}
            for i, kind in enumerate(("loads", "stores")):
                for addresses, _ in getattr(launch, kind):
                    moved[i] += sum(int(((addresses >= p) & (addresses < p + n)).sum())
                                    for p, n in chunks.items())
        rows = tuple(m / (actor * V_LOCAL) for m in moved)
        assert abs(rows[0] - (2 + 1 / V_LOCAL)) < 1e-12 and abs(rows[1] - 1) < 1e-12, \
            (form, name, rows)


def check_compiled(d, group, rank, world):
    """torch.compile(fullgraph=True) traces the split forward and backward, Logits and
    LinearHead, packed too, equal to eager (aot_eager: the same kernels and torch ops)."""
    steps = {
        "gppo": lambda pol: rlfuse.gppo_loss(pol, d["old"], d["adv"], d["mask"],
                                             validate=False).loss,
        "policy_logprobs": lambda pol: sum(
            (x * (i + 1)).sum() for i, x in enumerate(
                rlfuse.policy_logprobs(pol, return_entropy=True, validate=False))),
    }
    for form in ("logits", "head", "packed", "packed_head", "sp_head", "sp_packed_head"):
        for name, step in steps.items():
            _, shard, _ = leaves_of(form, d, rank, world)

            def run(*leaves):
                return step(policy(rlfuse, form, d, leaves, group))

            torch._dynamo.reset()
            eager = run(*shard)
            compiled = torch.compile(run, backend="aot_eager", fullgraph=True)(*shard)
            torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
            for a, b in zip(torch.autograd.grad(eager, shard),
                            torch.autograd.grad(compiled, shard)):
                torch.testing.assert_close(b, a, rtol=0, atol=0,
                                           msg=lambda m: f"rank {rank} {form} {name}: {m}")


def check_opcheck(d, group, rank, world):
    """torch.library.opcheck of the split's ops (and of a LinearHead's backward and single pass
    over the split, and of sequence parallelism's gather of the rows): schema, autograd
    registration, the fake implementation against the real one, AOT dispatch with dynamic
    shapes."""
    from rlfuse.fused_losses.head import linear_head
    from rlfuse.fused_losses.logits import vocab_split as vocab_op
    from rlfuse.scaleout.vocab import shard_targets

    name = group.group_name
    _, (logits,), _ = leaves_of("logits", d, rank, world)
    _, (hidden, weight, bias), _ = leaves_of("head", d, rank, world)
    cases = {
        "vocab_split_logprobs": [(logits, d["targets"], d["mask"], 0.9, True, False, P, name),
                                 (logits, d["targets"], None, 1.0, False, False, P, name)],
        "vocab_split_linear_logprobs": [
            (hidden, weight, bias, d["targets"], d["mask"], 0.9, 0.5, 3.0, P, 3, False, True,
             name),
            (hidden, weight, None, d["targets"], None, 1.0, 1.0, 0.0, P, 4, False, False, name)],
    }
    ops = {"vocab_split_logprobs": vocab_op.vocab_split_logprobs_op,
           "vocab_split_linear_logprobs": vocab_op.vocab_split_linear_logprobs_op}
    # a LinearHead's backward over the split (its hidden-state gradient summed in fp32)
    head = tuple(x.detach() for x in (hidden, weight, bias))   # a backward: no autograd of its own
    _, entropy, stats = vocab_op.vocab_split_linear_logprobs_op(
        *head, d["targets"], d["mask"], 0.9, 0.5, 3.0, P, 3, False, True, name)
    local = shard_targets(d["targets"], V_LOCAL, name)[0]
    upstream = torch.randn(2, B, T, dtype=hidden.dtype)
    ops["linear_logprobs_backward"] = linear_head.linear_logprobs_backward_op
    cases["linear_logprobs_backward"] = [
        (*head, local, d["mask"], stats, entropy, upstream[0], upstream[1], 0.9, 0.5, 3.0, P, 3,
         False, [True, True, True], name),
        # sequence parallelism: the hidden-state gradient reduce-scattered to this rank's rows
        (*head, local, d["mask"], stats, entropy, upstream[0], upstream[1], 0.9, 0.5, 3.0, P, 3,
         False, [True, False, False], name, False, B)]
    # the single pass of a LinearHead (tests/test_compile.py opchecks it unsplit) over the split
    row_scale = torch.full((B,), 0.1, dtype=hidden.dtype)
    ops["linear_surrogate"] = linear_head.linear_surrogate_op
    cases["linear_surrogate"] = [
        (hidden, weight, bias, d["targets"], d["mask"], d["old"], d["adv"], None, row_scale,
         d["teacher"], 0.5 * row_scale, 0.25 * row_scale, 0.9, 0.5, 3.0, "sapo", "ppo_clip",
         "mc", 1.0, 1.0, [1.0, 1.05], 20.0, "k1", True, False, False, P, 3, False,
         [True, True, True], name),
        (hidden, weight, None, d["targets"], d["mask"], None, d["adv"], None, row_scale, None,
         None, None, 1.0, 1.0, 0.0, "clip", "ppo_clip", "mc", 0.2, 0.28, [3.0, math.inf], 20.0, "",
         False, False, False, P, 4, True, [True, True, False], name),
        (hidden, weight, None, d["targets"], d["mask"], None, d["adv"], None, row_scale, None,
         None, None, 1.0, 1.0, 0.0, "clip", "ppo_clip", "mc", 0.2, 0.28, [3.0, math.inf], 20.0, "",
         False, False, False, P, 4, True, [True, False, False], name, B)]
    # sequence parallelism's gather of the rows (its backward keeps this rank's rows)
    from rlfuse.scaleout.sequence import gather_rows

    ops["gather_rows"] = gather_rows
    cases["gather_rows"] = [(own_rows("sp_head", hidden, rank, world), 1, name),
                            (own_rows("sp_packed_head", d["sp_packed_hidden"], rank, world)
                             .clone().requires_grad_(), 0, name)]
    # distillation between two Logits over the split
    from rlfuse.fused_losses.logits import distill

    t_logits = torch.randn_like(logits.detach()) * 2
    ops["vocab_split_distill"] = distill.vocab_split_distill_op
    cases["vocab_split_distill"] = [
        (logits, t_logits, d["mask"], 0.9, 1.2, P, P, "jsd", [0.3, math.log(0.7), math.log(0.3)],
         name),
        (logits, t_logits, d["mask"], 1.0, 1.0, P, 0, "reverse_kl", [], name, 0.5, 2.0)]
    # a TopK teacher's ids (global) over the split, both student forms
    from rlfuse.fused_losses import top_k

    ids = torch.randint(0, d["V"], (B, T, 3), generator=torch.Generator().manual_seed(5))
    ops["logprobs_at"], ops["linear_logprobs_at"] = top_k.logprobs_at_op, \
        top_k.linear_logprobs_at_op
    cases["logprobs_at"] = [(logits, ids, d["mask"], 0.9, P, name)]
    cases["linear_logprobs_at"] = [(hidden, weight, bias, ids, d["mask"], 0.9, 0.5, 3.0, P, 3,
                                    False, False, name)]
    # a LinearHead student beside a LinearHead teacher over the split
    from rlfuse.fused_losses.head import linear_distill

    ops["linear_distill"] = linear_distill.linear_distill_op
    cases["linear_distill"] = [(hidden, weight, bias, hidden.detach().flip(0), weight.detach(),
                                None, d["mask"], 0.9, 0.5, 3.0, 1.2, 1.0, 0.0, P, P,
                                "reverse_kl", [], 3, False, False, name)]
    assert set(SPLIT_OPS) <= set(cases)
    for op_name, arguments in cases.items():
        for args in arguments:
            torch.library.opcheck(ops[op_name], args)


def check_invariant_over_ranks(group, rank, world):
    """A batch-invariant head over the split (its vocabulary whole blocks of ``VOCAB_BLOCK``
    ids): every row's log-prob and entropy and the losses (the single pass and GGPO's two)
    the same bits as the whole head on one process, so the same on 1, 2 and 4 ranks, and so of
    ``Logits`` (each shard's gradient too); a shard of a partial block refused on every
    rank."""
    from rlfuse.kernels.tiles.tile_stats import VOCAB_BLOCK

    g = torch.Generator().manual_seed(17)
    vocab, width, n, t = 4 * VOCAB_BLOCK, 5, 4, 3
    mask = torch.rand(n, t, generator=g) > 0.3
    mask[:, 0] = True
    old, adv = torch.randn(n, t, generator=g) - 4, torch.randn(n, t, generator=g)
    rewards = torch.randn(n, generator=g)
    calls = (lambda h: rlfuse.policy_logprobs(h, return_entropy=True),
             lambda h: (rlfuse.gppo_loss(h, old, adv, mask).loss,),
             lambda h: (rlfuse.ggpo_loss(h, old, rewards, mask, group_size=GROUP,
                                                 beta=0.5).loss,))
    for dtype in (torch.float32, torch.bfloat16):
        hidden = torch.randn(n, t + 1, width, generator=g).to(dtype)
        weight, bias = torch.randn(vocab, width, generator=g).to(dtype), \
            torch.randn(vocab, generator=g).to(dtype)
        targets = torch.randint(0, vocab, (n, t), generator=g)
        shard = slice(rank * vocab // world, (rank + 1) * vocab // world)

        def head(w, bs, grp):
            return rlfuse.LinearHead(hidden, w, targets, bias=bs, offset=1, temperature=0.7,
                                     chunk_tokens=5, vocab_parallel_group=grp,
                                     batch_invariant=True)

        for call in calls:
            for got, want in zip(call(head(weight[shard], bias[shard], group)),
                                 call(head(weight, bias, None))):
                assert torch.equal(got, want), (dtype, rank, world)
        # the gradients: the split's (its hidden states' summed over the ranks) the whole's
        leaves = [x.detach().requires_grad_() for x in (hidden, weight, bias)]
        hidden = leaves[0]
        for call in calls[1:]:
            whole = torch.autograd.grad(call(head(leaves[1], leaves[2], None))[0], leaves)
            split = torch.autograd.grad(call(head(leaves[1][shard], leaves[2][shard], group))[0],
                                        leaves)
            for i, (a, b) in enumerate(zip((whole[0], whole[1][shard], whole[2][shard]),
                                           (split[0], split[1][shard], split[2][shard]))):
                scale = max(1.0, a.double().abs().max().item())
                torch.testing.assert_close(b.double(), a.double(), rtol=0,
                                           atol=SPLIT_GRAD_TOL[dtype] * scale,
                                           msg=lambda m: f"invariant gradient {i}: {m}")
        # Logits over the split: the same bits, the gradient of each shard too
        logits = torch.randn(n, t + 1, vocab, generator=g).to(dtype).requires_grad_()
        grads = []
        for rows, grp in ((logits[..., shard], group), (logits, None)):
            policy = rlfuse.Logits(rows, targets, temperature=0.7, offset=1,
                                   vocab_parallel_group=grp, batch_invariant=True)
            got = [call(policy) for call in calls[::2]]
            grads.append(torch.autograd.grad(got[1][0], logits)[0][..., shard])
            if grp is not None:
                split = got
        for got, want in zip(split, got):
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (dtype, rank, world)
        assert torch.equal(*grads), (dtype, rank, world)
        # a shard whose columns are not adjacent in memory: the same bits
        strided = torch.stack([logits.detach(), logits.detach()], -1)[..., 0][..., shard]
        assert strided.stride(-1) != 1
        lp, entropy = rlfuse.policy_logprobs(rlfuse.Logits(
            strided, targets, temperature=0.7, offset=1, vocab_parallel_group=group,
            batch_invariant=True), return_entropy=True)
        assert torch.equal(lp, split[0][0]) and torch.equal(entropy, split[0][1])
    partial = VOCAB_BLOCK // 2
    targets = targets % (partial * world)
    try:
        rlfuse.policy_logprobs(head(weight[:partial], bias[:partial], group))
    except ValueError as e:
        assert f"whole blocks of {VOCAB_BLOCK} ids" in str(e), e
    else:
        raise AssertionError(f"rank {rank}: a shard of a partial block was accepted")


def check_rows_over_ranks(group, rank, world):
    """A batch-invariant head over the split: a row's log-probs, its divergence from a
    batch-invariant teacher head and its hidden-state gradient (each rank's part summed in rank
    order) the same bits alone and among other rows, at other places (an all-reduce's ring,
    gloo's too, orders an element's sum by its place in the tensor); fp32 and bf16."""
    from rlfuse.divergences import JSD
    from rlfuse.kernels.tiles.tile_stats import VOCAB_BLOCK
    from rlfuse.scaleout import sequence, vocab as split

    # the sums in rank order are the sums (integers: exact in any order), at a size that is
    # no multiple of the ranks, and to each rank's rows of the sequence-parallel blocks
    x = torch.randint(-50, 50, (7, 3), generator=torch.Generator().manual_seed(rank)).double()
    summed, ordered = x.clone(), x.clone()
    split.group_sum(summed, group.group_name)
    split.ordered_sum(ordered, group.group_name)
    assert torch.equal(summed, ordered), rank
    x = torch.randint(-50, 50, (3 * world * 2, 4), generator=torch.Generator().manual_seed(rank))
    summed, ordered = x.double(), x.double()
    sequence.sum_to_own_rows(summed, 3, group.group_name)
    sequence.sum_to_own_rows(ordered, 3, group.group_name, ordered=True)
    assert torch.equal(summed, ordered), rank
    g = torch.Generator().manual_seed(23)
    vocab, width, t_width, t = 2 * world * VOCAB_BLOCK, 6, 5, 3
    shard = slice(rank * vocab // world, (rank + 1) * vocab // world)
    for dtype, teacher_form in ((torch.float32, "head"), (torch.bfloat16, "logits")):
        weight = torch.randn(vocab, width, generator=g).to(dtype)
        t_weight = torch.randn(vocab, t_width, generator=g).to(dtype)

        def rows(n):
            return (torch.randn(n, t + 1, width, generator=g).to(dtype),
                    (torch.randn(n, t, t_width, generator=g) if teacher_form == "head" else
                     3 * torch.randn(n, t + 1, vocab, generator=g)).to(dtype),
                    torch.randint(0, vocab, (n, t), generator=g))

        def results(hidden, t_rows, targets, chunk, cols=shard, grp=group):
            hidden = hidden.clone().requires_grad_()
            student = rlfuse.LinearHead(hidden, weight[cols], targets, offset=1,
                                        chunk_tokens=chunk, vocab_parallel_group=grp,
                                        batch_invariant=True)
            if teacher_form == "head":
                teacher = rlfuse.LinearHead(t_rows, t_weight[cols], targets, temperature=1.3,
                                            vocab_parallel_group=grp, batch_invariant=True)
            else:
                teacher = rlfuse.Logits(t_rows[..., cols], targets, temperature=1.3, offset=1,
                                        vocab_parallel_group=grp)
            lp = rlfuse.policy_logprobs(student)
            value = rlfuse.token_divergence(student, teacher, JSD(0.5))
            (lp.sum() + value.sum()).backward()
            return lp.detach(), value.detach(), hidden.grad

        row = rows(1)
        alone = results(*row, None)
        for n, place, chunk in ((5, 3, None), (14, 9, 7)):
            batch = rows(n)
            for x, x_row in zip(batch, row):
                x[place] = x_row[0]
            split = results(*batch, chunk)
            for i, (got, want) in enumerate(zip(split, alone)):
                assert torch.equal(got[place], want[0]), (dtype, rank, world, n, i)
        # the split's against one process's whole head (its divergence's sums in another
        # order)
        for i, (got, want) in enumerate(zip(split, results(*batch, chunk, slice(None), None))):
            torch.testing.assert_close(got, want, rtol=0, atol=SPLIT_GRAD_TOL[dtype] * max(
                1.0, want.abs().max().item()), msg=lambda m: f"split {i}: {m}")


def check_counts(rank, world):
    mask = torch.zeros(2, world, dtype=torch.bool)
    mask[0, :rank + 1] = True                       # rank r: r + 1 tokens in one sequence
    tokens, sequences = rlfuse.global_counts(mask)
    assert tokens.item() == world * (world + 1) / 2 and sequences.item() == world, \
        (tokens, sequences)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="float64")
    p.add_argument("--impls", default="fused,reference")
    p.add_argument("--forms", default="logits,head,packed,packed_head,scaled_head,"
                                      "softcapped_head,capped_head,sp_head,sp_packed_head")
    p.add_argument("--calls", default=",".join(CALLS))
    p.add_argument("--random-heads", type=int, default=0,
                   help="that many randomised heads over the split (check_random_heads)")
    p.add_argument("--compile", action="store_true",
                   help="also torch.compile the split and opcheck its ops")
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    dtype = getattr(torch, args.dtype)
    d = make_data(world, dtype)
    libs = {"fused": rlfuse, "reference": rlfuse.reference}
    for impl in args.impls.split(","):
        for form in args.forms.split(","):
            for name in args.calls.split(","):
                if name in CALLS_OF.get(form, (name,)):
                    check_case(libs[impl], form, name, d, group, rank, world, dtype)
    check_distill(d, group, rank, world, dtype, args.impls.split(","))
    check_random_heads(group, rank, world, args.random_heads)
    check_collectives(d, group, rank, world)
    check_traffic(d, group, rank, world)
    if args.compile:
        check_compiled(d, group, rank, world)
        check_opcheck(d, group, rank, world)
    check_bad_input(group, rank, world)
    check_invariant_over_ranks(group, rank, world)
    check_rows_over_ranks(group, rank, world)
    check_counts(rank, world)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: ok", flush=True)
    # every check passed: leave before the interpreter's teardown, where background threads
    # (gloo's, torch.compile's workers') can abort a finished process under load
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
