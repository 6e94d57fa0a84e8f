"""One rank of the Megatron-core tests (``tests/test_megatron.py`` starts W of them with
``torch.distributed.run`` over ``gloo``, Megatron's tensor-parallel group of W from its own
``parallel_state``): ``rlfuse.integrations.megatron`` and verl's Megatron fused forward through
rlfuse (``patch_megatron``) against Megatron's own output layer and cross entropy
(``gather_from_sequence_parallel_region`` or ``copy_to_tensor_model_parallel_region``, the
shard's logits, ``vocab_parallel_cross_entropy``) and verl's ``vocab_parallel_entropy`` on the
logits the test forms, with and without sequence parallelism: log-probs, entropy and the
gradients of this rank's hidden rows and weight shard; a loss from ``output_head`` equal to one
process's; bad layouts raising on every rank. On 4 ranks: data x context parallelism's
counts (``global_counts``) and a loss with them; tensor (with sequence) x context parallelism
through ``output_head`` against one process.

    python -m torch.distributed.run --standalone --nproc_per_node W tests/megatron_worker.py
"""
import datetime
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")       # before triton is imported
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")  # verl's entropy compiles an inner function

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# Megatron's sequence-parallel gather allocates its buffers on torch.cuda.current_device(): on
# this CPU-only machine, the CPU.
torch.cuda.current_device = lambda: "cpu"

from megatron.core import parallel_state  # noqa: E402
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy  # noqa: E402
from megatron.core.tensor_parallel.mappings import (  # noqa: E402
    copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region)
from verl.utils.megatron.tensor_parallel import vocab_parallel_entropy  # noqa: E402

import rlfuse  # noqa: E402
from conftest import SPLIT_GRAD_TOL, SPLIT_TOL, TOL  # noqa: E402  (this script's folder)
from rlfuse.integrations import megatron as rlfuse_megatron  # noqa: E402
from rlfuse.scaleout.context import own_positions  # noqa: E402

S, B, H, V_LOCAL, TEMPERATURE = 8, 2, 6, 7, 0.7
DTYPE = torch.float32      # Megatron's cross entropy computes in fp32 whatever it is given


def make_data(world):
    """The same data on every rank: hidden states ``[S, B, H]``, the whole head, labels ``[B,
    S]``, the upstream gradients of the log-probs and the entropy, the loss inputs."""
    g = torch.Generator().manual_seed(11)
    V = V_LOCAL * world
    return dict(hidden=torch.randn(S, B, H, generator=g, dtype=torch.float64).to(DTYPE),
                weight=(3 * torch.randn(V, H, generator=g, dtype=torch.float64) / H ** 0.5)
                .to(DTYPE),
                labels=torch.randint(0, V, (B, S), generator=g),
                upstream=torch.randn(2, B, S, generator=g, dtype=torch.float64).to(DTYPE),
                old=-torch.rand(B, S, generator=g, dtype=torch.float64).to(DTYPE),
                adv=torch.randn(B, generator=g, dtype=torch.float64).to(DTYPE),
                mask=torch.rand(B, S, generator=g) > 0.2)


def leaves(d, rank, world, sequence_parallel):
    """(this rank's hidden rows, its weight shard): fresh leaves."""
    n = S // world if sequence_parallel else S
    start = rank * n if sequence_parallel else 0
    hidden = d["hidden"][start:start + n].clone().requires_grad_()
    weight = d["weight"][rank * V_LOCAL:(rank + 1) * V_LOCAL].clone().requires_grad_()
    return hidden, weight


def megatron_step(d, rank, world, sequence_parallel):
    """Megatron's own output layer (its sequence-parallel gather, or its copy to the
    tensor-parallel region) and vocab-parallel cross entropy, verl's vocab-parallel entropy:
    ``(logp [B, S], entropy [B, S], (dhidden, dweight))``."""
    hidden, weight = leaves(d, rank, world, sequence_parallel)
    rows = gather_from_sequence_parallel_region(hidden) if sequence_parallel else \
        copy_to_tensor_model_parallel_region(hidden)
    logits = rows @ weight.t() / TEMPERATURE                         # [S, B, V / tp]
    logp = -vocab_parallel_cross_entropy(logits.clone(), d["labels"].t().contiguous()).t()
    entropy = vocab_parallel_entropy(logits).t()
    grads = torch.autograd.grad((logp * d["upstream"][0]).sum() +
                                (entropy * d["upstream"][1]).sum(), (hidden, weight))
    return logp.detach(), entropy.detach(), grads


def close(got, want, what, tol):
    scale = max(1.0, want.double().abs().max().item())
    torch.testing.assert_close(got.double(), want.double(), rtol=0, atol=tol * scale,
                               msg=lambda m: f"{what}: {m}")


def check_logprobs_and_entropy(d, rank, world):
    """rlfuse in the output layer's place, equal to Megatron's, with and without sequence
    parallelism, fused and through verl's Megatron fused forward (``patch_megatron``: verl
    gathers the rows itself and hands them to ``linear_cross_entropy``)."""
    from types import SimpleNamespace

    from rlfuse.integrations import verl as rlfuse_verl
    from verl.models.mcore import model_forward_fused

    rlfuse_verl.patch_megatron()
    assert model_forward_fused.linear_cross_entropy is rlfuse_verl.linear_cross_entropy
    for sequence_parallel in (False, True):
        want_logp, want_entropy, want_grads = megatron_step(d, rank, world, sequence_parallel)
        hidden, weight = leaves(d, rank, world, sequence_parallel)
        logp, entropy = rlfuse_megatron.logprobs_and_entropy(
            hidden, weight, d["labels"], temperature=TEMPERATURE,
            sequence_parallel=sequence_parallel)
        runs = {"rlfuse.integrations.megatron": (logp, entropy, (hidden, weight))}
        if sequence_parallel:     # verl's processor: batch 1 (its packed rows), flat results
            for b in range(B):
                hidden_b, weight_b = leaves(d, rank, world, True)
                hidden_b = hidden_b[:, b:b + 1].detach().requires_grad_()
                out = model_forward_fused.fused_output_processor(
                    hidden_states=hidden_b, output_layer=None, output_weight=weight_b,
                    labels=d["labels"][b:b + 1], context=SimpleNamespace(
                        temperature=TEMPERATURE), config=SimpleNamespace(sequence_parallel=True))
                runs[f"verl fused_output_processor, sequence {b}"] = (
                    out.log_probs.view(1, S), out.entropy.view(1, S), (hidden_b, weight_b), b)
        for where, (lp, ent, grad_leaves, *row) in runs.items():
            rows = slice(row[0], row[0] + 1) if row else slice(None)
            where = f"rank {rank}/{world} sp={sequence_parallel} {where}"
            close(lp.detach(), want_logp[rows], f"{where} log-probs", SPLIT_TOL[DTYPE])
            close(ent.detach(), want_entropy[rows], f"{where} entropy", SPLIT_TOL[DTYPE])
            if row:   # one sequence's share of Megatron's gradients: its own run of Megatron
                continue
            grads = torch.autograd.grad((lp * d["upstream"][0]).sum() +
                                        (ent * d["upstream"][1]).sum(), grad_leaves)
            for name, got, want in zip(("dhidden", "dweight"), grads, want_grads):
                close(got, want, f"{where} {name}", SPLIT_GRAD_TOL[DTYPE])
    check_verl_gradients(d, rank, world)


def check_verl_gradients(d, rank, world):
    """verl's Megatron fused forward through rlfuse, one sequence (verl's packed batch of 1):
    the gradients of this rank's rows and shard equal to Megatron's output layer's."""
    from types import SimpleNamespace

    from verl.models.mcore import model_forward_fused

    one = dict(d, hidden=d["hidden"][:, :1], labels=d["labels"][:1],
               upstream=d["upstream"][:, :1])
    _, _, want = megatron_step(one, rank, world, True)
    hidden, weight = leaves(one, rank, world, True)
    out = model_forward_fused.fused_output_processor(
        hidden_states=hidden, output_layer=None, output_weight=weight, labels=one["labels"],
        context=SimpleNamespace(temperature=TEMPERATURE),
        config=SimpleNamespace(sequence_parallel=True))
    grads = torch.autograd.grad((out.log_probs * one["upstream"][0].reshape(-1)).sum() +
                                (out.entropy * one["upstream"][1].reshape(-1)).sum(),
                                (hidden, weight))
    for name, got, want_grad in zip(("dhidden", "dweight"), grads, want):
        close(got, want_grad, f"rank {rank}/{world} verl fused forward {name}",
              SPLIT_GRAD_TOL[DTYPE])


def check_loss_is_one_process(d, rank, world):
    """A loss on ``output_head`` (sequence parallel): the same loss on every rank as one process
    computes over the whole head and all the rows (fused and reference), the gradients of this
    rank's rows and shard."""
    for lib in (rlfuse, rlfuse.reference):
        whole = (d["hidden"].clone().requires_grad_(), d["weight"].clone().requires_grad_())
        one = lib.ppo_loss(lib.LinearHead(whole[0].transpose(0, 1), whole[1], d["labels"],
                                          temperature=TEMPERATURE),
                           d["old"], d["adv"], d["mask"], clip=(0.2, 0.28))
        want = torch.autograd.grad(one.loss, whole)
        hidden, weight = leaves(d, rank, world, True)
        head = rlfuse_megatron.output_head(hidden, weight, d["labels"], temperature=TEMPERATURE,
                                           sequence_parallel=True)
        out = lib.ppo_loss(head, d["old"], d["adv"], d["mask"], clip=(0.2, 0.28))
        where = f"rank {rank}/{world} {lib.__name__} ppo_loss"
        close(out.loss.detach(), one.loss.detach(), f"{where} loss", SPLIT_TOL[DTYPE])
        grads = torch.autograd.grad(out.loss, (hidden, weight))
        n = S // world
        own = (want[0][rank * n:(rank + 1) * n], want[1][rank * V_LOCAL:(rank + 1) * V_LOCAL])
        for name, got, expected in zip(("dhidden", "dweight"), grads, own):
            close(got, expected, f"{where} {name}", SPLIT_GRAD_TOL[DTYPE])


def check_bad_layouts(d, rank, world):
    """Labels of the wrong shape raise before any collective, ragged sequence-parallel rows
    in the gather's own count: a ValueError on every rank, never a hang."""
    hidden, weight = leaves(d, rank, world, True)
    for labels, what in ((d["labels"][:, :-1], "labels: expected [b, s]"),
                         (d["labels"].t(), "labels: expected [b, s]")):
        try:
            rlfuse_megatron.logprobs_and_entropy(hidden, weight, labels, sequence_parallel=True)
        except ValueError as e:
            assert what in str(e), e
        else:
            raise AssertionError(f"rank {rank}: labels {tuple(labels.shape)} were accepted")
    ragged = d["hidden"][:S // world + (rank == 0)]
    try:
        rlfuse.policy_logprobs(rlfuse.LinearHead(
            ragged.transpose(0, 1), weight, d["labels"],
            vocab_parallel_group=parallel_state.get_tensor_model_parallel_group(),
            sequence_parallel=True))
    except ValueError as e:
        assert "holds as many rows" in str(e), e
    else:
        raise AssertionError(f"rank {rank}: ragged sequence-parallel rows were accepted")


def check_context_parallel_counts(rank):
    """Data parallelism 2 x context parallelism 2 (Megatron's groups): each rank the chunks of
    its sequences that Megatron's ``get_batch_on_this_cp_rank`` gives it; ``global_counts``
    with both groups equals one process's counts over every sequence (one sequence's actor
    tokens all in one rank's chunks, one without any), on every rank; without the data-parallel
    group it raises."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                             context_parallel_size=2)
    mask = torch.zeros(4, 8, dtype=torch.bool)
    mask[0, :2] = True                    # chunk 0 alone: context-parallel rank 0's
    mask[1, 1:7] = True
    mask[3, 5:] = True                    # mask[2]: no actor token
    dp = parallel_state.get_data_parallel_rank()
    local = get_batch_on_this_cp_rank({"loss_mask": mask[2 * dp:2 * dp + 2].clone()})
    tokens, sequences = rlfuse.global_counts(
        local["loss_mask"], parallel_state.get_data_parallel_group(),
        context_parallel_group=parallel_state.get_context_parallel_group())
    assert (tokens.item(), sequences.item()) == (mask.sum().item(), 3), (rank, tokens, sequences)
    try:
        rlfuse.global_counts(local["loss_mask"],
                             context_parallel_group=parallel_state.get_context_parallel_group())
    except ValueError as e:
        assert "pass the data-parallel group" in str(e), e
    else:
        raise AssertionError(f"rank {rank}: context parallelism without a data-parallel group")
    # a loss of each rank's chunks with those counts: the four ranks' losses sum to one
    # process's over the four sequences, each rank's gradient is its positions'
    g = torch.Generator().manual_seed(2)
    lp_all = -torch.rand(4, 8, generator=g, dtype=torch.float64)
    old_all = -torch.rand(4, 8, generator=g, dtype=torch.float64)
    adv_all = torch.randn(4, generator=g, dtype=torch.float64)
    whole = lp_all.clone().requires_grad_()
    one = rlfuse.policy_loss(whole, old_all, adv_all, mask, "gspo")
    want = torch.autograd.grad(one.loss, whole)[0]
    rows = slice(2 * dp, 2 * dp + 2)
    cp_rank = parallel_state.get_context_parallel_rank()
    batch = get_batch_on_this_cp_rank({"lp": lp_all[rows].clone(), "old": old_all[rows].clone()})
    lp = batch["lp"].requires_grad_()
    out = rlfuse.policy_loss(lp, batch["old"], adv_all[rows], local["loss_mask"], "gspo",
                             num_tokens=tokens, num_sequences=4,
                             context_parallel_group=parallel_state.get_context_parallel_group())
    total = out.loss.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, one.loss.detach(), **TOL["fp64_chain"])
    torch.testing.assert_close(torch.autograd.grad(out.loss, lp)[0],
                               own_positions(want[rows], cp_rank, 2), **TOL["fp64_chain"])
    # Megatron's calculate_per_token_loss: each rank returns its token sum and its own token
    # count; Megatron sums both over the micro-batches and ranks and divides
    out = rlfuse.policy_loss(lp, batch["old"], adv_all[rows], local["loss_mask"], "clip",
                             agg="token-sum",
                             context_parallel_group=parallel_state.get_context_parallel_group())
    sums = torch.stack([out.loss.detach(), local["loss_mask"].sum().double()])
    dist.all_reduce(sums)
    one = rlfuse.policy_loss(lp_all, old_all, adv_all, mask, "clip")
    torch.testing.assert_close(sums[0] / sums[1], one.loss, **TOL["fp64_chain"])
    parallel_state.destroy_model_parallel()


def check_tensor_times_context_parallel(rank):
    """Tensor parallelism 2 with sequence parallelism x context parallelism 2: each rank's
    hidden rows are its tensor-parallel slice of its context-parallel chunks of every sequence,
    the head its vocabulary shard; a sequence-level loss (GSPO) through ``output_head``: the
    context-parallel ranks' losses sum to one process's over the whole head and sequences,
    each rank's gradients are those of its rows and (summed over the context-parallel ranks)
    its shard."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2,
                                             context_parallel_size=2)
    tp, cp = parallel_state.get_tensor_model_parallel_rank(), \
        parallel_state.get_context_parallel_rank()
    cp_group = parallel_state.get_context_parallel_group()
    d = make_data(2)
    for lib in (rlfuse, rlfuse.reference):
        whole = (d["hidden"].clone().requires_grad_(), d["weight"].clone().requires_grad_())
        one = lib.policy_loss(lib.LinearHead(whole[0].transpose(0, 1), whole[1], d["labels"],
                                             temperature=TEMPERATURE),
                              d["old"], d["adv"], d["mask"], "gspo")
        want = torch.autograd.grad(one.loss, whole)
        batch = get_batch_on_this_cp_rank({k: d[k].clone() for k in ("labels", "old", "mask")})
        chunks = own_positions(d["hidden"].transpose(0, 1), cp, 2).transpose(0, 1)  # [S/2, B, H]
        n = chunks.shape[0] // 2
        hidden = chunks[tp * n:(tp + 1) * n].clone().requires_grad_()
        weight = d["weight"][tp * V_LOCAL:(tp + 1) * V_LOCAL].clone().requires_grad_()
        head = rlfuse_megatron.output_head(hidden, weight, batch["labels"],
                                           temperature=TEMPERATURE, sequence_parallel=True)
        out = lib.policy_loss(head, batch["old"], d["adv"], batch["mask"], "gspo",
                              context_parallel_group=cp_group)
        where = f"rank {rank} tp {tp} cp {cp} {lib.__name__}"
        total = out.loss.detach().clone()
        dist.all_reduce(total, group=cp_group)
        close(total, one.loss.detach(), f"{where} loss", SPLIT_TOL[DTYPE])
        dhidden, dweight = torch.autograd.grad(out.loss, (hidden, weight))
        dist.all_reduce(dweight, group=cp_group)
        want_rows = own_positions(want[0].transpose(0, 1), cp, 2).transpose(0, 1)
        close(dhidden, want_rows[tp * n:(tp + 1) * n], f"{where} dhidden", SPLIT_GRAD_TOL[DTYPE])
        close(dweight, want[1][tp * V_LOCAL:(tp + 1) * V_LOCAL], f"{where} dweight",
              SPLIT_GRAD_TOL[DTYPE])
    parallel_state.destroy_model_parallel()


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 4:
        check_context_parallel_counts(rank)
        check_tensor_times_context_parallel(rank)
    else:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        d = make_data(world)
        check_logprobs_and_entropy(d, rank, world)
        check_loss_is_one_process(d, rank, world)
        check_bad_layouts(d, rank, world)
        parallel_state.destroy_model_parallel()
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: ok", flush=True)
    # every check passed: leave before the interpreter's teardown, where background threads
    # (gloo's, torch.compile's workers') can abort a finished process under load
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
