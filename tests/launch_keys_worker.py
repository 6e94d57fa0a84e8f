"""The launch keys of the GPU check's warm-up and of its headline benchmark
(``tests/test_gpu_compile.py`` starts this in a process of its own, without the interpreter):
Triton's driver replaced by one that records each launch's key in Triton's cache of compiled
kernels and runs nothing (``tools.compile_only``); the warm-up's headline drive
(``tools.gpu_compile._drive_headline``, at its stand-in vocabulary), then ``python -m bench
--headline``'s own run (fused) at another stand-in vocabulary; both lists written as JSON.

    python tests/launch_keys_worker.py OUT.json [--V 24576]
"""
import argparse
import json

from tools import compile_only, gpu_compile  # the repository root is on PYTHONPATH

from bench import __main__ as bench_main


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--V", type=int, default=24576, help="the benchmark's stand-in vocabulary")
    args = p.parse_args()
    compile_only.install(90, keys_only=True)
    gpu_compile._drive_headline()
    warmup = list(compile_only.KEYS)
    compile_only.KEYS.clear()
    with gpu_compile.headline_stand_in(V=args.V) as shape:
        results = bench_main.run(bench_main.parse_args(
            ["--headline", "--impls", "fused", "--V", str(shape.V), "--hidden",
             str(shape.hidden), "--cpu-reps", "1", "--commit", "keys"]))
    with open(args.out, "w") as f:
        json.dump({"warmup": warmup, "bench": list(compile_only.KEYS),
                   "bench_cases": [(r["op"], r["mode"]) for r in results["rows"]],
                   "bench_errors": results["header"]["errors"]}, f)


if __name__ == "__main__":
    main()
