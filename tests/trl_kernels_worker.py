"""TRL's Triton kernels on the benchmark's inputs (its log-probs and entropy, its chunked head,
its chunked divergence; the values and the gradients of a training step, ``tools.compare``'s
step), printed as JSON. With ``--missing a,b``, the modules named are made unimportable first,
as on a GPU machine where TRL was installed without its dependencies, so that
``bench.trl_kernels`` loads TRL's kernels alone; without it TRL is imported whole
(``tests/test_bench.py`` runs both, in processes alike, and compares them). In the Triton
interpreter."""
import json
import sys

OPS = ("token_logprobs_entropy", "ppo_head", "distill_head")


def outputs() -> dict:
    import torch

    from bench import cases
    from tools import compare, traffic

    cases.load_impl("trl")
    result = {}
    for name in OPS:
        x = traffic.traffic_inputs(300, torch.float32, seed=3)
        outs, grads = compare._step(cases.OPS[name], "trl", x)
        result[name] = [t.double().flatten().tolist() for t in (*outs, *grads)]
    return result


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)               # one order for the torch ops' sums in every run
    missing = sys.argv[sys.argv.index("--missing") + 1].split(",") \
        if "--missing" in sys.argv else []
    for name in missing:
        sys.modules[name] = None               # import raises ImportError
    kernels_only = bool(missing)
    result = outputs()
    loaded = getattr(sys.modules["trl.trainer.utils"], "KERNELS_ONLY", False)
    assert loaded == kernels_only, f"TRL's kernels alone: {loaded}"
    print(json.dumps(result))
