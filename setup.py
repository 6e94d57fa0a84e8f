import re
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
# One version, written in rlfuse/_version.py.
VERSION = re.search(r'^__version__ = "([^"]+)"$', (ROOT / "rlfuse" / "_version.py").read_text(),
                    re.MULTILINE).group(1)

setup(
    name="rlfuse",
    version=VERSION,
    description="Fused Triton kernels for LLM reinforcement-learning and distillation losses",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    # torch >= 2.10 supports Python 3.10 and newer
    python_requires=">=3.10",
    packages=find_packages(include=["rlfuse", "rlfuse.*"]),
    package_data={"rlfuse": ["py.typed"], "rlfuse.integrations.verl": ["*.yaml"]},
    # numpy: Triton's interpreter (TRITON_INTERPRET=1, the kernels on CPU tensors) runs on it
    install_requires=["torch>=2.10", "triton>=3.3", "numpy"],
    extras_require={
        # trl, deepspeed, megatron-core and verl: the integrations are tested against the real
        # packages. verl is installed with --no-deps by `make setup` (its own pins clash with
        # ours); these are what its core_algos, its actor loss, its model patches, its workers
        # and its trainer import (hydra: the GR-OPD recipe's config).
        "test": ["pytest", "pytest-xdist", "hypothesis", "liger-kernel==0.8.5",
                 "trl==1.16.0", "deepspeed==0.19.8", "megatron-core==0.16.1", "ray",
                 "tensordict", "omegaconf", "codetiming", "orjson", "pillow", "hydra-core",
                 "uvicorn", "fastapi", "torchdata", "cachetools"],
        "bench": ["matplotlib", "liger-kernel==0.8.5"],
        "train": ["transformers", "peft"],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Typing :: Typed",
    ],
)
