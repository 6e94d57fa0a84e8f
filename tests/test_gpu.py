"""What only a GPU shows: concurrency inside a row, several devices, streams, alignment, int64
offsets at real sizes, approximate math, fp32 argument passing, determinism. Every test is
marked ``gpu`` (skipped without CUDA; ``bench/gpu_check.sh`` runs them)."""
import pytest
import torch

import rlfuse
from rlfuse import reference

from conftest import TOL, assert_three_way

pytestmark = pytest.mark.gpu
B, T, V, M = 4, 6, 8192 + 77, 2   # bf16: two 8192-wide blocks of 16 warps, a ragged tail


def case(device, dtype=torch.bfloat16, *, seed=0, vocab=V, batch=B, time=T, scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, time, generator=gen) > 0.25
    mask[:, 0] = True
    logits = torch.randn(batch, time, vocab, generator=gen) * scale
    targets = torch.randint(0, vocab, (batch, time), generator=gen)
    targets[:, 0] = vocab - 1                                     # a target in the last block
    old = torch.log_softmax(logits.double(), -1).gather(-1, targets[..., None])[..., 0]
    old = (old + 0.3 * torch.randn(batch, time, generator=gen, dtype=torch.float64)).float()
    x = dict(logits=logits.to(dtype), targets=targets, mask=mask, old=old, ref=old - 0.1,
             teacher=old - 0.4, adv=torch.randn(batch, generator=gen),
             rewards=(torch.rand(batch, generator=gen) > 0.5).float())
    return {k: v.to(device) for k, v in x.items()}


def unaligned_copy(t):
    """``t`` copied into a buffer one element past an allocation's start: its rows stay where
    no vectorised access may assume 16-byte alignment (``clone`` would realign them)."""
    storage = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = storage[1:].view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % 16 != 0
    return out


def every_op(x, *, inplace=False, leaf_of=torch.clone):
    """{name: (outputs, gradient w.r.t. the logits)} of every op from logits; ``leaf_of``: the
    copy of the logits each op differentiates."""
    results = {}

    def run(name, fn):
        leaf = leaf_of(x["logits"]).requires_grad_(True)
        outs = fn(leaf)
        outs = outs if isinstance(outs, tuple) else (outs,)
        (grad,) = torch.autograd.grad(sum(o.sum() for o in outs if o.requires_grad), leaf)
        results[name] = ([o.detach() for o in outs], grad)

    policy = lambda leaf: rlfuse.Logits(leaf, x["targets"], 0.9, inplace)  # noqa: E731
    run("token_logprobs", lambda leaf: rlfuse.token_logprobs(
        leaf, x["targets"], mask=x["mask"], return_entropy=True, inplace_backward=inplace))
    run("ggpo", lambda leaf: rlfuse.ggpo_loss(policy(leaf), x["ref"], x["rewards"], x["mask"],
                                              group_size=M, beta=0.5).loss)
    run("gppo", lambda leaf: rlfuse.gppo_loss(policy(leaf), x["old"], x["adv"], x["mask"],
                                              geometry="kl", topology="binary").loss)
    run("gr_opd", lambda leaf: rlfuse.gr_opd_loss(policy(leaf), x["old"], x["teacher"],
                                                  x["mask"], group_size=M).loss)
    return results


def assert_equal_results(a, b):
    assert a.keys() == b.keys()
    for name in a:
        for u, v in zip(a[name][0], b[name][0]):
            assert torch.equal(u.cpu(), v.cpu()), name
        assert torch.equal(a[name][1].cpu(), b[name][1].cpu()), name


def test_deterministic():
    """Every op, forward and backward, twice: bit-identical (no atomics, fixed reduction
    order)."""
    x = case("cuda")
    assert_equal_results(every_op(x), every_op(x))


@pytest.mark.parametrize("loss", ["gppo", "policy_logprobs"])
def test_linear_head_deterministic(loss):
    """A bf16 LinearHead over several chunks, an upstream gradient of 0.3, twice: the loss and
    the gradients of hidden, weight and bias bit-identical (no atomic add anywhere in the
    head's path)."""
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(5)
    Bh, Th, H, Vh = 4, 96, 128, 30011
    hidden = torch.randn(Bh, Th + 1, H, generator=gen).to(device, torch.bfloat16)
    weight = (torch.randn(Vh, H, generator=gen) / H ** 0.5).to(device, torch.bfloat16)
    bias = (0.1 * torch.randn(Vh, generator=gen)).to(device, torch.bfloat16)
    targets = torch.randint(0, Vh, (Bh, Th), generator=gen).to(device)
    mask = (torch.rand(Bh, Th, generator=gen) > 0.2).to(device)
    old = (-4 * torch.rand(Bh, Th, generator=gen)).to(device)
    adv = torch.randn(Bh, generator=gen).to(device)

    def run():
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        head = rlfuse.LinearHead(*leaves[:2], targets, leaves[2], offset=1, chunk_tokens=100)
        out = (rlfuse.gppo_loss(head, old, adv, mask).loss if loss == "gppo" else
               (rlfuse.policy_logprobs(head) * mask).sum())
        grads = torch.autograd.grad(out * 0.3, leaves)
        return [out.detach()] + list(grads)

    for a, b in zip(run(), run()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_invariant_head_on_the_gpu(dtype):
    """On the GPU's own matmul (the interpreter's is numpy's): a row's log-prob, entropy and
    hidden-state gradient the same bits alone and among 300 random rows (several row tiles),
    at two chunk sizes, at a real hidden size and a vocabulary of several tiles, and
    ``token_logprobs`` of ``head_logits`` the head's; the default head (cuBLAS) is not held to
    it."""
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(6)
    Tq, H, Vh = 7, 1024, 30011
    weight = (torch.randn(Vh, H, generator=gen) / H ** 0.5).to(device, dtype)
    bias = (0.1 * torch.randn(Vh, generator=gen)).to(device, dtype)
    row = torch.randn(1, Tq + 1, H, generator=gen).to(device, dtype)
    row_targets = torch.randint(0, Vh, (1, Tq), generator=gen).to(device)

    def results(hidden, targets, chunk):
        hidden = hidden.clone().requires_grad_()
        head = rlfuse.LinearHead(hidden, weight, targets, bias=bias, chunk_tokens=chunk,
                                 softcap=30.0, batch_invariant=True)
        lp, entropy = rlfuse.policy_logprobs(head, return_entropy=True)
        (lp.sum() + 0.5 * entropy.sum()).backward()
        return lp.detach(), entropy.detach(), hidden.grad

    alone = results(row, row_targets, None)
    for chunk in (None, 333):
        hidden = torch.randn(300, Tq + 1, H, generator=gen).to(device, dtype)
        targets = torch.randint(0, Vh, (300, Tq), generator=gen).to(device)
        hidden[211], targets[211] = row[0], row_targets[0]
        for got, want in zip(results(hidden, targets, chunk), alone):
            assert torch.equal(got[211], want[0]), chunk
    # a rollout engine's logits (head_logits) give the head's log-probs bit for bit
    plain = rlfuse.LinearHead(row, weight, row_targets, bias=bias, batch_invariant=True)
    lp = rlfuse.token_logprobs(rlfuse.head_logits(row[:, :-1], weight, bias), row_targets,
                               batch_invariant=True)
    assert torch.equal(rlfuse.policy_logprobs(plain).detach(), lp.detach())


@pytest.mark.parametrize("teacher_form", ["head", "logits"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_invariant_distillation_on_the_gpu(dtype, teacher_form):
    """A batch-invariant student head beside a batch-invariant teacher head or the teacher's
    logits (``kernels.tiles.distill_tiles``, tensor cores in bf16): a position's divergence and the
    student's hidden-state gradient the same bits alone and among 300 random rows, at two chunk
    sizes, at real hidden sizes and a vocabulary of many blocks, and against float64 by the
    three-way rule (the reference's batch-invariant heads: each row's matmul its own)."""
    from rlfuse.divergences import JSD

    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(9)
    Tq, H, H_t, Vh = 7, 1024, 1536, 30011
    width = H_t if teacher_form == "head" else Vh
    weight = (torch.randn(Vh, H, generator=gen) / H ** 0.5).to(device, dtype)
    t_weight = (torch.randn(Vh, H_t, generator=gen) / H_t ** 0.5).to(device, dtype)
    row = torch.randn(1, Tq + 1, H, generator=gen).to(device, dtype)
    t_row = (3 * torch.randn(1, Tq, width, generator=gen)).to(device, dtype)

    def results(hidden, t_rows, chunk, lib=rlfuse, wide=False):
        cast = (lambda x: x.double()) if wide else (lambda x: x)
        hidden = cast(hidden).clone().requires_grad_()
        targets = torch.zeros(hidden.shape[0], Tq, dtype=torch.long, device=device)
        student = lib.LinearHead(hidden, cast(weight), targets, chunk_tokens=chunk,
                                 softcap=30.0, batch_invariant=True)
        if teacher_form == "head":
            teacher = lib.LinearHead(cast(t_rows), cast(t_weight), targets, temperature=0.8,
                                     batch_invariant=True)
        else:
            teacher = lib.Logits(cast(t_rows), targets, temperature=0.8)
        value = lib.token_divergence(student, teacher, JSD(0.5))
        value.sum().backward()
        return value.detach(), hidden.grad

    alone = results(row, t_row, None)
    for chunk in (None, 333):
        hidden = torch.randn(300, Tq + 1, H, generator=gen).to(device, dtype)
        t_rows = (3 * torch.randn(300, Tq, width, generator=gen)).to(device, dtype)
        hidden[211], t_rows[211] = row[0], t_row[0]
        for got, want in zip(results(hidden, t_rows, chunk), alone):
            assert torch.equal(got[211], want[0]), chunk
    got = results(hidden[:40], t_rows[:40], None)
    ref = results(hidden[:40], t_rows[:40], None, lib=rlfuse.reference)
    ref64 = results(hidden[:40], t_rows[:40], None, lib=rlfuse.reference, wide=True)
    for name, a, r, r64 in zip(("value", "dhidden"), got, ref, ref64):
        assert_three_way(a.double(), r.double(), r64, name, atol_dtype=a.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_head_blocks_are_its_logits_blocks_on_the_gpu(dtype):
    """The batch-invariant head's block statistics from tiles formed and reduced on the chip
    (``head_blocks``, tensor cores in bf16) are the bits of those of ``fixed_matmul``'s logits
    in memory (``block_stats``), and their target logits a gather of them, at a real hidden
    size and a vocabulary of many blocks (a partial last one); the default head's log-probs of
    a row alone and among 300 rows are printed beside (cuBLAS picks its kernels by the row
    count: not held to it)."""
    from rlfuse.kernels.lib.head_functions import HeadParams
    from rlfuse.kernels.tiles.head_tiles import head_blocks
    from rlfuse.kernels.tiles.matmul import fixed_matmul
    from rlfuse.kernels.tiles.tile_stats import block_stats

    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(8)
    C, H, Vh = 300, 1024, 30011
    hidden = torch.randn(C, H, generator=gen).to(device, dtype)
    weight = (torch.randn(Vh, H, generator=gen) / H ** 0.5).to(device, dtype)
    bias = (0.1 * torch.randn(Vh, generator=gen)).to(device, dtype)
    targets = torch.randint(0, Vh, (C,), generator=gen).to(device)
    head = HeadParams(0.9, 1.0, 30.0)
    blocks, x_y = head_blocks(hidden, weight, bias, targets, *head.kernel_args(), True)
    logits = fixed_matmul(hidden, weight.t(), bias=bias, dtype=dtype)
    assert torch.equal(blocks, block_stats(logits.unsqueeze(1), *head.kernel_args(), True))
    assert torch.equal(x_y, logits.gather(1, targets[:, None])[:, 0])
    rows = hidden.view(C, 1, H)
    default = [rlfuse.policy_logprobs(rlfuse.LinearHead(
        torch.cat([h, h], 1), weight, t.view(-1, 1), bias=bias)).detach()
        for h, t in ((rows, targets), (rows[211:212], targets[211:212]))]
    moved = (default[0][211] != default[1][0]).float().mean().item()
    print(f"default head, {dtype}: row 211's log-prob alone vs among {C} rows differs: "
          f"{moved > 0}")


def test_inplace_equals_out_of_place_under_stress():
    """The in-place single pass reads z[y] before its logsumexp pass and writes the row after:
    1000 repetitions with the target in the last of two 16-warp blocks, bit-identical to the
    out-of-place pass (a race on z[y] shows up as a wrong log-prob, loss or gradient)."""
    x = case("cuda")
    want = every_op(x)
    for _ in range(1000):
        leaf = x["logits"].clone().requires_grad_(True)
        out = rlfuse.gppo_loss(rlfuse.Logits(leaf, x["targets"], 0.9, True), x["old"], x["adv"],
                               x["mask"], geometry="kl", topology="binary")
        (grad,) = torch.autograd.grad(out.loss, leaf)
        assert torch.equal(out.loss.detach(), want["gppo"][0][0])
        assert torch.equal(grad, want["gppo"][1])
    assert_equal_results(every_op(x, inplace=True), want)


def test_inplace_backward_real_vocabulary():
    x = case("cuda", vocab=151936, batch=2, time=3, seed=1)
    assert_equal_results(every_op(x, inplace=True), every_op(x))


def test_second_device_while_the_first_is_current():
    """Every op on cuda:1 while cuda:0 is current equals the cuda:0 result."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    with torch.cuda.device(0):
        on0 = every_op(case("cuda:0"))
        on1 = every_op(case("cuda:1"))
        for name, (outs, grad) in on1.items():
            assert grad.device == torch.device("cuda:1"), name
    assert_equal_results(on0, on1)


def test_non_default_stream():
    x = case("cuda")
    want = every_op(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = every_op(x)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    assert_equal_results(got, want)


@pytest.mark.parametrize("inplace", [False, True])
def test_unaligned_logits(inplace):
    """Logits one element past an allocation's start, as every op differentiates them (each
    row unaligned; in place, the gradient written into them too) equal aligned ones."""
    x = case("cuda")
    assert_equal_results(every_op(x, inplace=inplace, leaf_of=unaligned_copy),
                         every_op(x, inplace=inplace))


@pytest.mark.parametrize("inplace", [False, True])
def test_every_single_pass_candidate_at_the_real_vocabulary(inplace):
    """Each launch configuration the GPU sweep times (``single_pass.CANDIDATES``), at
    V = 151936 in bf16, in place and not: a configuration that changes only the launch
    (eviction hints, a persistent grid, the block order) gives the default's results bit for
    bit; one that changes the blocks, warps or pipelining holds the three-way rule against
    float64 as the default does."""
    from rlfuse.kernels.rows.single_pass import CANDIDATES, parse, single_pass_config

    x = case("cuda", vocab=151936, batch=4, time=5, seed=2)
    losses = {"gppo": lambda lib, p, old, adv: lib.gppo_loss(p, old, adv, x["mask"],
                                                            geometry="kl", topology="binary"),
              "ppo": lambda lib, p, old, adv: lib.ppo_loss(p, old, adv, x["mask"])}

    def run(lib, dtype=None, in_place=False):
        """{loss: (value, gradient w.r.t. the logits)} of ``lib`` on the logits in ``dtype``."""
        results = {}
        for name, loss in losses.items():
            leaf = x["logits"].to(dtype or x["logits"].dtype).clone().requires_grad_(True)
            out = loss(lib, rlfuse.Logits(leaf, x["targets"], 0.9, in_place),
                       x["old"].to(leaf.dtype if dtype else torch.float32),
                       x["adv"].to(leaf.dtype if dtype else torch.float32))
            results[name] = (out.loss.detach(), torch.autograd.grad(out.loss, leaf)[0])
        return results

    with single_pass_config("default"):
        want = run(rlfuse, in_place=inplace)
    ref64, ref = run(reference, torch.float64), run(reference)
    for text in CANDIDATES:
        config = parse(text)
        with single_pass_config(config):
            got = run(rlfuse, in_place=inplace)
        launch_only = config.block_v is None and config.num_warps is None and \
            config.num_stages is None
        for name in want:
            if launch_only:
                assert torch.equal(got[name][0], want[name][0]), (text, name)
                assert torch.equal(got[name][1], want[name][1]), (text, name)
            else:
                assert_three_way(got[name][0], ref[name][0], ref64[name][0], f"{text} {name}")
                assert_three_way(got[name][1].float(), ref[name][1].float(), ref64[name][1],
                                 f"{text} {name} gradient", atol_dtype=torch.bfloat16)


def test_backward_and_row_scaling_past_2_31_elements():
    """``B*T*V`` beyond 2**31 through the two kernels the single pass does not cover: the
    ``token_logprobs`` backward (its dlogits of rows past element 2**31) and the row scaling
    that an upstream gradient other than 1 applies to the single pass's dlogits. The last rows
    are checked against the float64 reference on those rows alone."""
    Bn, Tn, Vn = 2, 8200, 151936
    gen = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(Bn, Tn, Vn, device="cuda", dtype=torch.bfloat16, generator=gen)
    assert logits.numel() > 2 ** 31
    targets = torch.randint(0, Vn, (Bn, Tn), device="cuda", generator=gen)
    mask = torch.ones(Bn, Tn, dtype=torch.bool, device="cuda")
    weights = torch.randn(Bn, Tn, device="cuda", generator=gen)
    rows = slice(Tn - 3, Tn)
    leaf = logits.requires_grad_(True)
    (grad,) = torch.autograd.grad((rlfuse.token_logprobs(leaf, targets) * weights).sum(), leaf)
    sub = leaf.detach()[:, rows].double().requires_grad_(True)
    (ref_grad,) = torch.autograd.grad(
        (reference.token_logprobs(sub, targets[:, rows]) * weights[:, rows].double()).sum(), sub)
    torch.testing.assert_close(grad[:, rows].double(), ref_grad, **TOL["bf16_grad"])
    del grad
    old = torch.full((Bn, Tn), -12.0, device="cuda")
    adv = torch.tensor([1.0, -1.0], device="cuda")
    out = rlfuse.gppo_loss(rlfuse.Logits(leaf, targets), old, adv, mask, num_tokens=float(Bn * Tn))
    (grad,) = torch.autograd.grad(out.loss * 0.375, leaf)      # the row-scaling kernel
    ref = reference.gppo_loss(rlfuse.Logits(sub, targets[:, rows]), old[:, rows].double(),
                              adv.double(), mask[:, rows], num_tokens=float(Bn * Tn))
    (ref_grad,) = torch.autograd.grad(ref.loss * 0.375, sub)
    torch.testing.assert_close(grad[:, rows].double(), ref_grad, **TOL["bf16_grad"])


def test_real_size_single_pass_int64_offsets():
    """B*T*V beyond 2**31: the single pass's dlogits offsets and the token_logprobs backward
    past 2**31 elements. Rows are independent given the aggregation weights, so the last rows
    are checked against the float64 reference on those rows alone (same global count)."""
    Bn, Tn, Vn = 2, 8200, 151936
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(Bn, Tn, Vn, device="cuda", dtype=torch.bfloat16, generator=gen)
    targets = torch.randint(0, Vn, (Bn, Tn), device="cuda", generator=gen)
    mask = torch.ones(Bn, Tn, dtype=torch.bool, device="cuda")
    old = torch.full((Bn, Tn), -12.0, device="cuda")
    adv = torch.tensor([1.0, -1.0], device="cuda")
    n_tok = float(Bn * Tn)
    leaf = logits.requires_grad_(True)
    out = rlfuse.gppo_loss(rlfuse.Logits(leaf, targets), old, adv, mask, num_tokens=n_tok)
    (grad,) = torch.autograd.grad(out.loss, leaf)
    for b in range(Bn):
        rows = slice(Tn - 3, Tn)
        sub = leaf.detach()[b:b + 1, rows].double().requires_grad_(True)
        ref = reference.gppo_loss(rlfuse.Logits(sub, targets[b:b + 1, rows]),
                                  old[b:b + 1, rows].double(), adv[b:b + 1].double(),
                                  mask[b:b + 1, rows], num_tokens=n_tok)
        (ref_grad,) = torch.autograd.grad(ref.loss, sub)
        torch.testing.assert_close(grad[b:b + 1, rows].double(), ref_grad, **TOL["bf16_grad"])


@pytest.mark.parametrize("scale", [1e4, 30.0])
def test_approximate_math_at_extremes(scale):
    """+-1e4 logits and peaked rows at a large vocabulary, GGPO at beta = 0.01, under the
    three-way rule: the GPU's exp2 / division / sqrt must not move the results beyond what
    plain torch commits in the same dtype."""
    x = case("cuda", torch.float32, vocab=151936, batch=4, time=2, seed=2, scale=scale)

    def three_way(fn):
        outs = []
        for lib, dtype in ((rlfuse, torch.float32), (reference, torch.float32),
                           (reference, torch.float64)):
            leaf = x["logits"].to(dtype).clone().requires_grad_(True)
            loss = fn(lib, leaf)
            (grad,) = torch.autograd.grad(loss, leaf)
            outs.append((loss.detach(), grad))
        for i, name in enumerate(("loss", "gradient")):
            assert_three_way(outs[0][i], outs[1][i], outs[2][i], name)

    three_way(lambda lib, leaf: lib.token_logprobs(leaf, x["targets"], mask=x["mask"],
                                                   return_entropy=True)[1].sum())
    three_way(lambda lib, leaf: lib.ggpo_loss(
        rlfuse.Logits(leaf, x["targets"]), x["ref"].to(leaf.dtype), x["rewards"].to(leaf.dtype),
        x["mask"], group_size=M, beta=0.01).loss)
    three_way(lambda lib, leaf: lib.gppo_loss(rlfuse.Logits(leaf, x["targets"]),
                                              x["old"].to(leaf.dtype), x["adv"].to(leaf.dtype),
                                              x["mask"]).loss)


def test_fp64_hyper_parameters_on_the_gpu():
    """As documented: a GPU kernel receives Python floats as fp32, so fp64 log-probs use
    1/temperature rounded to fp32; the GPPO region size is passed as an fp64 pair and is
    exact."""
    x = case("cuda", torch.float64, vocab=300)
    inv = torch.tensor(1 / 0.7, dtype=torch.float32).item()
    got = rlfuse.token_logprobs(x["logits"], x["targets"], temperature=0.7)
    torch.testing.assert_close(got, reference.token_logprobs(x["logits"], x["targets"],
                                                             temperature=1 / inv),
                               **TOL["fp64_sum"])
    old = torch.linspace(-12, -1e-3, 64, dtype=torch.float64, device="cuda")
    for geometry, topology in (("chi2", "atomic"), ("kl", "binary")):
        got = rlfuse.gppo_bounds(old, geometry=geometry, topology=topology, delta=0.1)
        want = reference.gppo_bounds(old.cpu(), geometry=geometry, topology=topology, delta=0.1)
        for g, w in zip(got, want):
            torch.testing.assert_close(g.cpu(), w, **TOL["fp64"])


@pytest.mark.parametrize("group_size", [256, 1024])
def test_large_group_speed_smoke(group_size):
    """A GGPO group kernel over groups of 256 / 1024 rows runs in well under a millisecond."""
    import triton.testing

    Bn, Tn = 4 * group_size, 512
    lp = -torch.rand(Bn, Tn, device="cuda", requires_grad=True)
    mask = torch.rand(Bn, Tn, device="cuda") > 0.2
    rewards = torch.rand(Bn, device="cuda")
    ms = triton.testing.do_bench(lambda: rlfuse.ggpo_loss(
        lp, lp.detach() - 0.1, rewards, mask, group_size=group_size, beta=0.5,
        validate=False).loss.backward())
    assert ms < 1.0, ms


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_head_weight_gradient_accumulates_in_fp32(dtype):
    """A LinearHead's weight gradient over several chunks: each chunk's product accumulated
    into the fp32 buffer by one fp32-output matmul (no bf16 partial, no transient [V, H]
    buffer): the gradient keeps the three-way rule against float64, and the backward's peak
    memory stays within the chunk, the fp32 gradient and its cast."""
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(3)
    Bh, Th, H, Vh, chunk = 4, 64, 256, 50000, 64
    hidden = torch.randn(Bh, Th, H, generator=gen).to(device, dtype)
    weight = (torch.randn(Vh, H, generator=gen) / H ** 0.5).to(device, dtype)
    targets = torch.randint(0, Vh, (Bh, Th), generator=gen).to(device)

    def grad_of(lib, w, h, tokens):
        w = w.detach().clone().requires_grad_()
        lp = lib.policy_logprobs(lib.LinearHead(h, w, targets, chunk_tokens=tokens))
        (g,) = torch.autograd.grad(lp.sum(), w)
        return g

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = grad_of(rlfuse, weight, hidden, chunk)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    size = weight.element_size()
    budget = chunk * Vh * size + Vh * H * (4 + size) + Bh * Th * H * 8 + (1 << 20)
    assert peak <= budget, (peak, budget)
    plain = grad_of(reference, weight, hidden, None)        # plain torch in the same dtype
    want64 = grad_of(reference, weight.double(), hidden.double(), None)
    assert_three_way(got.float(), plain.float(), want64, "weight gradient", atol_dtype=dtype)


def test_exponentials_of_large_log_ratios():
    """The per-token exponential at log-ratios across [-80, 80] (the unclipped branch of a
    negative advantage keeps r A; the ratio metric): values and gradients within a few units
    of fp32 rounding of float64, where ex2.approx of x log2(e) would be off by ~1e-5."""
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(5)
    Bg, Tg = 8, 257
    # old = -1 and d on a grid of 2^-17: lp = old + d and lp - old are exact in fp32, so the
    # fused error is the exponential's alone
    old = -torch.ones(Bg, Tg, dtype=torch.float64)
    d = (torch.rand(Bg, Tg, generator=gen, dtype=torch.float64) * 2 - 1) * 80
    d = torch.round(d * 2 ** 17) / 2 ** 17
    lp = old + d
    mask = torch.ones(Bg, Tg, dtype=torch.bool)
    adv = -torch.ones(Bg, dtype=torch.float64)
    results = {}
    for name, dtype, dev in (("fused", torch.float32, device), ("ref64", torch.float64, "cpu")):
        leaf = lp.to(dev, dtype).clone().requires_grad_()
        lib = rlfuse if name == "fused" else reference
        out = lib.ppo_loss(leaf, old.to(dev, dtype), adv.to(dev, dtype), mask.to(dev),
                           agg="token-sum", validate=False)
        (grad,) = torch.autograd.grad(out.loss, leaf)
        results[name] = (grad.cpu().double(), out.metrics["ratio_mean"].cpu().double())
    grad, ratio = results["fused"]
    want_grad, want_ratio = results["ref64"]
    torch.testing.assert_close(grad, want_grad, rtol=4 * 2.0 ** -23, atol=0)   # 4 ulp
    torch.testing.assert_close(ratio, want_ratio, rtol=2e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_distillation_on_the_gpu(dtype):
    """The divergence kernels on the GPU's approximate exponentials and 16-warp blocks, a
    vocabulary of two blocks and a ragged tail, rows at unaligned addresses: loss, entropy
    and the student's gradient against float64 (the three-way rule), each divergence."""
    from rlfuse.divergences import JSD, ForwardKL, ReverseKL

    x = case("cuda", dtype)
    teacher = unaligned_copy(case("cuda", dtype, seed=1)["logits"])
    for divergence in (ForwardKL(), ReverseKL(), JSD(0.5)):
        results = []
        for lib, cast in ((rlfuse, dtype), (reference, dtype), (reference, torch.float64)):
            leaf = x["logits"].to(cast).requires_grad_()
            out = lib.distill_loss(rlfuse.Logits(leaf, x["targets"], 0.7),
                                   rlfuse.Logits(teacher.to(cast), x["targets"], 1.3),
                                   x["mask"], divergence)
            results.append((out.loss, out.metrics["entropy"],
                            *torch.autograd.grad(out.loss, leaf)))
        for name, got, ref, ref64 in zip(("loss", "entropy", "grad"), *results):
            assert_three_way(got, ref, ref64, f"{divergence} {name}")
