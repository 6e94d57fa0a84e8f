#!/usr/bin/env bash
# The GPU check: the headline benchmarks, the GPU tests and the single-pass sweep, in one
# command on any machine with a CUDA GPU, from the repo root, within CHECK_DEADLINE (340 s).
# It uses the machine's own python3 (torch and triton; pytest for the tests) as it is: what is
# missing is reported, not installed from the internet. Every phase writes its files into
# $OUT as it goes, so a check stopped at any minute leaves what it measured:
#   0. (background, from t = 0) Triton's cache warmed: python -m tools.gpu_compile --jobs J
#      compiles every kernel variant the public API launches for this GPU's arch, J processes
#      at once, the headline's own first (the same keys in Triton's cache as the headline's
#      launches: tests/test_gpu_compile.py); meanwhile the environment is recorded and rlfuse
#      (and wheels/*.whl, e.g. Liger-Kernel and TRL, without their dependencies: TRL's kernels
#      load alone where its trainers do not import, bench/trl_kernels.py) installed.
#   1. the headline benchmarks at once, beside the warm-up (python -m bench --headline:
#      N 16384, V 151936, bf16, every op on logits and on a LinearHead at H 4096; fused, eager
#      reference, Liger, TRL, then torch.compile(reference); the floor, GB/s, TFLOP/s beside the
#      plain GEMMs of the same shapes timed in the run; the files rewritten after every case),
#      within BENCH_S                 -> <gpu>-<commit>.json, .md (.png with matplotlib)
#   2. the GPU tests (-m gpu), once the warm-up has ended or WARMUP_S has passed   -> pytest.txt
#   3. the tests whose results differ on a GPU (GPU math), CUDA_TESTS               -> pytest.txt
#      (both -v, each test failed after TEST_TIMEOUT s; at its phase's end pytest is
#      interrupted, not killed, so it still prints its summary)
#   4. the bytes a vocabulary split sends (computed)                                 -> bench.txt
#   5. the single-pass sweep with what is left (python -m bench.sweep: each configuration's
#      loss and gradient checked against the default before it is timed)  -> sweep.json, .md
# The environment, the warm-up and every phase's exit code go to bench.txt: 6 or 7 files.
#
# Usage:  OUT=results/ RLFUSE_COMMIT=$(git rev-parse --short HEAD) bash bench/gpu_check.sh
# (RLFUSE_COMMIT where the copy has no .git.) Peers on a machine without internet: elsewhere,
#     pip download --no-deps trl==1.16.0 liger-kernel==0.8.5 -d wheels/
# and copy wheels/ beside bench/. Exit status 0 when every phase passed. bench/README.md.
#
# GPU_CHECK_CPU=1: a dry run on a CPU (the interpreter, tiny shapes, no warm-up and no
# installs): every phase runs and writes its files, in about a minute on 2 cores.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
CPU=${GPU_CHECK_CPU:-0}
CHECK_DEADLINE=${CHECK_DEADLINE:-340}   # seconds: no phase runs past it
WARMUP_S=${WARMUP_S:-90}                # the tests wait for the warm-up this long at most
WARMUP_JOBS=${WARMUP_JOBS:-12}
BENCH_S=${BENCH_S:-150}                 # the bench starts no case after BENCH_S - 30 s
GPU_TESTS_S=${GPU_TESTS_S:-80}
CUDA_TESTS_S=${CUDA_TESTS_S:-45}
TEST_TIMEOUT=${TEST_TIMEOUT:-30}        # seconds a test may take (tests/conftest.py)
GPU_TESTS=${GPU_TESTS:-tests}           # where the gpu-marked tests are collected
if [[ $CPU == 1 ]]; then
    export TRITON_INTERPRET=1
    BENCH_ARGS=${BENCH_ARGS:-"--quick --N 16 --V 300 --impls fused,reference,liger,trl
        --cpu-reps 1 --op token_logprobs,gppo_logits,gppo_head,ppo_head"}
    SWEEP_ARGS=${SWEEP_ARGS:-"--quick --N 16 --V 300"}
    SWEEP_CONFIGS=${SWEEP_CONFIGS:-"default evict=1,block_v=64"}
    CUDA_TESTS=${CUDA_TESTS:-"tests/test_numerics.py::test_exp_accurate"}
else
    unset TRITON_INTERPRET              # the real kernels, on the GPU
    BENCH_ARGS=${BENCH_ARGS:-"--rep-ms 50 --warmup-ms 10"}
    SWEEP_ARGS=${SWEEP_ARGS:-}
    SWEEP_CONFIGS=${SWEEP_CONFIGS:-}
    math_tests="tests/test_numerics.py tests/test_heads.py tests/test_token_logprobs.py"
    CUDA_TESTS=${CUDA_TESTS:-$math_tests}
fi
export OUT PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOG="$OUT/bench.txt"
left() { echo $((CHECK_DEADLINE - SECONDS)); }
# a phase's seconds: its own cap, or what is left before the deadline
cap() { local l; l=$(left); echo $(( $1 < l ? $1 : (l > 0 ? l : 1) )); }
phase() { echo "== [${SECONDS}s] $*" | tee -a "$LOG"; }

warmup_log=$(mktemp)
if [[ $CPU == 1 ]]; then
    warmup_pid=
else
    arch=$("$PY" -c 'import torch; a, b = torch.cuda.get_device_capability(); print(10 * a + b)')
    timeout "$WARMUP_S" "$PY" -m tools.gpu_compile --arch "$arch" --jobs "$WARMUP_JOBS" \
        > "$warmup_log" 2>&1 &
    warmup_pid=$!
fi

phase "environment"
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
        || echo "no nvidia-smi"
    "$PY" -c 'import os, sys, torch, triton; print("python", sys.version.split()[0], "torch",
        torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__,
        "cpus", os.cpu_count())'
    if [[ $CPU != 1 ]]; then
        "$PY" -m pip install --quiet --no-deps --no-build-isolation -e . \
            || echo "pip install -e . failed: using PYTHONPATH=$PWD"
        if compgen -G "wheels/*.whl" > /dev/null; then
            "$PY" -m pip install --quiet --no-deps wheels/*.whl || echo "installing wheels/ failed"
        fi
    fi
    "$PY" -m pip list 2>/dev/null \
        | grep -iE "^(liger[-_]kernel|trl|transformers|pytest|numpy|matplotlib|pandas) " || true
} 2>&1 | tee -a "$LOG"

bench_s=$(cap "$BENCH_S")
phase "python -m bench --headline (${bench_s}s)"
# The JSON is rewritten after every case: the hard timeout keeps what was measured.
# shellcheck disable=SC2086  # option lists
timeout -k 10 "$bench_s" "$PY" -m bench --headline --out "$OUT" --budget-s $((bench_s > 40 ?
    bench_s - 30 : bench_s / 2)) $BENCH_ARGS 2>&1 | tee -a "$LOG"
bench_rc=${PIPESTATUS[0]}
echo "bench exit code: $bench_rc" | tee -a "$LOG"

if [[ -n $warmup_pid ]]; then
    wait "$warmup_pid"
    phase "warm-up: tools.gpu_compile exit code $? (124: stopped at ${WARMUP_S}s)"
    tail -n 5 "$warmup_log" | tee -a "$LOG"
fi
rm -f "$warmup_log"

# The tests, each line as it ends (-v): -p no:cacheprovider writes nothing into the tree;
# RLFUSE_TEST_TIMEOUT fails a test that runs past it; at the phase's end pytest gets SIGINT
# and prints its summary (what it reports on Ctrl-C), 15 s later it is killed.
tests() {
    local seconds=$1; shift
    RLFUSE_TEST_TIMEOUT=$TEST_TIMEOUT timeout -s INT -k 15 "$(cap "$seconds")" "$PY" -m pytest \
        -p no:cacheprovider -v -rfEs "$@" 2>&1 | tee -a "$OUT/pytest.txt"
    return "${PIPESTATUS[0]}"
}
phase "pytest -m gpu $GPU_TESTS (${GPU_TESTS_S}s)"
# shellcheck disable=SC2086  # a list of paths
tests "$GPU_TESTS_S" -m gpu $GPU_TESTS
gpu_rc=$?
phase "pytest -m 'not gpu' $CUDA_TESTS (${CUDA_TESTS_S}s)"
# shellcheck disable=SC2086  # a list of files
tests "$CUDA_TESTS_S" -m "not gpu" $CUDA_TESTS
cuda_rc=$?
echo "pytest exit codes: gpu $gpu_rc, cuda $cuda_rc (124: stopped at its time)" | tee -a "$LOG"

phase "vocabulary split: bytes per call (computed; one GPU cannot time a split)"
timeout "$(cap 20)" "$PY" -m tools.traffic --comm 2>&1 | tee -a "$LOG"

sweep_s=$(($(left) - 5))
if ((sweep_s >= 20)); then
    phase "python -m bench.sweep (${sweep_s}s)"
    configs=()
    [[ -n $SWEEP_CONFIGS ]] && configs=(--configs "$SWEEP_CONFIGS")
    # shellcheck disable=SC2086  # option lists
    timeout -k 10 "$sweep_s" "$PY" -m bench.sweep --out "$OUT" --budget-s $((sweep_s - 15)) \
        $SWEEP_ARGS "${configs[@]}" 2>&1 | tee -a "$LOG"
    sweep_rc=${PIPESTATUS[0]}
else
    phase "single-pass sweep skipped: ${sweep_s}s left; python -m bench.sweep runs alone"
    sweep_rc=1
fi
echo "sweep exit code: $sweep_rc" | tee -a "$LOG"
phase "done: $(find "$OUT" -maxdepth 1 -type f | wc -l) files in \$OUT; exit codes: bench" \
    "$bench_rc, gpu tests $gpu_rc, GPU-math tests $cuda_rc, sweep $sweep_rc"
exit $((gpu_rc != 0 || cuda_rc != 0 || bench_rc != 0 || sweep_rc != 0))
