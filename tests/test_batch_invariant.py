"""``LinearHead(..., batch_invariant=True)``: each row's log-prob, entropy, per-token loss terms
and hidden-state gradient bitwise the same whatever else is in the call (the number of rows and
their values, the row's position, ``chunk_tokens``, packed or padded rows, a window), every
gradient the same run to run, and still exact against float64; the fixed-order matmul itself.
The fused path in the Triton interpreter (the GPU test of the same: ``tests/test_gpu.py``)."""
import pytest
import torch

import rlfuse
import rlfuse.reference
from conftest import TOL, nvidia_backend, process_env
from rlfuse.kernels.lib.head_functions import HeadParams
from rlfuse.kernels.tiles.head_tiles import head_blocks
from rlfuse.kernels.tiles.matmul import BLOCK_M, fixed_matmul
from rlfuse.kernels.tiles.tile_stats import VOCAB_BLOCK, block_stats

H, V, T = 24, 83, 5
HEADS = {"plain": {}, "bias": dict(bias=True), "scaled": dict(logit_scale=0.25, bias=True),
         "softcapped": dict(softcap=4.0, temperature=0.7)}


def _head(dtype, seed=0, bias=False, vocab=V, **fields):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(vocab, H, generator=g, dtype=torch.float64) / H ** 0.5).to(dtype)
    b = torch.randn(vocab, generator=g, dtype=torch.float64).to(dtype) if bias else None
    return weight, b, fields


def _rows(n, dtype, seed, vocab=V):
    g = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(n, T + 1, H, generator=g, dtype=torch.float64)).to(dtype), \
        torch.randint(0, vocab, (n, T), generator=g)


def _row_results(hidden, targets, head, *, chunk_tokens=None, offset=0, lib=rlfuse):
    """Log-probs, entropies and the hidden states' gradient of ``lp + 0.5 entropy``."""
    weight, bias, fields = head
    hidden = hidden.detach().clone().requires_grad_()
    policy = lib.LinearHead(hidden, weight, targets, bias=bias, offset=offset,
                            chunk_tokens=chunk_tokens, batch_invariant=True, **fields)
    lp, entropy = lib.policy_logprobs(policy, return_entropy=True)
    (lp.sum() + 0.5 * entropy.sum()).backward()
    return lp.detach(), entropy.detach(), hidden.grad


@pytest.mark.parametrize("lib", [rlfuse, rlfuse.reference], ids=["fused", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(HEADS))
def test_a_row_is_its_own_whatever_the_batch(dtype, name, lib):
    _a_row_is_its_own(dtype, name, lib)


@pytest.mark.parametrize("name", ["plain", "softcapped"])
def test_an_fp16_row_is_its_own_whatever_the_batch(name):
    _a_row_is_its_own(torch.float16, name, rlfuse)


def _a_row_is_its_own(dtype, name, lib):
    """One row alone, then among random companions in batches of 2 to 14 rows (70 tokens: past
    one tile of the matmul's rows), at several positions and chunk sizes: the same bits (the
    reference: each row's matmul its own)."""
    head = _head(dtype, **HEADS[name])
    row_hidden, row_targets = _rows(1, dtype, seed=1)
    alone = _row_results(row_hidden, row_targets, head, lib=lib)
    assert 14 * T > BLOCK_M
    for n, position, chunk in ((2, 1, None), (7, 3, 4), (14, 13, 2), (14, 0, 2 * BLOCK_M),
                               (5, 4, 7)):
        hidden, targets = _rows(n, dtype, seed=n + position)
        hidden[position], targets[position] = row_hidden[0], row_targets[0]
        batch = _row_results(hidden, targets, head, chunk_tokens=chunk, lib=lib)
        for got, want in zip(batch, alone):
            assert torch.equal(got[position], want[0]), (n, position, chunk)


def test_packed_rows_and_a_window_are_the_padded_rows():
    """The rows of a packed batch (and of a window at an offset) give the padded batch's
    bits."""
    head = _head(torch.float32, bias=True)
    hidden, targets = _rows(3, torch.float32, seed=4)
    padded = _row_results(hidden, targets, head)
    # a window: the same rows after 3 rows of another prompt
    prompt = torch.randn(3, 3, H, dtype=torch.float32)
    windowed = _row_results(torch.cat([prompt, hidden], 1), targets, head, offset=3)
    for got, want in zip(windowed, padded):
        assert torch.equal(got, want if got.shape == want.shape else
                           torch.cat([torch.zeros_like(prompt), want], 1))
    # packed: every sequence's rows back to back, each predicting its own response token
    weight, bias, fields = head
    rows = hidden[:, :T].reshape(-1, H).detach().clone().requires_grad_()
    index = torch.arange(3 * T)
    policy = rlfuse.LinearHead(rows, weight, targets.reshape(-1), bias=bias, index=index,
                               chunk_tokens=2, batch_invariant=True, **fields)
    lp, entropy = rlfuse.policy_logprobs(policy, return_entropy=True)
    (lp.sum() + 0.5 * entropy.sum()).backward()
    assert torch.equal(lp.reshape(3, T), padded[0])
    assert torch.equal(entropy.reshape(3, T), padded[1])
    assert torch.equal(rows.grad.reshape(3, T, H), padded[2][:, :T])


@pytest.mark.parametrize("objective", ["clip", "gspo"])
def test_a_losses_per_row_gradient_is_its_own(objective):
    """The single pass (a token-local objective) and the two passes (a sequence-level ratio)
    under token-sum: a row's hidden-state gradient the same alone and in a batch."""
    head = _head(torch.bfloat16, bias=True, logit_scale=0.5)
    weight, bias, fields = head

    def row_gradient(hidden, targets, position, chunk):
        hidden = hidden.detach().clone().requires_grad_()
        n = hidden.shape[0]
        g = torch.Generator().manual_seed(9)
        old = -torch.rand(n, T, generator=g)
        adv = torch.randn(n, generator=g)
        old[position], adv[position] = -torch.linspace(0.1, 2.0, T), 0.7
        policy = rlfuse.LinearHead(hidden, weight, targets, bias=bias, chunk_tokens=chunk,
                                   batch_invariant=True, **fields)
        out = rlfuse.policy_loss(policy, old, adv, torch.ones(n, T, dtype=torch.bool),
                                 objective, agg="token-sum")
        out.loss.backward()
        return hidden.grad[position]

    row_hidden, row_targets = _rows(1, torch.bfloat16, seed=2)
    alone = row_gradient(row_hidden, row_targets, 0, None)
    hidden, targets = _rows(9, torch.bfloat16, seed=3)
    hidden[6], targets[6] = row_hidden[0], row_targets[0]
    assert torch.equal(row_gradient(hidden, targets, 6, 4), alone)


def test_every_gradient_is_the_same_run_to_run():
    head = _head(torch.float32, bias=True)
    weight, bias, fields = head
    hidden, targets = _rows(14, torch.float32, seed=5)

    def gradients():
        leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
        policy = rlfuse.LinearHead(leaves[0], leaves[1], targets, bias=leaves[2],
                                   chunk_tokens=20, batch_invariant=True, **fields)
        lp, entropy = rlfuse.policy_logprobs(policy, return_entropy=True)
        (lp.sum() - entropy.sum()).backward()
        return [leaf.grad for leaf in leaves]

    for got, want in zip(gradients(), gradients()):
        assert torch.equal(got, want)


@pytest.mark.parametrize("name", sorted(HEADS))
def test_exact_against_float64(name):
    """fp32: within the tolerance of the default head; the reference takes the flag too."""
    head = _head(torch.float32, **HEADS[name])
    weight, bias, fields = head
    hidden, targets = _rows(4, torch.float32, seed=6)
    got = _row_results(hidden, targets, head, chunk_tokens=3)
    wide = (weight.double(), None if bias is None else bias.double(), fields)
    want = _row_results(hidden.double(), targets, wide, lib=rlfuse.reference)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, **TOL["fp32_matmul"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_vocabulary_of_several_blocks(dtype):
    """A vocabulary of two whole blocks of ``VOCAB_BLOCK`` ids and a partial one: a row's bits
    its own in any batch, ``token_logprobs(..., batch_invariant=True)`` of ``head_logits`` the
    head's, and (fp32) exact against float64."""
    vocab = 2 * VOCAB_BLOCK + 37
    head = _head(dtype, bias=True, vocab=vocab, temperature=0.7)
    row_hidden, row_targets = _rows(1, dtype, seed=1, vocab=vocab)
    alone = _row_results(row_hidden, row_targets, head)
    hidden, targets = _rows(6, dtype, seed=2, vocab=vocab)
    hidden[4], targets[4] = row_hidden[0], row_targets[0]
    batch = _row_results(hidden, targets, head, chunk_tokens=4)
    for got, want in zip(batch, alone):
        assert torch.equal(got[4], want[0])
    weight, bias, fields = head
    logits = rlfuse.head_logits(hidden[:, :-1], weight, bias)
    lp = rlfuse.token_logprobs(logits, targets, temperature=0.7, batch_invariant=True)
    assert torch.equal(lp, batch[0])
    if dtype == torch.float32:
        wide = (weight.double(), bias.double(), fields)
        want = _row_results(hidden.double(), targets, wide, lib=rlfuse.reference)
        for a, b in zip(batch, want):
            torch.testing.assert_close(a.double(), b, **TOL["fp32_matmul"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_invariant_logits_are_the_heads(dtype):
    """``Logits(head_logits(...), ..., batch_invariant=True)``: the batch-invariant head's
    log-probs, entropies and GGPO loss bit for bit, a row's its own in any batch; (fp32) its
    log-probs, entropies and logits' gradient exact against float64."""
    vocab = 2 * VOCAB_BLOCK + 37
    weight, bias, _ = _head(dtype, bias=True, vocab=vocab)
    hidden, targets = _rows(6, dtype, seed=3, vocab=vocab)
    g = torch.Generator().manual_seed(4)
    mask = torch.rand(6, T, generator=g) > 0.3
    mask[:, 0] = True
    old, rewards = torch.randn(6, T, generator=g) - 5, torch.randn(6, generator=g)
    head = rlfuse.LinearHead(hidden, weight, targets, bias=bias, temperature=0.7,
                             batch_invariant=True)
    logits = rlfuse.head_logits(hidden, weight, bias)

    def of(rows, rows_targets):
        return rlfuse.Logits(rows, rows_targets, temperature=0.7, batch_invariant=True)

    for call in (lambda p: rlfuse.policy_logprobs(p, return_entropy=True),
                 lambda p: (rlfuse.ggpo_loss(p, old, rewards, mask, group_size=2,
                                             beta=0.5).loss,)):
        for got, want in zip(call(of(logits, targets)), call(head)):
            assert torch.equal(got, want)
    lp, entropy = rlfuse.policy_logprobs(of(logits[2:3], targets[2:3]), return_entropy=True)
    want_lp, want_entropy = rlfuse.policy_logprobs(head, return_entropy=True)
    assert torch.equal(lp[0], want_lp[2]) and torch.equal(entropy[0], want_entropy[2])
    if dtype == torch.float32:
        results = []
        for lib, rows in ((rlfuse, logits), (rlfuse.reference, logits.double())):
            leaf = rows.detach().requires_grad_()
            lp, entropy = lib.policy_logprobs(of(leaf, targets), return_entropy=True)
            (lp.sum() + 0.5 * entropy.sum()).backward()
            results.append((lp, entropy, leaf.grad))
        for a, b in zip(*results):
            torch.testing.assert_close(a.double(), b, **TOL["fp32"])


def test_the_flag_is_a_bool():
    weight, _, _ = _head(torch.float32)
    hidden, targets = _rows(1, torch.float32, seed=0)
    with pytest.raises(TypeError, match="policy.batch_invariant: expected a bool"):
        rlfuse.policy_logprobs(rlfuse.LinearHead(hidden, weight, targets, offset=1,
                                                 batch_invariant=1))
    logits = torch.zeros(1, T, V)
    with pytest.raises(TypeError, match="policy.batch_invariant: expected a bool"):
        rlfuse.policy_logprobs(rlfuse.Logits(logits, targets, batch_invariant="yes"))
    with pytest.raises(TypeError, match="^batch_invariant: expected a bool"):
        rlfuse.token_logprobs(logits, targets, batch_invariant=None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16,
                                   torch.float64], ids=str)
def test_the_fixed_order_matmul(dtype):
    """Against float64 (each output rounded once after an fp32 sum: the bound of K products),
    with a bias and accumulating into an fp32 output, any strides; a row of the output the same
    bits in any batch."""
    g = torch.Generator().manual_seed(0)
    M, K, N = 2 * BLOCK_M + 5, 70, 45
    a = torch.randn(M, K, generator=g, dtype=torch.float64).to(dtype)
    b = torch.randn(N, K, generator=g, dtype=torch.float64).to(dtype).t()   # a transposed view
    bias = torch.randn(N, generator=g, dtype=torch.float64).to(dtype)
    exact = a.double() @ b.double() + bias.double()
    eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    bound = K * eps * (a.double().abs() @ b.double().abs() + bias.double().abs()) + \
        torch.finfo(dtype).eps * exact.abs()
    got = fixed_matmul(a, b, bias=bias)
    assert got.dtype == dtype and ((got.double() - exact).abs() <= bound).all()
    into = torch.ones(M, N, dtype=torch.float32)
    fixed_matmul(a, b, out=into, accumulate=True)
    product = a.double() @ b.double()
    assert ((into.double() - 1 - product).abs() <=
            K * eps * (a.double().abs() @ b.double().abs()) + 1e-6).all()
    some = fixed_matmul(a[7:9], b, bias=bias)
    assert torch.equal(some, got[7:9])


def test_old_logprobs_one_row_at_a_time_give_ratio_one_in_the_training_batch():
    """The old-log-prob pass row by row (a micro-batch of 1) and the training pass over the
    whole batch agree bit for bit: every ratio is exactly 1 on policy, in bf16 too."""
    weight, bias, fields = _head(torch.bfloat16, bias=True)
    hidden, targets = _rows(14, torch.bfloat16, seed=8)
    with torch.no_grad():
        old = torch.cat([rlfuse.policy_logprobs(rlfuse.LinearHead(
            hidden[i:i + 1], weight, targets[i:i + 1], bias=bias, batch_invariant=True,
            **fields)) for i in range(len(hidden))])
    policy = rlfuse.LinearHead(hidden.clone().requires_grad_(), weight, targets, bias=bias,
                               chunk_tokens=16, batch_invariant=True, **fields)
    lp = rlfuse.policy_logprobs(policy)
    assert torch.equal(lp.detach(), old)
    out = rlfuse.ppo_loss(policy, old, torch.randn(14), torch.ones(14, T, dtype=torch.bool))
    assert out.metrics["ratio_mean"].item() == 1.0
    assert out.metrics["clip_frac_low"].item() == out.metrics["clip_frac_high"].item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_logits_rows_are_their_own_already(dtype):
    """From logits the row kernels are row-local: a row's log-probs, entropies and logits
    gradient the same bits alone and in a batch (``Logits`` needs no flag)."""
    g = torch.Generator().manual_seed(10)
    logits = (3 * torch.randn(9, T, V, generator=g)).to(dtype)
    targets = torch.randint(0, V, (9, T), generator=g)

    def results(x, y):
        x = x.clone().requires_grad_()
        lp, entropy = rlfuse.policy_logprobs(rlfuse.Logits(x, y, temperature=0.7),
                                             return_entropy=True)
        (lp.sum() - 0.5 * entropy.sum()).backward()
        return lp.detach(), entropy.detach(), x.grad

    batch = results(logits, targets)
    alone = results(logits[6:7], targets[6:7])
    for got, want in zip(batch, alone):
        assert torch.equal(got[6], want[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_head_logits_are_the_invariant_heads(dtype):
    """``head_logits`` (what a rollout engine would sample from): a row's bits its own in any
    batch, and ``token_logprobs`` of them equal to the batch-invariant ``LinearHead``'s, with
    and without autograd."""
    weight, bias, _ = _head(dtype, bias=True)
    hidden, targets = _rows(9, dtype, seed=11)
    logits = rlfuse.head_logits(hidden, weight, bias)
    assert logits.dtype == dtype and logits.shape == (9, T + 1, V)
    assert torch.equal(rlfuse.head_logits(hidden[4:5, 2:4], weight, bias), logits[4:5, 2:4])
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            lp = rlfuse.token_logprobs(rlfuse.head_logits(hidden[:, 1:], weight, bias), targets,
                                       temperature=0.7, batch_invariant=True)
            head = rlfuse.LinearHead(hidden, weight, targets, bias=bias, offset=1,
                                     temperature=0.7, chunk_tokens=6, batch_invariant=True)
            assert torch.equal(rlfuse.policy_logprobs(head), lp)


@pytest.mark.parametrize("lib", [rlfuse, rlfuse.reference], ids=["fused", "reference"])
def test_head_logits_against_float64(lib):
    weight, bias, _ = _head(torch.float32, bias=True)
    hidden = _rows(3, torch.float32, seed=12)[0]
    leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    wide = [x.double().requires_grad_() for x in (hidden, weight, bias)]
    # the upstream gradient as fp32 holds it: float64 computes from the same numbers
    upstream = torch.randn(3, T + 1, V, generator=torch.Generator().manual_seed(13)).double()
    got = lib.head_logits(*leaves)
    want = torch.nn.functional.linear(*wide)
    torch.testing.assert_close(got.double(), want, **TOL["fp32_matmul"])
    # each gradient within the worst-case rounding of its K-term fp32 sums, K u sum |a| |b|
    # (whatever order a BLAS sums in: a bound from the operation, not from one machine's error)
    u = torch.finfo(torch.float32).eps / 2
    rows, up = hidden.double().reshape(-1, hidden.shape[-1]), upstream.reshape(-1, V)
    bounds = (up.shape[1] * u * (up.abs() @ weight.double().abs()).view(hidden.shape),
              up.shape[0] * u * (up.abs().T @ rows.abs()), up.shape[0] * u * up.abs().sum(0))
    for g, w, bound in zip(torch.autograd.grad((got * upstream.float()).sum(), leaves),
                           torch.autograd.grad((want * upstream).sum(), wide), bounds):
        assert ((g.double() - w).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize("bad, match", [
    (dict(weight=torch.zeros(V, H + 1)), r"weight: expected shape \[V, H\]"),
    (dict(weight=torch.zeros(V, H, dtype=torch.float64)), "weight: expected the hidden"),
    (dict(bias=torch.zeros(V + 1)), "bias"),
    (dict(hidden=torch.zeros((), dtype=torch.float32)), "hidden"),
])
def test_head_logits_bad_input(bad, match):
    args = dict(hidden=torch.zeros(2, H), weight=torch.zeros(V, H), bias=None, **{})
    args.update(bad)
    for lib in (rlfuse, rlfuse.reference):
        with pytest.raises((ValueError, TypeError), match=match):
            lib.head_logits(**args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("vocab", [83, 256, 300])
@pytest.mark.parametrize("style", ["plain", "bias_softcap"])
def test_the_heads_blocks_are_those_of_its_logits(dtype, vocab, style):
    """The head's block statistics from tiles that never leave the chip (``head_blocks``) are
    the bits of those of the fixed-order matmul's logits (``block_stats``) and their target
    logits a gather of them: rows across two row tiles, a weight of other strides, a partial
    last block or none, with and without the entropy."""
    g = torch.Generator().manual_seed(vocab)
    C = BLOCK_M + 6
    hidden = torch.randn(C, H, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(H, vocab, generator=g, dtype=torch.float64) / H ** 0.5).to(dtype).t()
    assert not weight.is_contiguous()
    bias = torch.randn(vocab, generator=g, dtype=torch.float64).to(dtype) \
        if style != "plain" else None
    head = HeadParams(0.7, 0.5, 3.0) if style != "plain" else HeadParams(1.3)
    targets = torch.randint(0, vocab, (C,), generator=g)
    logits = fixed_matmul(hidden, weight.t(), bias=bias, dtype=dtype)
    for with_entropy in (True, False):
        blocks, x_y = head_blocks(hidden, weight, bias, targets, *head.kernel_args(),
                                  with_entropy)
        assert blocks.shape == (C, -(-vocab // VOCAB_BLOCK), 3) and x_y.dtype == dtype
        assert torch.equal(blocks, block_stats(logits.unsqueeze(1), *head.kernel_args(),
                                               with_entropy))
        assert torch.equal(x_y, logits.gather(1, targets[:, None])[:, 0])
        assert with_entropy or (blocks[..., 2] == 0).all()


def _logprobs_and_entropies(policy):
    lp, entropy = rlfuse.policy_logprobs(policy, return_entropy=True)
    return lp.sum() + entropy.sum()


def _clip_with_terms(policy):
    n, T = policy.targets.shape
    g = torch.Generator().manual_seed(4)
    mask = torch.ones(n, T, dtype=torch.bool)
    return rlfuse.policy_loss(policy, -torch.rand(n, T, generator=g),
                              torch.randn(n, generator=g), mask, "clip",
                              ref_logprobs=-torch.rand(n, T, generator=g),
                              kl=rlfuse.terms.KLPenalty(0.1, "k3"),
                              entropy=rlfuse.terms.EntropyBonus(0.01)).loss


def _ggpo(policy):
    n, T = policy.targets.shape
    g = torch.Generator().manual_seed(5)
    return rlfuse.ggpo_loss(policy, -torch.rand(n, T, generator=g),
                            torch.randint(0, 2, (n,), generator=g).float(),
                            torch.ones(n, T, dtype=torch.bool), group_size=3, beta=0.1).loss


def _teacher(policy):
    """The student's head with other hidden states and temperature, as a teacher."""
    return policy._replace(hidden=policy.hidden.detach().flip(0), temperature=1.3)


def _distill(policy):
    mask = torch.ones(policy.targets.shape, dtype=torch.bool)
    return rlfuse.distill_loss(policy, _teacher(policy), mask, rlfuse.divergences.JSD(0.3)).loss


def _divergence(policy):
    return rlfuse.token_divergence(policy, _teacher(policy), rlfuse.divergences.ReverseKL(),
                                   torch.ones(policy.targets.shape, dtype=torch.bool)).sum()


def _from_logits(policy):
    """``distill_loss`` and ``token_divergence`` beside the teacher's logits, formed outside
    the probe (a teacher's own forward)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        teacher = rlfuse.Logits(rlfuse.reference.head_logits(
            policy.hidden.detach().flip(0), policy.weight, policy.bias), policy.targets,
            temperature=1.3)
    mask = torch.ones(policy.targets.shape, dtype=torch.bool)
    return rlfuse.distill_loss(policy, teacher, mask, rlfuse.divergences.JSD(0.3)).loss + \
        rlfuse.token_divergence(policy, teacher, rlfuse.divergences.ReverseKL(), mask).sum()


@pytest.mark.parametrize("call", [_logprobs_and_entropies, _clip_with_terms, _ggpo, _distill,
                                  _divergence, _from_logits],
                         ids=["logprobs", "clip", "ggpo", "distill_loss", "token_divergence",
                              "from_teacher_logits"])
def test_no_vocabulary_sized_tensor_is_formed(call):
    """The batch-invariant head's log-probs and entropies (the old-log-prob pass), its losses
    (a token-local objective with its KL and entropy terms, GGPO) and its distillation from a
    batch-invariant teacher's head or the teacher's logits (the single pass and the two),
    forward and backward,
    allocate no tensor of a row's vocabulary, where the default head forms each chunk's logits:
    every tensor a torch op makes outside the kernels is recorded, rlfuse's ops entered (the
    probe sees the default head's ``[C, 1, V]``)."""
    from torch._library.custom_ops import _maybe_get_opdef
    from torch.utils._python_dispatch import TorchDispatchMode

    from tools.traffic import KernelCounter

    launches = KernelCounter()     # the interpreter's own torch ops inside a kernel: registers

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            opdef = _maybe_get_opdef(func) if func.namespace == "rlfuse" else None
            if opdef is not None:          # its implementation under this mode
                with self:
                    return opdef._init_fn(*args, **(kwargs or {}))
            out = func(*args, **(kwargs or {}))
            if launches.in_kernel or func.overloadpacket.__name__.endswith("_") or \
                    func.is_view:
                return out                 # a kernel's tiles, an op in place, or a view
            for x in torch.utils._pytree.tree_leaves(out):
                if isinstance(x, torch.Tensor):
                    self.numel = max(self.numel, x.numel())
            return out

    vocab = 1000
    weight, bias, fields = _head(torch.bfloat16, bias=True, vocab=vocab)
    hidden, targets = _rows(6, torch.bfloat16, seed=3, vocab=vocab)
    rows = targets.numel()
    largest = {}
    for invariant in (False, True):
        for grad in (False, True):
            leaf = hidden.clone().requires_grad_(grad)
            with torch.set_grad_enabled(grad), launches, Largest() as probe:
                loss = call(rlfuse.LinearHead(leaf, weight, targets, bias=bias,
                                              batch_invariant=invariant, **fields))
                if grad:
                    loss.backward()
            largest[invariant, grad] = probe.numel
    assert largest[False, False] >= rows * vocab and largest[False, True] >= rows * vocab
    # not even one row's vocabulary (the blocks' statistics: 3 numbers per block of 128 ids)
    assert largest[True, False] < vocab and largest[True, True] < vocab


@pytest.mark.skipif(not nvidia_backend(), reason="this triton has no NVIDIA backend")
def test_one_binary_for_any_row_count():
    """The head's kernels compile to one binary for 1, 17 and 10,000 rows: the keys of Triton's
    cache of compiled kernels (the kernel, its constexprs, its options and the specialisation of
    its arguments) of the log-probs, entropies and their gradients and of the distillation from
    a teacher head and from teacher logits, forward and backward, recorded for sm_90 without
    compiling (``row_count_keys_worker.py``). Triton specialises an integer argument equal to 1
    or divisible by 16 into another binary; the row counts are kept out of it."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "tests/row_count_keys_worker.py", "1", "17", "10000"],
                          cwd=root, env=process_env(drop=("TRITON_INTERPRET",)),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    keys = json.loads(proc.stdout.splitlines()[-1])
    kernels = {key.split("'")[1] for key in keys["1"]}
    assert {"_head_blocks_kernel", "_head_dhidden_kernel", "_head_dweight_kernel",
            "_distill_blocks_kernel", "_distill_dhidden_kernel",
            "_distill_dweight_kernel"} <= kernels, kernels
    assert keys["1"] == keys["17"] == keys["10000"]
