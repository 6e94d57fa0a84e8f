"""TRL's Triton kernels on the benchmark's inputs (its log-probs and entropy, its chunked head,
its chunked divergence; the values and the gradients of a training step, ``tools.compare``'s
step): ``outputs()``. Run as a script, with ``transformers``, ``accelerate`` and ``datasets``
made unimportable first, as on the GPU check's machine, so that ``bench.trl_kernels`` loads
TRL's kernels alone; it prints them as JSON (``tests/test_bench.py`` compares them with TRL's
own import). In the Triton interpreter."""
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
    for missing in ("transformers", "accelerate", "datasets"):
        sys.modules[missing] = None        # import raises ImportError
    result = outputs()
    import trl.trainer.utils

    assert getattr(trl.trainer.utils, "KERNELS_ONLY", False), "TRL was imported whole"
    print(json.dumps(result))
