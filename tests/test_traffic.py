"""The bytes every kernel moves, counted in the Triton interpreter (``tools/traffic.py``), pinned
per row of logits: each op at its floor in reads and writes per actor row, masked rows read
nothing and get one row of zeros, no op adds a torch pass over logits outside its kernels. A
change that adds a read or a write of a row, or a byte to any row, fails here.

The counts are exact element counts over ``rows x V``; a forward kernel also reads each actor
row's target logit once on its own (``z[y]``, one element: ``1 / V`` of a row).
"""
import dataclasses

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from bench import distill_cases
from tools import traffic

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="counts bytes in the Triton interpreter (CPU)")

V = 9001   # two vocab blocks in bf16 (8192) and three in fp32 (4096), with a ragged tail


@pytest.fixture(autouse=True)
def unpoisoned(monkeypatch):
    """Poisoning (conftest) fills every output before the kernel writes it: a write of its own."""
    from rlfuse.kernels.lib import utils

    monkeypatch.setattr(utils, "OUTPUT_FILL", None)


@triton.jit
def _copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + cols, tl.load(src + cols, mask=cols < n), mask=cols < n)


def test_copy_kernel_counts_twice_its_bytes():
    src = torch.randn(1000)
    dst = torch.empty(1000)
    with traffic.KernelCounter() as counter:
        _copy_kernel[(triton.cdiv(1000, 256),)](src, dst, 1000, BLOCK=256)
    (launch,) = counter.launches
    assert launch.kernel == "_copy_kernel"
    assert launch.bytes("loads") == launch.bytes("stores") == src.numel() * 4
    assert torch.equal(src, dst)


def test_copy_of_rows_counts_one_read_and_one_write_per_row():
    """The per-row attribution on a strided [B, S, V] view: the rows of the window are read once
    and written once, by class; nothing lands on rows outside it."""
    B, S, T, offset = 2, 4, 2, 1
    full = torch.randn(B, S + 1, V)
    view = full[:, :-1]                      # [B, S, V] with a batch stride of (S + 1) V
    mask = torch.tensor([[True, False], [True, True]])
    out = torch.empty(B, S, V)

    def run():
        for b in range(B):
            for s in range(offset, offset + T):
                _copy_kernel[(triton.cdiv(V, 1024),)](view[b, s], out[b, s], V, BLOCK=1024)

    geometry = traffic.Geometry(B=B, S=S, T=T, V=V, offset=offset, mask=mask, element_size=4)
    counter = traffic.KernelCounter()
    with counter:
        run()
    # each launch sees its own row only as a 1-D tensor; give the counter the [B, S, V] views
    for launch in counter.launches:
        launch.tensors = [view, out]
    totals = sum(traffic.launch_rows(launch, geometry)[0] for launch in counter.launches)
    counts = geometry.row_counts
    for c, name in enumerate(traffic.ROW_CLASSES[:3]):
        expected = 1 if name in ("actor", "masked") else 0
        assert tuple(totals[c]) == (expected * counts[c] * V,) * 3, name


def _expected(name, op, mode):
    """The pinned counts of the registry's op (or variant) ``name`` in ``mode``: per row class
    ``(reads, distinct reads, writes)`` in rows; the torch ops over logits outside the kernels
    per actor row; and the logits-sized allocations per row of the [B, T] window."""
    if not op.from_logits:
        return {}, {}, 0.0
    if name.startswith("distill_top_k"):
        return _expected_top_k(op, mode)
    if name.startswith(("distill", "token_divergence")):
        return _expected_distill(name, op, mode)
    if name.startswith("logprobs_head"):
        return _expected_head_logprobs(name, mode)
    target = 1 / V      # z[y], read once by a forward kernel
    single_pass = not name.startswith(("token_logprobs", "ggpo")) and \
        "two passes" not in name                # token-local losses
    writes = 0 if mode == "fwd" else 1
    if mode == "fwd":
        actor = (1 + target, 1, 0)
    elif mode == "bwd":
        actor = (1, 1, 1)
    elif single_pass:
        actor = (2 + target, 1, 1)              # one read, one L2 re-read, one write
    else:
        actor = (2 + target, 2, 1)              # the log-prob pass, then the gradient pass
    if "upstream gradient" in name:             # the backward rescales the written rows
        actor = (actor[0] + 1, actor[1] + 1, actor[2] + 1)
    if op.matmuls is not None and "batch_invariant" in name:
        # the log-probs' tiles never leave the chip (``_expected_head_logprobs``), then the
        # loss over [B, T]
        return {"actor": (0, 0, 0), "masked": (0, 0, 0), "chunk": (0, 0, 0)}, {}, 0.0
    if op.matmuls is not None:
        rows = {"actor": (0, 0, 0), "masked": (0, 0, 0), "chunk": actor}
        formed = 1 if single_pass else 2        # GGPO forms each chunk twice
        # dhidden = dlogits W (one read of the chunk), dweight += dlogits^T h accumulated in
        # fp32 (here: the chunk cast to fp32, one read and two rows' bytes written, which
        # addmm_ reads; on CUDA one matmul of the bf16 chunk with an fp32 output)
        return rows, {"linear": (0, formed), "matmul": (1, 0), "to": (1, 2),
                      "addmm_": (2, 0)}, 0.0
    rows = {"actor": actor, "masked": (0, 0, writes)}
    window_rows = 1.0
    if "offset" in name or "packed" in name:   # the rows outside the window: zeros written
        rows["outside"] = (0, 0, writes)
        window_rows = (traffic.TRAFFIC_T + 2) / traffic.TRAFFIC_T
    if mode == "fwd" or "inplace" in name:
        window_rows = 0.0
    return rows, {}, window_rows


def _expected_head_logprobs(name, mode):
    """A head's log-probs and entropies over every row of the window (no mask: per actor row,
    ``rows`` chunk rows). The default head: torch's linear forms each chunk (again in the
    backward), the row kernel reads it (its target once more) and the backward's writes its
    gradient in place, read by the two products. The batch-invariant head reads and writes no
    row of logits, forward or backward, and allocates none (its tiles never leave the
    chip)."""
    def rows(x):
        return x.mask.numel() / float(x.mask.sum())

    def times(counts):
        return lambda x: tuple(rows(x) * c for c in counts)

    if name.endswith("invariant"):
        return {"actor": (0, 0, 0), "masked": (0, 0, 0), "chunk": (0, 0, 0)}, {}, 0.0
    target = 1 / V
    if mode == "fwd":
        return ({"actor": (0, 0, 0), "masked": (0, 0, 0), "chunk": times((1 + target, 1, 0))},
                {"linear": (0, rows)}, 0.0)
    return ({"actor": (0, 0, 0), "masked": (0, 0, 0), "chunk": times((2 + target, 2, 1))},
            {"linear": (0, lambda x: 2 * rows(x)), "matmul": (rows, 0),
             "to": (rows, lambda x: 2 * rows(x)), "addmm_": (lambda x: 2 * rows(x), 0)}, 0.0)


def _expected_distill(name, op, mode):
    """Distillation, both models' rows counted: the forward reads each model's row twice (its
    max and log-sum, then the divergence's terms), the backward each once and writes the
    student's gradient once (zeros at a masked row); the loss from logits does both in one
    launch (a row's 6 reads of 2 distinct rows). From heads (the loss's single pass) each
    model's chunk is formed once by a matmul, reduced, the student's gradient written into its
    chunk after the divergence and read by the two products; two batch-invariant heads read
    and write no row of either model's logits, and allocate none (their tiles never leave the
    chip)."""
    if name.endswith("invariant"):
        return {"actor": (0, 0, 0), "masked": (0, 0, 0), "chunk": (0, 0, 0)}, {}, 0.0
    fwd, bwd = (4, 2, 0), (2, 2, 1)
    if name == "distill_logits" and mode == "fwd+bwd":
        return {"actor": (6, 2, 1), "masked": (0, 0, 1)}, {}, 1.0
    if op.matmuls is not None:
        chunk = tuple(a + b for a, b in zip(fwd, bwd))
        # each model's chunk formed in fp32 once (here the inputs cast, a matmul writing two
        # rows' bytes; on CUDA one matmul with an fp32 output), dhidden's matmul reads the
        # student's gradient cast to the head's dtype (two rows' bytes read, one written), the
        # weight's addmm_ that cast again to fp32 (on CUDA: an fp32 output instead)
        return ({"actor": (0, 0, 0), "masked": (0, 0, 0), "chunk": chunk},
                {"matmul": (1, 2 * 2), "to": (2 + 1, 1 + 2), "addmm_": (2, 0)}, 0.0)
    actor = {"fwd": fwd, "bwd": bwd, "fwd+bwd": tuple(a + b for a, b in zip(fwd, bwd))}[mode]
    writes = 0 if mode == "fwd" else 1
    return {"actor": actor, "masked": (0, 0, writes)}, {}, float(writes)


def _expected_top_k(op, mode):
    """A teacher's top-k (the student's rows only): the forward reads each actor row once
    (``token_logprobs``' kernel, its first id's logit once more) and torch gathers the k logits
    at the ids; the backward reads each row once and writes it once (zeros at a masked row),
    then adds the k terms at the ids. From a head, the student's chunk is formed twice in fp32
    (its k logits gathered and added to in fp32: two bf16 rows' bytes per logit) and read by
    the two products, as the other heads'."""
    fwd, bwd = (1 + 1 / V, 1, 0), (1, 1, 1)
    k = distill_cases.TOP_K / V     # the k ids' share of a row
    if op.matmuls is not None:
        return ({"actor": (0, 0, 0), "masked": (0, 0, 0),
                 "chunk": tuple(a + b for a, b in zip(fwd, bwd))},
                {"matmul": (1, 2 * 2), "gather": (2 * k, 0), "scatter_add_": (2 * k, 2 * k),
                 "to": (2 + 1, 1 + 2), "addmm_": (2, 0)}, 0.0)

    def per_actor(share):   # torch's ops run over every row of the window
        return lambda x: share * x.mask.numel() / float(x.mask.sum())

    actor = {"fwd": fwd, "bwd": bwd, "fwd+bwd": tuple(a + b for a, b in zip(fwd, bwd))}[mode]
    writes = 0 if mode == "fwd" else 1
    torch_ops = {"gather": (per_actor(k), per_actor(0))} if mode != "bwd" else {}
    if mode != "fwd":
        torch_ops["scatter_add_"] = (per_actor(k), per_actor(k))
    return {"actor": actor, "masked": (0, 0, writes)}, torch_ops, float(writes)


CASES = [(name, mode) for name, op in traffic.cases().items() for mode in traffic.modes_of(op)]


@pytest.fixture(scope="module")
def inputs():
    return {True: traffic.traffic_inputs(V, torch.bfloat16),
            False: traffic.traffic_inputs(None, torch.float32)}


@pytest.mark.parametrize("name,mode", CASES, ids=[f"{n}-{m}" for n, m in CASES])
def test_bytes_per_row_are_pinned(inputs, name, mode):
    op = traffic.cases()[name]
    x = inputs[op.from_logits]
    measured = traffic.run_case(op, x, mode)
    rows, torch_ops, allocated = _expected(name, op, mode)
    assert set(measured.per_row) == set(rows)
    for row, expected in rows.items():
        expected = expected(x) if callable(expected) else expected
        assert measured.per_row[row] == pytest.approx(expected, rel=1e-12, abs=1e-12), row
    ops = {}
    for torch_op, read, written in measured.passes:
        r, w = ops.get(torch_op, (0.0, 0.0))
        ops[torch_op] = (r + read, w + written)
    actor = int(x.mask.sum())
    assert set(ops) == set(torch_ops)
    for torch_op, (read, written) in ops.items():
        expected = tuple(e(x) if callable(e) else e for e in torch_ops[torch_op])
        assert (read / actor, written / actor) == pytest.approx(expected), torch_op
    window = x.shape.batch * x.shape.T
    if callable(allocated):
        allocated = allocated(x)
    assert sum(r for _, r in measured.allocations) / window == pytest.approx(allocated)
    floor = traffic.floor_of(op, mode)
    if floor is not None and rows and "upstream" not in name:
        # at the floor: every distinct read and every write is one the floor counts
        assert rows["actor"][1:] == floor[:2]


@pytest.mark.parametrize("name", ["token_logprobs", "gppo_logits", "ggpo", "gr_opd"])
def test_side_data_does_not_grow_with_the_vocabulary(name):
    """The bytes outside the rows of logits are the [B, T] data: the same at any V."""
    op = traffic.cases()[name]
    side = []
    for vocab in (1001, 9001):
        x = traffic.traffic_inputs(vocab if op.from_logits else None, torch.bfloat16)
        side.append(traffic.run_case(op, x, "fwd+bwd").side_bytes_per_token)
    assert side[0] == side[1]
    assert 0 < side[0] < 64


def test_fp32_logits_count_the_same_rows():
    x = traffic.traffic_inputs(V, torch.float32)
    for name, expected in (("token_logprobs", (2 + 1 / V, 2, 1)), ("ppo_logits", (2 + 1 / V, 1, 1))):
        measured = traffic.run_case(traffic.cases()[name], x, "fwd+bwd")
        assert measured.per_row["actor"] == pytest.approx(expected, rel=1e-12)
        assert measured.per_row["masked"] == (0, 0, 1)


def test_a_torch_pass_over_the_logits_is_seen():
    """The dispatch mode catches what the kernels do not do: an extra softmax outside them."""
    x = traffic.traffic_inputs(1001, torch.bfloat16)
    geometry = traffic.Geometry(B=x.shape.batch, S=x.shape.T, T=x.shape.T, V=1001, offset=0,
                                mask=x.mask, element_size=2)
    measured = traffic.measure_case(lambda: torch.log_softmax(x.logits.float(), -1), geometry)
    names = [name for name, _, _ in measured.passes]
    assert "_log_softmax" in names and "_to_copy" in names
    assert measured.per_row == {"actor": (0, 0, 0), "masked": (0, 0, 0)}


def test_a_tile_of_the_vocabulary_is_logits_beside_a_head():
    """Beside a head whose peer forms its logits in tiles of the vocabulary, a ``[R, tile]``
    tensor (and the last, narrower one) is logits; the head's weight or its slices are not,
    nor is a tile without the peer's width."""
    geometry = traffic.Geometry(B=2, S=3, T=3, V=2 * 64 + 5, offset=0,
                                mask=torch.ones(2, 3, dtype=torch.bool), element_size=4,
                                hidden=24, tile=64)
    assert geometry.is_logits(torch.empty(6, 64)) and geometry.is_logits(torch.empty(6, 5))
    assert not geometry.is_logits(torch.empty(64, 24)) and not geometry.is_logits(
        torch.empty(133, 24))
    assert not geometry.is_logits(torch.empty(6, 63))
    assert not dataclasses.replace(geometry, tile=0).is_logits(torch.empty(6, 64))


def test_a_peer_head_in_vocabulary_tiles_is_counted():
    """Liger's fused-linear GRPO loss forms its logits in tiles of the vocabulary, in torch:
    over a vocabulary of two tiles and a narrower one, each row's logits formed forward and
    backward (2 rows written at least, and read), rlfuse's head reading fewer in all."""
    pytest.importorskip("liger_kernel")
    from bench import cases

    op = cases.OPS["ppo_head"]
    tile = cases.vocab_tile(op, "liger")
    assert tile > 0 and cases.vocab_tile(op, "fused") == 0
    x = traffic.traffic_inputs(2 * tile + 100, torch.float32)
    actor = int(x.mask.sum())
    peer = traffic.run_case(op, x, "fwd+bwd", "liger")
    read, written = (sum(p[i] for p in peer.passes) / actor for i in (1, 2))
    assert read >= 2 and written >= 2
    ours = traffic.run_case(op, x, "fwd+bwd")
    assert ours.per_row["chunk"][1] + sum(p[1] for p in ours.passes) / actor < read


def test_the_cli_writes_the_table(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{traffic.MARK_BEGIN}\nSTALE\n{traffic.MARK_END}\nafter\n")
    assert traffic.main(["--V", "1001", "--op", "token_logprobs", "--op", "ppo_logits",
                         "--out", str(tmp_path), "--readme", str(readme)]) == 0
    table = (tmp_path / "traffic.md").read_text()
    text = readme.read_text()
    assert text.startswith(f"before\n{traffic.MARK_BEGIN}\n" + table) and "STALE" not in text
    assert text.endswith(f"{traffic.MARK_END}\nafter\n")
    assert "| token_logprobs | fwd+bwd | 2.00 / 1.00 | 2 / 1 |" in table
    assert "| ppo_logits | fwd+bwd | 2.00 (1.00) / 1.00 | 1 / 1 |" in table
    assert "gppo_logits, full output + offset" not in table


def test_the_counter_refuses_poisoned_outputs(monkeypatch):
    from rlfuse.kernels.lib import utils

    monkeypatch.setattr(utils, "OUTPUT_FILL", float("nan"))
    geometry = traffic.Geometry(B=1, S=1, T=1, V=V, offset=0, mask=torch.ones(1, 1, dtype=bool),
                                element_size=2)
    with pytest.raises(RuntimeError, match="OUTPUT_FILL"):
        traffic.measure_case(lambda: None, geometry)


def test_row_of_ignores_addresses_outside_the_tensor():
    t = torch.zeros(2, 3, V)[:, 1:]
    base = t.data_ptr()
    # before the view, its first row, that row's last element, its second row, the storage row
    # between the two batches (not the view's), the second batch's first row
    addresses = base + 4 * np.array([-1, 0, V - 1, V, 2 * V, 3 * V])
    inside, index = traffic._row_of(t, addresses, 4)
    assert inside.tolist() == [False, True, True, True, False, True]
    assert [i.tolist() for i in index] == [[0, 0, 0, 1], [0, 0, 1, 0]]


def test_vocab_parallel_communication_is_computed_per_rank():
    """The volume `python -m tools.traffic --comm` prints: the forward's all-gather of 4 fp32 per row
    to every other rank, the LinearHead backward's ring all-reduce of [N, H] in fp32."""
    from rlfuse.scaleout.vocab import SHARD_COLUMNS

    logits, head = traffic.communication(N=1000, V=64, H=16, world=4, element_size=2)
    assert len(SHARD_COLUMNS) == 4
    assert logits["forward"] == head["forward"] == 3 * 1000 * 4 * 4
    assert logits["backward"] == 0 and head["backward"] == 2 * 3 * 1000 * 16 * 4 // 4
    assert logits["logits_shard"] == 1000 * 16 * 2
    table = traffic.communication_table(1000, 64, 16, 2, worlds=(4,))
    assert "| 4 | LinearHead | 0.05 MiB | 0.09 MiB | 0.03 MiB | 450.00% |" in table


def test_default_single_pass_keeps_its_rows_in_flight_within_the_l2():
    """The model of the single pass's rows in flight (``traffic.rows_in_flight``): one program
    per row holds an SM's 4 programs of 16 warps in flight, 153 MiB on an H200 at the headline,
    beyond its L2, so the second read comes from HBM (at most 2/3 of the floor); the default,
    sized from the L2, holds one an SM there (38 MiB) and a bf16 row of every benchmark
    vocabulary within the L2 of every GPU of the model. An fp32 row of 151936 (608 KB) does not
    fit even one an SM: there the default can only hold the fewest."""
    from rlfuse.kernels.rows.single_pass import L2_BUDGET, parse
    from tools.gpus import GPUS

    h200 = next(gpu for gpu in GPUS if gpu.name == "H200")
    per_row = traffic.rows_in_flight(parse("programs_per_sm=none"), 151936, 2, h200)
    assert (per_row["programs_per_sm"], per_row["bytes_in_flight"]) == (4, 4 * 132 * 303872)
    assert per_row["hbm_reads"] == 2 and per_row["floor_fraction_bound"] == pytest.approx(2 / 3)
    for gpu in GPUS:
        for V, element_size in traffic.L2_SHAPES:
            model = traffic.rows_in_flight(parse("default"), V, element_size, gpu)
            fits_one = gpu.sms * V * element_size <= L2_BUDGET * gpu.l2_mib * 2 ** 20
            assert model["programs_per_sm"] >= 1
            assert (model["hbm_reads"] == 1) == (element_size == 2), (gpu.name, V)
            if fits_one:   # within the budget, and no fewer programs than fit
                assert model["bytes_in_flight"] <= L2_BUDGET * model["l2_bytes"]
                more = (model["programs_per_sm"] + 1) * gpu.sms * V * element_size
                assert more > L2_BUDGET * model["l2_bytes"] or model["programs_per_sm"] == 4
            else:
                assert model["programs_per_sm"] == 1
    table = traffic.l2_table(["default", "programs_per_sm=none"])
    assert "| H200 | 151936 | 2 | default | 1 | 0.29 MiB | 38 MiB | 50 MiB | L2 | 100% |" in table
