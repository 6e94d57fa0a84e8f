from setuptools import find_packages, setup

setup(
    name="rlfuse",
    version="0.1.0",
    description="Fused Triton kernels for GGPO, GPPO and GR-OPD reinforcement-learning losses",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.9",
    packages=find_packages(include=["rlfuse", "rlfuse.*"]),
    package_data={"rlfuse.integrations": ["*.yaml"]},
    install_requires=["torch>=2.10", "triton>=3.3"],
    extras_require={
        # trl, deepspeed, megatron-core and verl: the integrations are tested against the real
        # packages. verl is installed with --no-deps by `make setup` (its own pins clash with
        # ours); these are what its core_algos, its actor loss, its model patches, its workers
        # and its trainer import (hydra: the GR-OPD recipe's config).
        "test": ["pytest", "pytest-xdist", "hypothesis", "numpy", "liger-kernel==0.8.5",
                 "trl==1.16.0", "deepspeed==0.19.8", "megatron-core==0.16.1", "ray",
                 "tensordict", "omegaconf", "codetiming", "orjson", "pillow", "hydra-core",
                 "uvicorn", "fastapi", "torchdata", "cachetools"],
        "bench": ["matplotlib", "numpy", "liger-kernel"],
        "train": ["transformers", "peft"],
    },
)
