#!/usr/bin/env bash
# The sweep of the single pass's launch configurations (rlfuse/kernels/single_pass.py): one
# `python -m bench` per configuration at the headline shape, then bench/sweep.py, which ranks
# them by time -> $OUT/sweep.json, $OUT/sweep.md (the best named), $OUT/sweep.txt, and each
# run's JSON under $OUT/sweep/<name>/. Called by gpu_check.sh after the main benchmark; runs
# alone too, from the repo root:
#     OUT=/tmp/sweep bash bench/sweep.sh
# On the CPU (the Triton interpreter) with tiny shapes, as tests/test_single_pass_configs.py does:
#     SWEEP_SHAPE="--quick --N 16 --V 300" SWEEP_CONFIGS="default evict=1" bash bench/sweep.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}
SWEEP_BUDGET=${SWEEP_BUDGET:-120}   # seconds after which no new configuration is started
SWEEP_RUN_TIMEOUT=${SWEEP_RUN_TIMEOUT:-60}   # seconds for one configuration's run
# The headline case: GPPO from logits, the whole training step, the largest N and V in bf16.
SWEEP_SHAPE=${SWEEP_SHAPE:-"--N 16384 --V 151936 --dtype bf16"}
SWEEP_ARGS=${SWEEP_ARGS:-"--op gppo_logits --mode fwd+bwd --impls fused --rep-ms 50 --warmup-ms 10"}
export PYTHONUNBUFFERED=1
# The configurations, RLFUSE_SINGLE_PASS texts separated by spaces (default: the candidates of
# rlfuse/kernels/single_pass.py).
SWEEP_CONFIGS=${SWEEP_CONFIGS:-$("$PY" bench/sweep.py --list)}
# The ranking (bench/sweep.py as a script: no torch import), written after every configuration
# too, so that a run stopped from outside keeps what it has measured.
rank() { "$PY" bench/sweep.py "$OUT/sweep" --json "$OUT/sweep.json" --md "$OUT/sweep.md" "$@"; }
mkdir -p "$OUT/sweep"
start=$SECONDS
{
    echo "== single-pass sweep (budget ${SWEEP_BUDGET}s): $SWEEP_ARGS $SWEEP_SHAPE"
    for config in $SWEEP_CONFIGS; do
        dir="$OUT/sweep/$(echo "$config" | tr -c 'A-Za-z0-9_\n' '-')"
        mkdir -p "$dir"
        echo "$config" > "$dir/single_pass.txt"    # without a JSON: listed as not run
        if (( SECONDS - start > SWEEP_BUDGET )); then
            echo "-- budget spent: RLFUSE_SINGLE_PASS=$config not run"
            continue
        fi
        echo "-- RLFUSE_SINGLE_PASS=$config"
        # shellcheck disable=SC2086  # the option strings are word lists
        RLFUSE_SINGLE_PASS="$config" timeout "$SWEEP_RUN_TIMEOUT" "$PY" -m bench $SWEEP_ARGS \
            $SWEEP_SHAPE --no-report --out "$dir" || echo "bench exit code $? for $config"
        rank > /dev/null
    done
    # the group's exit status: the ranking's (1 when no configuration has a time)
    rank
} 2>&1 | tee "$OUT/sweep.txt"
exit "${PIPESTATUS[0]}"
