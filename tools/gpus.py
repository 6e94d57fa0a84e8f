"""The GPUs of the models in ``tools/`` (``tools.sass``'s issue and memory time,
``tools.traffic``'s rows in flight against the L2, the compile-only driver's grid): their SMs,
sustained clock, HBM bandwidth and L2, each with its source."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    arch: int            # the SASS that runs on it
    sms: int
    clock_ghz: float     # a sustained clock under a streaming load, not the boost ceiling
    hbm_tbps: float      # peak HBM bandwidth
    l2_mib: int          # L2 cache
    source: str


GPUS = (
    # 132 SMs and 50 MB of L2 (the GH100 of the SXM5 boards: H100 architecture whitepaper);
    # 4.8 TB/s HBM3e (NVIDIA H200 Tensor Core GPU datasheet); 1.75 GHz sustained is an
    # assumption of the model (the boost ceiling is 1.98 GHz).
    GPU("H200", 90, 132, 1.75, 4.8, 50, "H200 SXM datasheet (4.8 TB/s); H100 whitepaper (132 SMs, "
                                        "50 MB L2)"),
    # 132 SMs, 50 MB of L2 and 3.35 TB/s HBM3 (NVIDIA H100 Tensor Core GPU datasheet, SXM5);
    # same clock.
    GPU("H100", 90, 132, 1.75, 3.35, 50, "H100 SXM5 datasheet (3.35 TB/s, 132 SMs, 50 MB L2)"),
    # 108 SMs, 1410 MHz boost, 40 MB of L2 (NVIDIA A100 Tensor Core GPU Architecture
    # whitepaper); 2,039 GB/s HBM2e for the 80 GB SXM4 board (NVIDIA A100 datasheet).
    GPU("A100", 80, 108, 1.41, 2.039, 40, "A100 80GB SXM4 datasheet (2,039 GB/s); A100 "
                                          "whitepaper (108 SMs, 1410 MHz, 40 MB L2)"),
)
