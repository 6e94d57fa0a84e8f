"""One rank of the DTensor tests (``tests/test_dtensor.py`` starts 2 of them with
``torch.distributed.run`` over ``gloo``, on a CPU device mesh): policies holding DTensors
sharded on the vocabulary (``Logits`` ``Shard(-1)``, a ``LinearHead`` weight and bias
``Shard(0)`` with replicated hidden states), each rank's own batch through a head sharded on
its rows (plain hidden states: FSDP2's layout; an FSDP2 ``fully_shard`` head against FSDP2's own
forward), distillation from a sharded student and teacher, and verl's Megatron-style ``linear_cross_entropy`` over a tensor-parallel group,
against the same calls on whole tensors in this process — values, metrics and gradients, each
gradient in its DTensor's layout; bad layouts raised on every rank.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dtensor_worker.py
"""
import datetime
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402

import rlfuse  # noqa: E402
from conftest import SPLIT_GRAD_TOL, SPLIT_TOL  # noqa: E402  (this script's folder)
from rlfuse import objectives, terms  # noqa: E402

B, T, V_LOCAL, H = 3, 4, 6, 5
DTYPE = torch.float64
TOL = dict(rtol=SPLIT_TOL[DTYPE], atol=SPLIT_TOL[DTYPE])
GRAD_TOL = dict(rtol=SPLIT_GRAD_TOL[DTYPE], atol=SPLIT_GRAD_TOL[DTYPE])


def make_data(world, seed=7, B=B):
    """The same data on every rank (``seed``: another batch, as a rank's own)."""
    g = torch.Generator().manual_seed(seed)
    V = V_LOCAL * world
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[0, :world] = torch.arange(world) * V_LOCAL + 2     # a target on every shard
    logits = 3 * torch.randn(B, T, V, generator=g, dtype=DTYPE)
    hidden = torch.randn(B, T, H, generator=g, dtype=DTYPE)
    weight = torch.randn(V, H, generator=g, dtype=DTYPE) / H ** 0.5 * 3
    bias = 0.1 * torch.randn(V, generator=g, dtype=DTYPE)
    own = rlfuse.reference.token_logprobs(logits, targets, mask=mask)
    old = torch.where(mask, own + 0.3 * torch.randn(B, T, generator=g, dtype=DTYPE), 0)
    adv = torch.randn(B, 1, generator=g, dtype=DTYPE).expand(B, T)
    ref = torch.where(mask, own - 0.2, 0)
    return dict(V=V, mask=mask, targets=targets, logits=logits, hidden=hidden, weight=weight,
                bias=bias, old=old.clamp_max(0), adv=adv, ref=ref.clamp_max(0))


def leaf(x):
    return x.detach().clone().requires_grad_(True)


def dleaf(x, mesh, placements):
    return distribute_tensor(x.detach().clone(), mesh, placements).requires_grad_(True)


def close(got, want, what, tol=TOL):
    if isinstance(got, DTensor):
        got = got.full_tensor()
    torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{what}: {m}")


# the calls checked in every form: (name, fn(policy, d) -> tensors to compare and backpropagate)
def logprobs_call(policy, d):
    logp, entropy = rlfuse.policy_logprobs(policy, return_entropy=True)
    return {"logp": logp, "entropy": entropy}


def loss_call(policy, d):
    out = rlfuse.policy_loss(policy, d["old"], d["adv"], d["mask"], objectives.Clip(),
                             ref_logprobs=d["ref"], kl=terms.KLPenalty(0.05),
                             entropy=terms.EntropyBonus(0.01))
    return {"loss": out.loss, **out.metrics}


def gspo_call(policy, d):      # a sequence-level ratio: the two passes
    out = rlfuse.policy_loss(policy, d["old"], d["adv"], d["mask"], objectives.GSPO())
    return {"loss": out.loss, **out.metrics}


CALLS = {"policy_logprobs": logprobs_call, "policy_loss": loss_call, "gspo": gspo_call}


# the head's options over the split (a logit scale alone is the case whose units differ from
# the raw logits', Cohere's 0.0625)
HEADS = {"head": {}, "scaled_head": dict(logit_scale=0.0625, temperature=0.7),
         "softcapped_head": dict(softcap=2.0, temperature=1.3)}


def check_call(name, form, d, mesh, rank):
    call = CALLS[name]
    if form == "logits":
        whole = leaf(d["logits"])
        want = call(rlfuse.Logits(whole, d["targets"]), d)
        shard = dleaf(d["logits"], mesh, [Shard(2)])
        got = call(rlfuse.Logits(shard, distribute_tensor(d["targets"], mesh, [Replicate()])),
                   d)
        pairs = [(shard, whole)]
    else:
        wholes = [leaf(d[k]) for k in ("hidden", "weight", "bias")]
        want = call(rlfuse.LinearHead(wholes[0], wholes[1], d["targets"], wholes[2],
                                      **HEADS[form]), d)
        shards = [dleaf(d["hidden"], mesh, [Replicate()]), dleaf(d["weight"], mesh, [Shard(0)]),
                  dleaf(d["bias"], mesh, [Shard(0)])]
        got = call(rlfuse.LinearHead(shards[0], shards[1], d["targets"], shards[2],
                                     **HEADS[form]), d)
        pairs = list(zip(shards, wholes))
    assert set(got) == set(want), (set(got), set(want))
    for key in want:
        assert not isinstance(got[key], DTensor), key     # results: plain tensors
        close(got[key], want[key], f"{form} {name} {key} (rank {rank})")
    seed = torch.Generator().manual_seed(3)
    grad_of = [k for k in want if want[k].requires_grad]
    weights = {k: torch.randn(want[k].shape, generator=seed, dtype=want[k].dtype) for k in grad_of}
    sum(((want[k] * weights[k]).sum() for k in grad_of)).backward()
    sum(((got[k] * weights[k]).sum() for k in grad_of)).backward()
    for shard, whole in pairs:
        assert isinstance(shard.grad, DTensor) and shard.grad.placements == shard.placements
        close(shard.grad, whole.grad, f"{form} {name} gradient (rank {rank})", GRAD_TOL)


def check_rank_rows(name, d, mesh, rank, world):
    """Each rank its own batch (of its own size) through a head sharded on its rows (FSDP2's
    layout: plain hidden states beside a ``Shard(0)`` weight): every rank's results are those of
    its own rows over the whole vocabulary, its hidden states' gradient its own loss's, and each
    shard's gradient the mean over the ranks of their losses' gradients."""
    call = CALLS[name]
    batches = [make_data(world, seed=100 + r, B=B + r) for r in range(world)]
    head = [leaf(d[k]) for k in ("weight", "bias")]
    mine = None
    for r, batch in enumerate(batches):
        hidden = leaf(batch["hidden"])
        out = call(rlfuse.LinearHead(hidden, head[0], batch["targets"], head[1]), batch)
        grad_of = sorted(k for k in out if out[k].requires_grad)
        seed = torch.Generator().manual_seed(11 + r)
        weights = {k: torch.randn(out[k].shape, generator=seed, dtype=DTYPE) for k in grad_of}
        (sum((out[k] * weights[k]).sum() for k in grad_of) / world).backward()
        if r == rank:
            mine = (out, hidden, weights)
    want, want_hidden, weights = mine
    own = batches[rank]
    shards = [dleaf(d["weight"], mesh, [Shard(0)]), dleaf(d["bias"], mesh, [Shard(0)])]
    hidden = leaf(own["hidden"])
    got = call(rlfuse.LinearHead(hidden, shards[0], own["targets"], shards[1]), own)
    assert set(got) == set(want)
    for key in want:
        close(got[key], want[key], f"own rows {name} {key} (rank {rank})")
    sum((got[k] * weights[k]).sum() for k in weights).backward()
    if name == "policy_logprobs":
        # the reference's path for these rows (a CPU fallback's)
        local = rlfuse.LinearHead(own["hidden"], shards[0], own["targets"], shards[1]).local()
        for x, y in zip(rlfuse.reference.policy_logprobs(local, return_entropy=True),
                        (want["logp"], want["entropy"])):
            close(x, y, f"own rows, the reference (rank {rank})")
        # a window of a longer output (a prompt row first: offset 1), and packed rows
        prompt = torch.randn(B + rank, 1, H, dtype=DTYPE)
        window = rlfuse.LinearHead(torch.cat([prompt, own["hidden"]], 1), shards[0],
                                   own["targets"], shards[1], offset=1)
        close(rlfuse.policy_logprobs(window), want["logp"], f"own rows, offset (rank {rank})")
        n = own["targets"].numel()
        packed = rlfuse.LinearHead(own["hidden"].reshape(n, H), shards[0],
                                   own["targets"].reshape(n), shards[1], index=torch.arange(n))
        close(rlfuse.policy_logprobs(packed), want["logp"].reshape(n),
              f"own rows, packed (rank {rank})")
    close(hidden.grad, want_hidden.grad * world, f"own rows {name} dhidden (rank {rank})",
          GRAD_TOL)
    for shard, whole in zip(shards, head):
        assert isinstance(shard.grad, DTensor) and shard.grad.placements == shard.placements
        close(shard.grad, whole.grad, f"own rows {name} shard gradient (rank {rank})", GRAD_TOL)


def check_fsdp2_head(d, rank, world):
    """An FSDP2 head (``fully_shard``): its sharded weight used as it is, outside the module's
    forward, gives the loss and the sharded gradient that FSDP2 itself gives when the module
    runs (its weight gathered, its gradient reduce-scattered as the mean over the ranks)."""
    from torch.distributed.fsdp import fully_shard

    own = make_data(world, seed=200 + rank, B=B + rank)
    results = []
    for ours in (False, True):
        torch.manual_seed(0)
        head = fully_shard(torch.nn.Linear(H, d["V"], dtype=DTYPE))
        hidden = leaf(own["hidden"])
        if ours:
            policy = rlfuse.LinearHead(hidden, head.weight, own["targets"], head.bias)
        else:
            policy = rlfuse.Logits(head(hidden), own["targets"])
        out = rlfuse.policy_loss(policy, own["old"], own["adv"], own["mask"], objectives.Clip(),
                                 entropy=terms.EntropyBonus(0.01))
        out.loss.backward()
        results.append((out.loss.detach(), hidden.grad, head.weight.grad.to_local(),
                        head.bias.grad.to_local()))
    for what, got, want in zip(("loss", "dhidden", "dweight", "dbias"), results[1], results[0]):
        close(got, want, f"FSDP2 head {what} (rank {rank})", GRAD_TOL)


def check_linear_cross_entropy(d, group, rank, world):
    """verl's Megatron-style call: each rank its ``[V_local, H]`` rows of the output layer,
    labels global ids, flat results; equal to the whole vocabulary, gradients too (the hidden
    states': each rank's share, summed over the group)."""
    from rlfuse.integrations.verl import linear_cross_entropy, log_probs_and_entropy

    hidden, weight = leaf(d["hidden"]), leaf(d["weight"])
    want = linear_cross_entropy(hidden, weight, d["targets"], 0.7)
    h2 = leaf(d["hidden"])
    w2 = leaf(d["weight"][rank * V_LOCAL:(rank + 1) * V_LOCAL])
    got = linear_cross_entropy(h2, w2, d["targets"], 0.7, "none", group)
    for g, w, what in zip(got, want, ("logprobs", "entropy")):
        assert g.shape == (B * T,), g.shape
        close(g, w, f"linear_cross_entropy {what} (rank {rank})")
    seed = torch.Generator().manual_seed(5)
    a, b = (torch.randn(B * T, generator=seed, dtype=DTYPE) for _ in "ab")
    ((want[0] * a).sum() + (want[1] * b).sum()).backward()
    ((got[0] * a).sum() + (got[1] * b).sum()).backward()
    # each rank's share of dhidden, which Megatron's sequence-parallel gather sums (verl's
    # contract: its kernel leaves each rank its shard's partial gradient)
    close(h2.grad * world, hidden.grad, f"linear_cross_entropy dhidden (rank {rank})", GRAD_TOL)
    summed = h2.grad.clone()
    dist.all_reduce(summed, group=group)
    close(summed, hidden.grad, f"linear_cross_entropy summed dhidden (rank {rank})", GRAD_TOL)
    close(w2.grad, weight.grad[rank * V_LOCAL:(rank + 1) * V_LOCAL],
          f"linear_cross_entropy dweight (rank {rank})", GRAD_TOL)
    total = linear_cross_entropy(h2, w2, d["targets"], 0.7, "sum", group)[0]
    close(total, want[0].sum(), f"linear_cross_entropy sum (rank {rank})")
    # the backend's call with the model's head options (a scaled head, Cohere's) over the split
    for head in ({"logit_scale": 0.0625}, {"logit_scale": 0.5, "softcap": 3.0}):
        want = log_probs_and_entropy(d["hidden"], d["weight"], d["targets"], 0.7, **head)
        got = log_probs_and_entropy(d["hidden"], d["weight"][rank * V_LOCAL:(rank + 1) * V_LOCAL],
                                    d["targets"], 0.7, group=group, **head)
        for g, w, what in zip(got, want, ("logprobs", "entropy")):
            close(g, w, f"log_probs_and_entropy {head} {what} (rank {rank})")


def check_distill(d, mesh, rank):
    """Distillation from DTensors sharded on the vocabulary: a Logits student (``Shard(-1)``)
    beside a Logits teacher (``Shard(-1)``) and a LinearHead teacher (its weight ``Shard(0)``),
    each against the whole tensors: the loss, metrics and the student's gradient, in its
    DTensor's layout."""
    from rlfuse.divergences import JSD, ReverseKL

    g = torch.Generator().manual_seed(11)
    t_logits = 2 * torch.randn(d["logits"].shape, generator=g, dtype=DTYPE)
    y = d["targets"]
    for form, divergence in (("logits", JSD(0.3)), ("head", ReverseKL())):
        whole = leaf(d["logits"])
        shard = dleaf(d["logits"], mesh, [Shard(2)])
        if form == "logits":
            teachers = (rlfuse.Logits(t_logits, y, 1.2),
                        rlfuse.Logits(distribute_tensor(t_logits, mesh, [Shard(2)]), y, 1.2))
        else:
            teachers = (rlfuse.LinearHead(d["hidden"], d["weight"], y, d["bias"], 1.2,
                                          softcap=2.0),
                        rlfuse.LinearHead(distribute_tensor(d["hidden"], mesh, [Replicate()]),
                                          distribute_tensor(d["weight"], mesh, [Shard(0)]), y,
                                          distribute_tensor(d["bias"], mesh, [Shard(0)]), 1.2,
                                          softcap=2.0))
        want, got = (rlfuse.distill_loss(rlfuse.Logits(x, y, 0.9), t, d["mask"], divergence)
                     for x, t in zip((whole, shard), teachers))
        what = f"distill {form} (rank {rank})"
        close(got.loss, want.loss, what)
        for key in want.metrics:
            close(got.metrics[key], want.metrics[key], f"{what} {key}")
        want.loss.backward()
        got.loss.backward()
        assert isinstance(shard.grad, DTensor) and shard.grad.placements == shard.placements
        close(shard.grad, whole.grad, f"{what} gradient", GRAD_TOL)


def raises(fn, match, rank):
    try:
        fn()
    except ValueError as e:
        assert match in str(e), (match, str(e))
    else:
        raise AssertionError(f"rank {rank}: expected a ValueError with {match!r}")


def check_bad_layouts(d, mesh, group, rank, world):
    """Each bad layout raises on every rank from metadata alone (no rank waits in a
    collective): logits sharded on another dim, a vocabulary that does not split evenly, a
    DTensor beside plain tensors, both a mesh and a group, a bias not sharded as the weight."""
    logits = distribute_tensor(d["logits"], mesh, [Shard(1)])
    raises(lambda: rlfuse.policy_logprobs(rlfuse.Logits(logits, d["targets"])),
           "expected a DTensor sharded on the vocabulary (Shard(2))", rank)
    ragged = distribute_tensor(d["logits"][..., :-1], mesh, [Shard(2)])
    raises(lambda: rlfuse.policy_logprobs(rlfuse.Logits(ragged, d["targets"])),
           "must split evenly", rank)
    targets = distribute_tensor(d["targets"], mesh, [Replicate()])
    raises(lambda: rlfuse.policy_logprobs(rlfuse.Logits(d["logits"], targets)),
           "policy.targets: a DTensor beside a plain policy.logits", rank)
    shard = distribute_tensor(d["logits"], mesh, [Shard(2)])
    raises(lambda: rlfuse.policy_logprobs(rlfuse.Logits(shard, d["targets"],
                                                        vocab_parallel_group=group)),
           "policy.vocab_parallel_group", rank)
    hidden = distribute_tensor(d["hidden"], mesh, [Replicate()])
    weight = distribute_tensor(d["weight"], mesh, [Shard(0)])
    raises(lambda: rlfuse.policy_logprobs(rlfuse.LinearHead(hidden, weight, d["targets"],
                                                            d["bias"])),
           "policy.bias: expected a DTensor sharded as policy.weight", rank)
    raises(lambda: rlfuse.token_logprobs(shard, d["targets"]), "policy: a DTensor", rank)
    sharded_hidden = distribute_tensor(d["hidden"], mesh, [Shard(0)])
    raises(lambda: rlfuse.policy_logprobs(rlfuse.LinearHead(sharded_hidden, weight,
                                                            d["targets"])),
           "policy.hidden: expected a plain tensor or a DTensor replicated", rank)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    d = make_data(world)
    for name in CALLS:
        for form in ("logits", *HEADS):
            if form in ("logits", "head") or name != "gspo":
                check_call(name, form, d, mesh, rank)
        check_rank_rows(name, d, mesh, rank, world)
    check_distill(d, mesh, rank)
    check_fsdp2_head(d, rank, world)
    check_linear_cross_entropy(d, mesh.get_group(0), rank, world)
    check_bad_layouts(d, mesh, mesh.get_group(0), rank, world)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: ok", flush=True)
    # every check passed: leave before the interpreter's teardown, where background threads
    # (gloo's, torch.compile's workers') can abort a finished process under load
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
