#!/usr/bin/env bash
# The GPU check: what a session lent a GPU runs, from the repo root, in one command (< 9.5 min
# on one H200). The machine has no internet and its own python3 with torch + triton (+ pytest,
# hypothesis, matplotlib), not our .venv.
#   1. rlfuse installed editable without deps (PYTHONPATH=. as well, should pip refuse);
#      Liger-Kernel installed from wheels/ when a wheel was carried there;
#   2. the GPU-only tests first (-m gpu: races, devices, streams, real sizes, CUDA graphs),
#      then the rest of the suite, natively on CUDA (TRITON_INTERPRET unset) -> $OUT/pytest.txt
#   3. python -m bench on the full grid (time budget BENCH_BUDGET s)   -> $OUT/bench.txt and
#      $OUT/<gpu>-<commit>.json, .md (table of every mode), .png (time vs V)
#   4. bench/sweep.sh: the single pass's launch configurations (RLFUSE_SINGLE_PASS) timed at the
#      headline shape, ranked -> $OUT/sweep.json, $OUT/sweep.md (the best named), $OUT/sweep/;
#      it gets what is left of CHECK_BUDGET s (at most SWEEP_BUDGET), so the whole check stays
#      under 9.5 min; with too little left it is skipped: run `bash bench/sweep.sh` on its own
#
# Liger-Kernel (the peer in the tables) cannot be downloaded on that machine. On the dev
# machine, once (wheels/ is git-ignored):
#     pip download liger-kernel --no-deps -d wheels/
# then call the device tool's `run` with carry=["wheels"] and the command
#     RLFUSE_COMMIT=<short sha> bash bench/gpu_check.sh
# (the copy of the tree there has no .git, so write the commit into the command). Without the
# wheel, Liger is listed under "missing_impls" and has no rows. Afterwards, on the dev machine:
# copy the JSON into bench/results/ and `python -m bench.report --readme docs/performance.md`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}
GPU_TESTS_TIMEOUT=${GPU_TESTS_TIMEOUT:-120}  # seconds for the tests marked gpu
PYTEST_TIMEOUT=${PYTEST_TIMEOUT:-180}   # seconds for the rest of the suite
BENCH_BUDGET=${BENCH_BUDGET:-150}       # seconds after which the bench starts no new case
BENCH_ARGS=${BENCH_ARGS:-}              # more python -m bench options, e.g. "--op token_logprobs"
CHECK_BUDGET=${CHECK_BUDGET:-500}       # seconds by which the sweep starts no new configuration
SWEEP_BUDGET=${SWEEP_BUDGET:-120}       # seconds of configurations at most (bench/sweep.sh)
export OUT PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET                  # the real kernels, on the GPU

{
    echo "== environment"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    "$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch",
        torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
    "$PY" -m pip install --quiet --no-deps --no-build-isolation -e . \
        || echo "pip install -e . failed: using PYTHONPATH=$PWD"
    if compgen -G "wheels/*.whl" > /dev/null; then
        "$PY" -m pip install --quiet --no-deps wheels/*.whl || echo "installing wheels/ failed"
    else
        echo "no wheels/*.whl: Liger-Kernel will be reported missing"
    fi
} 2>&1 | tee "$OUT/bench.txt"

# Compiling the kernels' variants is most of the suite's time there: spread it over the CPUs.
XDIST=$("$PY" -c 'import xdist' 2>/dev/null && echo "-n 8")
echo "== pytest -m gpu (timeout ${GPU_TESTS_TIMEOUT}s)" | tee -a "$OUT/bench.txt"
timeout "$GPU_TESTS_TIMEOUT" "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs tests 2>&1 \
    | tee "$OUT/pytest.txt"
gpu_rc=${PIPESTATUS[0]}
echo "== pytest, the rest (timeout ${PYTEST_TIMEOUT}s)" | tee -a "$OUT/bench.txt"
timeout "$PYTEST_TIMEOUT" "$PY" -m pytest -q -p no:cacheprovider $XDIST -m "not gpu" tests 2>&1 \
    | tee -a "$OUT/pytest.txt"
rest_rc=${PIPESTATUS[0]}
pytest_rc=$((gpu_rc != 0 || rest_rc != 0))
echo "pytest exit codes: gpu $gpu_rc, rest $rest_rc" | tee -a "$OUT/bench.txt"

echo "== python -m bench (budget ${BENCH_BUDGET}s)" | tee -a "$OUT/bench.txt"
# The hard timeout is a last resort: the JSON is checkpointed after every case.
timeout $((BENCH_BUDGET + 60)) "$PY" -m bench --out "$OUT" --budget-s "$BENCH_BUDGET" \
    --rep-ms 50 --warmup-ms 10 $BENCH_ARGS 2>&1 | tee -a "$OUT/bench.txt"
bench_rc=${PIPESTATUS[0]}
echo "bench exit code: $bench_rc" | tee -a "$OUT/bench.txt"

# A vocabulary split needs more than one GPU to time; on one, what it would send is computed.
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
echo "== vocabulary split: $gpus GPU(s); bytes per call (computed)" | tee -a "$OUT/bench.txt"
"$PY" -m tools.traffic --comm 2>&1 | tee -a "$OUT/bench.txt"

# The sweep's last configuration may start at its budget's end and run SWEEP_RUN_TIMEOUT (60 s).
left=$((CHECK_BUDGET - SECONDS))
sweep_rc=0
if ((left >= 30)); then
    OUT="$OUT" PYTHON="$PY" SWEEP_BUDGET=$((left < SWEEP_BUDGET ? left : SWEEP_BUDGET)) \
        bash bench/sweep.sh
    sweep_rc=$?
    echo "sweep exit code: $sweep_rc" | tee -a "$OUT/bench.txt"
else
    echo "== single-pass sweep skipped: ${left}s left of CHECK_BUDGET; run bench/sweep.sh alone" \
        | tee -a "$OUT/bench.txt"
fi
exit $((pytest_rc != 0 || bench_rc != 0 || sweep_rc != 0))
