"""The GPU check (``bench/gpu_check.sh``) dry-run on the CPU (``GPU_CHECK_CPU=1``: the
interpreter, tiny shapes, no warm-up and no installs): every phase runs within its budget and
``$OUT`` holds the run's files, at most 8 (what the device tool returns); the per-test time
limit the check sets fails a test that overruns, and the run goes on."""
import json
import os
import subprocess
import sys

from conftest import ROOT, process_env
FILES = {"bench.txt", "pytest.txt", "sweep.json", "sweep.md"}


# What a bare GPU machine lacks (it has torch, triton and pytest): the dry run hides them.
OPTIONAL = ("hypothesis", "transformers", "peft", "trl", "verl", "deepspeed", "liger_kernel",
            "tensordict", "matplotlib")


def test_dry_run_writes_its_files(tmp_path):
    """The whole check on the CPU, with the optional packages hidden: the gpu-marked tests of
    every test module are collected (none errors) and the run delivers its files."""
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    for name in OPTIONAL:
        (hidden / f"{name}.py").write_text(
            f"raise ModuleNotFoundError('{name}: hidden by the dry run')\n")
    out = tmp_path / "out"
    out.mkdir()
    env = process_env(
        hidden, ROOT, GPU_CHECK_CPU="1", OUT=str(out), PYTHON=sys.executable,
        drop=("RLFUSE_REQUIRE_INTEGRATIONS",),   # a missing package skips its module
        # hypothesis's pytest plugin, registered by the installed package, is not there
        PYTEST_ADDOPTS="-p no:hypothesispytest",
        RLFUSE_COMMIT="dryrun", GPU_TESTS="tests",
        CUDA_TESTS="tests/test_numerics.py::test_exp_accurate",
        # the headline's first ops (test_headline_cases: all of them)
        BENCH_ARGS="--quick --N 16 --V 300 --impls fused,reference --cpu-reps 1 "
                   "--op token_logprobs,gppo_logits,gppo_head")
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    names = {p.name for p in out.iterdir()}
    assert all(p.is_file() for p in out.iterdir())
    plot = set()   # matplotlib hidden: no plot
    assert names == FILES | {"cpu-dryrun.json", "cpu-dryrun.md"} | plot, names
    assert len(names) <= 8
    text = (out / "bench.txt").read_text()
    for phase in ("environment", "pytest -v -m gpu", "python -m bench --headline",
                  "vocabulary split", "python -m bench.sweep", f"done: {len(names)} files"):
        assert phase in text, phase
    assert "pytest exit codes: gpu 0, cuda 0" in text and "bench exit code: 0" in text
    results = json.loads((out / "cpu-dryrun.json").read_text())
    ops = [r["op"] for r in results["rows"]]
    assert ops[0] == "token_logprobs" and {"gppo_logits", "gppo_head"} <= set(ops)
    assert {r["mode"] for r in results["rows"]} == {"fwd", "fwd+bwd"}
    assert {r["N"] for r in results["rows"]} == {16} and results["header"]["head_gemms_ms"]
    sweep = json.loads((out / "sweep.json").read_text())
    assert not sweep["failed"] and len(sweep["cases"][0]["ranking"]) == 2
    pytest_log = (out / "pytest.txt").read_text()
    assert "SKIPPED" in pytest_log and "2 passed" in pytest_log     # gpu: skipped; cuda: ran
    assert "ERROR" not in pytest_log and "during collection" not in pytest_log, pytest_log[-3000:]
    for name in ("hypothesis", "trl", "verl", "transformers", "liger_kernel"):
        assert f"{name}: hidden by the dry run" in pytest_log, (name, pytest_log[-3000:])


def test_a_test_past_its_time_limit_fails(tmp_path):
    (tmp_path / "test_slow.py").write_text(
        "import time\n\ndef test_slow():\n    time.sleep(30)\n\ndef test_fast():\n    pass\n")
    # the suite's conftest as a plugin (its time_limit fixture), imported from its folder
    env = process_env(ROOT / "tests", ROOT, RLFUSE_TEST_TIMEOUT="2", TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "conftest", str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert "RLFUSE_TEST_TIMEOUT=2" in proc.stdout and "1 failed, 1 passed" in proc.stdout


def test_headline_cases():
    """``python -m bench --headline``: N 16384, V 151936, bf16, fwd and fwd+bwd, every op on
    logits or a LinearHead, token_logprobs, gppo_logits and gppo_head first."""
    import torch

    from bench import __main__ as bench_main, cases

    args = bench_main.parse_args(["--headline"])
    assert (args.N, args.V, args.dtype, args.mode) == ([16384], [151936], [torch.bfloat16],
                                                       ["fwd", "fwd+bwd"])
    assert args.op[:3] == ["token_logprobs", "gppo_logits", "gppo_head"]
    assert sorted(args.op) == sorted(n for n, op in cases.OPS.items() if op.from_logits)
    assert bench_main.parse_args(["--headline", "--N", "4096"]).N == [4096]
