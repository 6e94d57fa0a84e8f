"""The GPU check (``bench/gpu_check.sh``) dry-run on the CPU (``GPU_CHECK_CPU=1``: the
interpreter, tiny shapes, no warm-up and no installs) with the packages of a GPU machine's own
Python: every phase runs within its budget and ``$OUT`` holds the run's files, at most 8; the
per-test time limit the check sets fails a test that overruns, and the run goes on."""
import json
import subprocess
import sys

from conftest import ROOT, process_env
FILES = {"bench.txt", "pytest.txt", "sweep.json", "sweep.md"}


# A GPU machine's Python has torch, triton, numpy, pytest, hypothesis and transformers, and TRL
# and Liger-Kernel installed without their dependencies: the dry run hides the rest (TRL's
# trainers then fail to import, for want of pandas or datasets; its kernels load alone).
HIDDEN = ("pandas", "matplotlib", "datasets", "accelerate", "peft", "verl", "deepspeed",
          "megatron", "tensordict", "ray")


def test_dry_run_writes_its_files(tmp_path):
    """The whole check on the CPU, with the GPU machine's packages: the gpu-marked tests of
    every test module are collected (none errors: a module whose integration does not import
    is skipped), TRL's and Liger's rows are measured beside rlfuse's, and the run delivers its
    files."""
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    for name in HIDDEN:
        (hidden / f"{name}.py").write_text(
            f"raise ModuleNotFoundError('{name}: hidden by the dry run')\n")
    out = tmp_path / "out"
    out.mkdir()
    env = process_env(
        hidden, ROOT, GPU_CHECK_CPU="1", OUT=str(out), PYTHON=sys.executable,
        drop=("RLFUSE_REQUIRE_INTEGRATIONS",),   # a missing package skips its module
        RLFUSE_COMMIT="dryrun", GPU_TESTS="tests")
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
    for phase in ("environment", "pytest -m gpu", "python -m bench --headline",
                  "vocabulary split", "python -m bench.sweep", f"done: {len(names)} files",
                  "exit codes: bench 0, gpu tests 0, GPU-math tests 0, sweep 0"):
        assert phase in text, phase
    assert text.count("matplotlib is not installed") == 1
    results = json.loads((out / "cpu-dryrun.json").read_text())
    assert results["header"]["missing_impls"] == {} and results["header"]["errors"] == []
    ops = [r["op"] for r in results["rows"]]
    assert ops[0] == "token_logprobs" and {"gppo_logits", "gppo_head", "ppo_head"} <= set(ops)
    measured = {(r["op"], r["impl"]) for r in results["rows"]}
    assert {("ppo_head", "trl"), ("token_logprobs", "trl"), ("ppo_head", "liger"),
            ("gppo_logits", "liger")} <= measured, measured
    assert {r["mode"] for r in results["rows"]} == {"fwd", "fwd+bwd"}
    assert {r["N"] for r in results["rows"]} == {16} and results["header"]["head_gemms_ms"]
    sweep = json.loads((out / "sweep.json").read_text())
    assert not sweep["failed"] and len(sweep["cases"][0]["ranking"]) == 2
    pytest_log = (out / "pytest.txt").read_text()
    assert "SKIPPED" in pytest_log and "2 passed" in pytest_log     # gpu: skipped; cuda: ran
    assert "ERROR" not in pytest_log and "during collection" not in pytest_log, pytest_log[-3000:]
    assert "needs rlfuse.integrations.trl" in pytest_log, pytest_log[-3000:]
    for name in ("datasets", "verl", "megatron"):
        assert f"{name}: hidden by the dry run" in pytest_log, (name, pytest_log[-3000:])


def test_a_phase_past_its_time_still_prints_its_summary(tmp_path):
    """A test phase that reaches its time is interrupted (SIGINT), not killed: pytest still
    prints the tests that ended and its summary, and the check goes on to its next phase."""
    tests = tmp_path / "test_phase.py"
    tests.write_text("import time\n\ndef test_fast():\n    pass\n\n"
                     "def test_hangs():\n    time.sleep(600)\n")
    out = tmp_path / "out"
    out.mkdir()
    env = process_env(
        ROOT, GPU_CHECK_CPU="1", OUT=str(out), PYTHON=sys.executable, RLFUSE_COMMIT="cut",
        GPU_TESTS=str(tests), CUDA_TESTS=str(tests), CUDA_TESTS_S="15", TEST_TIMEOUT="0",
        BENCH_ARGS="--quick --N 16 --V 300 --impls fused --cpu-reps 1 --op token_logprobs "
                   "--mode fwd",
        SWEEP_CONFIGS="default")
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    pytest_log = (out / "pytest.txt").read_text()
    assert "test_phase.py::test_fast PASSED" in pytest_log, pytest_log
    assert "KeyboardInterrupt" in pytest_log and "1 passed" in pytest_log, pytest_log
    text = (out / "bench.txt").read_text()
    # gpu: no test of the file is gpu-marked (5: none collected); cuda: stopped at its time
    assert "pytest exit codes: gpu 5, cuda 124" in text, text[-2000:]
    assert "sweep exit code: 0" in text and "done:" in text


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
