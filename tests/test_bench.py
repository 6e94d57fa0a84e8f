"""The benchmark: ``python -m bench --quick`` runs every op of the registry through fused and
reference in every mode and writes a results JSON of the documented schema, which the report
renders; the performance page's table is only ever filled from GPU results; the floors' byte
and FLOP arithmetic."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rlfuse
from bench import cases, report
from conftest import TOL

ROOT = Path(__file__).resolve().parent.parent

HEADER_KEYS = {"gpu", "torch", "triton", "commit", "date", "copy_bandwidth_GBps", "missing_impls",
               "head_gemms_ms"}
ROW_KEYS = {"op", "impl", "mode", "dtype", "N", "V", "ms", "ms_p20", "ms_p80", "peak_mem_bytes",
            "floor_ms", "fraction_of_floor", "bytes", "flops", "actor_rows", "floor_ms_dense",
            "fraction_of_floor_dense", "bytes_dense", "GBps", "TFLOPs"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ)
    env.pop("OUT", None)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--impls", "fused,reference", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(out.glob("*.json"))
    assert len(files) == 1, files
    return files[0], json.loads(files[0].read_text())


def test_results_schema(quick_run):
    _, results = quick_run
    header, rows = results["header"], results["rows"]
    assert HEADER_KEYS <= set(header), HEADER_KEYS - set(header)
    assert header["errors"] == [] and not header["truncated"]
    assert header["copy_bandwidth_GBps"] > 0
    for row in rows:
        assert set(row) == ROW_KEYS, set(row) ^ ROW_KEYS
        assert row["ms"] > 0 and row["bytes"] > 0 and row["floor_ms"] > 0
        assert row["ms_p20"] <= row["ms"] <= row["ms_p80"]
        assert row["fraction_of_floor"] == pytest.approx(row["floor_ms"] / row["ms"])
        assert row["fraction_of_floor_dense"] == pytest.approx(row["floor_ms_dense"] / row["ms"])
        assert row["GBps"] == pytest.approx(row["bytes"] / row["ms"] / 1e6)
        head = cases.OPS[row["op"]].matmuls is not None
        assert (row["TFLOPs"] is not None) == head
        if head:     # the floor: the plain GEMMs of the same shapes, timed in the run
            assert row["TFLOPs"] == pytest.approx(row["flops"] / row["ms"] / 1e9)
            gemm = f"{row['actor_rows']}x{cases.QUICK_HIDDEN}x{row['V']} {row['dtype']}"
            matmuls = cases.OPS[row["op"]].matmuls[row["mode"]]    # of the three timed
            assert row["floor_ms"] == pytest.approx(header["head_gemms_ms"][gemm] * matmuls / 3)
        # masked rows: read by no op; the dense floor counts them as actor rows
        assert 0 < row["actor_rows"] < row["N"]
        logits = cases.OPS[row["op"]].floor[row["mode"]][0] > 0 and row["V"] is not None
        assert (row["bytes"] < row["bytes_dense"]) == logits
        assert (row["V"] is None) == (not cases.OPS[row["op"]].from_logits)
        assert isinstance(row["peak_mem_bytes"], int) and row["peak_mem_bytes"] >= 0
    for op in cases.OPS:
        for impl in ("fused", "reference"):
            modes = {r["mode"] for r in rows if r["op"] == op and r["impl"] == impl}
            assert modes == set(cases.modes_for(cases.OPS[op], impl)), (op, impl, modes)


def test_report_renders(quick_run, tmp_path):
    path, results = quick_run
    md = report.markdown(results)
    for op in cases.OPS:
        assert f"| {op} |" in md
    assert "fused vs reference" in md and "fused % of floor" in md
    report.render(results, tmp_path / path.stem)
    assert (tmp_path / (path.stem + ".md")).read_text() == md


def test_readme_only_from_gpu_results(quick_run, tmp_path):
    path, results = quick_run
    readme = tmp_path / "README.md"
    text = f"intro\n{report.MARK_BEGIN}\nold table\n{report.MARK_END}\nrest\n"
    readme.write_text(text)
    results_dir = tmp_path / "results"
    results_dir.mkdir()
    (results_dir / path.name).write_text(json.dumps(results))
    if results["header"]["device"] != "cuda":   # CPU results never reach the README
        assert not report.update_readme(readme, results_dir)
        assert readme.read_text() == text
    gpu = dict(results, header=dict(results["header"], device="cuda", gpu="Fake GPU",
                                    date="2999-01-01T00:00:00+00:00"))
    (results_dir / "fake-gpu.json").write_text(json.dumps(gpu))
    assert report.update_readme(readme, results_dir)
    new = readme.read_text()
    assert new.startswith(f"intro\n{report.MARK_BEGIN}\n")
    assert new.endswith(f"{report.MARK_END}\nrest\n")
    assert "old table" not in new and "Fake GPU" in new and "fake-gpu.json" in new
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match="markers"):
        report.update_readme(readme, results_dir)


def test_peak_memory_on_the_cpu():
    """The CPU's peak from the profiler's allocations: 4 MB and 1 MB alive together, then the
    4 MB freed before 2 MB more: the peak is 5 MB; a tensor from before the step is not
    counted."""
    from bench import measure

    before = torch.empty(3_000_000, dtype=torch.uint8)

    def step():
        a = torch.empty(4_000_000, dtype=torch.uint8)
        b = torch.empty(1_000_000, dtype=torch.uint8)
        del a
        c = torch.empty(2_000_000, dtype=torch.uint8)
        return b, c

    peak = measure.peak_memory(step, torch.device("cpu"))
    assert 5_000_000 <= peak < 5_000_000 + 4096, peak
    assert before.numel()


def test_floor_bytes_and_flops():
    """``Op.bytes`` counts each actor row read as often as the floor says and every row written,
    plus the [B, T] side data; ``Op.flops`` the LinearHead ops' matmuls over the actor rows.
    (That each op's kernels move exactly its floor is measured by ``test_traffic.py``.)"""
    for name, op in cases.OPS.items():
        if op.matmuls is not None:       # LinearHead: no logits in memory, a compute floor
            assert all(op.floor[mode][:2] == (0, 0) for mode in op.modes), name
            # logits, dhidden, dweight; distillation the teacher's logits besides (a teacher's
            # top-k has none); the log-probs' forward alone: the logits
            teacher_head = name.startswith("distill") and "top_k" not in name
            expected = {"fwd": 1, "fwd+bwd": 4 if teacher_head else 3}
            assert op.matmuls == {mode: expected[mode] for mode in op.modes}, name
            assert op.modes == (("fwd", "fwd+bwd") if name.startswith("logprobs_head")
                                else ("fwd+bwd",)), name
    shape = cases.Shape(N=16, V=1000, dtype=torch.bfloat16, batch=8, group_size=4, hidden=32)
    per_token = 2 * (cases.TGT + cases.MSK) + 4 * cases.F32
    assert cases.OPS["token_logprobs"].bytes(shape, "fwd+bwd") == 3 * 16 * 1000 * 2 + per_token * 16
    # per actor row: 12 actor rows read twice, all 16 rows written once
    assert cases.OPS["token_logprobs"].bytes(shape, "fwd+bwd", 12) == \
        (2 * 12 + 16) * 1000 * 2 + per_token * 16
    assert cases.OPS["gppo_head"].flops(shape, "fwd+bwd", 12) == 3 * 2 * 12 * 32 * 1000
    assert cases.OPS["token_logprobs"].flops(shape, "fwd+bwd") is None
    assert cases.OPS["gppo_head"].flops(shape, "fwd+bwd") == 3 * 2 * 16 * 32 * 1000
    assert {"ggpo_head", "gppo_head", "gr_opd_head", "ppo_head"} <= set(cases.OPS)


def test_a_peer_that_fails_to_load_leaves_a_note(monkeypatch):
    """Any exception loading a peer (not only ImportError): the header says why it is
    unavailable, the summary line shows it, and the other implementations' rows are measured."""
    from bench import __main__ as bench_main

    real = cases.load_impl

    def load(name):
        if name == "liger":
            raise RuntimeError("CUDA driver too old")
        return real(name)

    monkeypatch.setattr(cases, "load_impl", load)
    args = bench_main.parse_args(["--quick", "--N", "16", "--V", "300", "--op", "token_logprobs",
                                  "--impls", "fused,liger", "--cpu-reps", "1"])
    results = bench_main.run(args)
    assert results["header"]["missing_impls"] == {"liger": "RuntimeError: CUDA driver too old"}
    assert "unavailable: liger (RuntimeError: CUDA driver too old)" in report.summary_line(
        results["header"])
    assert {r["impl"] for r in results["rows"]} == {"fused"} and results["rows"]


def test_a_run_stopped_after_a_case_leaves_its_files(tmp_path, monkeypatch):
    """The JSON and the report are rewritten after every case: a run stopped from outside (the
    GPU check's timeout) leaves both with the rows measured so far."""
    from bench import __main__ as bench_main

    real, calls = bench_main.run, []

    def stopped(args, checkpoint=None):
        def save(results):
            checkpoint(results)
            calls.append(len(results["rows"]))
            if results["rows"]:
                raise TimeoutError("stopped from outside")
        return real(args, checkpoint=save)

    monkeypatch.setattr(bench_main, "run", stopped)
    with pytest.raises(TimeoutError):
        bench_main.main(["--quick", "--N", "16", "--V", "300", "--op", "token_logprobs,gppo",
                         "--impls", "fused", "--cpu-reps", "1", "--out", str(tmp_path),
                         "--commit", "stopped"])
    results = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert calls[0] == 0 and 0 < len(results["rows"]) == calls[-1]
    md = next(tmp_path.glob("*.md")).read_text()
    assert all(row["op"] in md for row in results["rows"])


def _beside_trl(name, seed, step):
    """``{impl: step(outputs, leaves)}`` of the fused ``name`` and its TRL peer on one fp32
    batch."""
    trl_module = pytest.importorskip(cases.TRL_MODULE)
    shape = next(s for s in cases.make_shapes(quick=True)
                 if s.V is not None and s.dtype == torch.float32)
    x = cases.make_inputs(shape, "cpu", seed=seed)
    return {impl: step(*cases.forward_fn(cases.OPS[name], impl, lib, x)())
            for impl, lib in (("fused", rlfuse), ("trl", trl_module))}


@pytest.mark.parametrize("name", ["ggpo_head", "gppo_head", "gr_opd_head", "ppo_head"])
def test_trl_chunked_head_peer_does_rlfuse_work(name):
    """The TRL peer of the LinearHead ops (TRL 1.16's ChunkedLogProbFunction as its trainer
    calls it, then the loss on the [B, T] log-probs) gives rlfuse's loss and gradients of the
    hidden states and the weight: fp32, the two differ in summation order only (a few ulps of
    each gradient's scale: the weight's gradient sums over every token)."""
    from conftest import PEER_GRAD_RTOL

    outputs = _beside_trl(name, 3, lambda out, leaves: (
        out[0].detach(), torch.autograd.grad(out[0], leaves)))
    (ours, ours_grads), (theirs, their_grads) = outputs["fused"], outputs["trl"]
    assert abs(ours.item() - theirs.item()) <= 1e-5 * max(1.0, abs(theirs.item()))
    for what, a, b in zip(("dhidden", "dweight"), ours_grads, their_grads):
        scale = b.abs().max().item()
        assert scale > 0, what
        assert (a - b).abs().max().item() <= 4 * PEER_GRAD_RTOL[torch.float32] * scale, what


@pytest.mark.parametrize("name", ["token_logprobs", "token_logprobs_entropy"])
def test_trl_logprobs_peer_does_rlfuse_work(name):
    """The TRL peer of the log-prob ops (TRL 1.16's Triton ``selective_log_softmax_and_entropy``
    over the same logits, in the interpreter): rlfuse's log-probs (and entropies) and their
    gradient to the logits, fp32, to a few ulps (masked rows: 0 in both)."""
    def step(out, leaves):
        upstream = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i))
                    for i, o in enumerate(out)]
        return [o.detach() for o in out], torch.autograd.grad(out, leaves, upstream)[0]

    outputs = _beside_trl(name, 4, step)
    (ours, ours_grad), (theirs, their_grad) = outputs["fused"], outputs["trl"]
    assert len(ours) == len(theirs) == (2 if name.endswith("entropy") else 1)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, **TOL["fp32_logprob"])
    torch.testing.assert_close(ours_grad, their_grad, **TOL["fp32_grad"])


def test_cpu_peak_memory_is_the_steps_own():
    """What an earlier measured step left alive is not this step's: the profiler's running
    total carries it from one profile to the next."""
    from bench import measure

    cpu, kept = torch.device("cpu"), []
    measure.peak_memory(lambda: kept.append(torch.ones(1 << 22)), cpu)      # 16 MiB, kept
    assert measure.peak_memory(lambda: torch.empty(1 << 18).fill_(1), cpu) == 1 << 20


def test_memory_mode_measures_peak_memory_side_by_side(tmp_path):
    """``--memory``: one untimed step per case, its peak memory, with every implementation of
    the head ops side by side (TRL's chunked head included when installed); the report renders
    the peaks and no times."""
    from bench import __main__ as bench_main

    pytest.importorskip(cases.TRL_MODULE)
    args = bench_main.parse_args(["--quick", "--N", "16", "--V", "300", "--op", "ppo_head",
                                  "--impls", "fused,reference,trl", "--memory", "--dtype",
                                  "fp32", "--out", str(tmp_path)])
    results = bench_main.run(args)
    assert results["header"]["errors"] == [] and results["header"]["timing"].startswith("none")
    rows = {r["impl"]: r for r in results["rows"]}
    assert set(rows) == {"fused", "reference", "trl"}
    for row in rows.values():
        assert row["ms"] is None and row["peak_mem_bytes"] > 0
    # the reference forms the whole [N, V] logits (fp32) and their gradient; the others chunks
    assert rows["reference"]["peak_mem_bytes"] >= 16 * 300 * 4
    table = report.markdown(results)
    assert "peak MiB trl" in table and "fused vs trl" in table


@pytest.mark.parametrize("missing", ["transformers,accelerate,datasets", "pandas,datasets"])
def test_trl_kernels_load_without_trls_dependencies(missing):
    """TRL installed without its dependencies, on a GPU machine with torch and triton alone
    (``transformers``, ``accelerate``, ``datasets`` unimportable) or with ``transformers``
    but not ``pandas`` nor ``datasets`` (what ``trl.trainer.utils`` imports), gives its kernels
    alone (``bench.trl_kernels``), whose values and gradients on the benchmark's inputs are the
    bits of TRL's own import (``trl_kernels_worker.py``, each in a process of its own on one
    thread: the torch ops' sums in one order)."""
    pytest.importorskip("trl")
    from conftest import process_env
    from trl_kernels_worker import OPS

    def run(*args):
        proc = subprocess.run([sys.executable, "tests/trl_kernels_worker.py", *args], cwd=ROOT,
                              env=process_env(TRITON_INTERPRET="1"), capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return json.loads(proc.stdout.splitlines()[-1])

    alone, whole = run("--missing", missing), run()
    assert sorted(alone) == sorted(whole) == sorted(OPS)
    for name in OPS:
        assert alone[name] == whole[name], name
