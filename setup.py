from setuptools import find_packages, setup

# The range megatron_zb.compat.SUPPORTED_RANGE checks at import (0.17 and later need Python 3.12).
MEGATRON_CORE = "megatron-core>=0.16.1,<0.20"

setup(
    name="megatron-zb",
    version="0.1.0",
    description="Zero-bubble pipeline parallelism for NVIDIA megatron-core, as a plugin",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_zb", "megatron_zb.*"]),
    # The schedule core, the simulator and the CLI are pure Python. The runtime needs torch and
    # megatron-core: install torch first (torch==2.13.0 is the CPU build here; GPU images bring
    # their own), so that this range is already satisfied and pip fetches no CUDA wheels.
    install_requires=[],
    extras_require={
        "runtime": ["torch>=2.1", MEGATRON_CORE],
        "refine": ["ortools>=9.8"],
        # What Megatron-LM's training package imports beyond torch and megatron-core (`--megatron-lm`);
        # triton is imported at initialize (CUDA torch wheels bring it, the CPU build does not); pybind11
        # builds megatron-core's dataset helpers from a checkout.
        # psutil: torch_dist checkpoints are written by helper processes that use it.
        "megatron-lm": [
            "six",
            "pydantic",
            "einops",
            "regex",
            "pyyaml",
            "pybind11",
            "psutil",
            "triton; platform_system=='Linux'",
        ],
        "test": [
            "pytest>=7",
            "pytest-xdist>=3.2",
            "hypothesis>=6",
            "ruff>=0.4",
            "ortools>=9.8",
            "torch>=2.1",
            MEGATRON_CORE,
        ],
    },
    entry_points={"console_scripts": ["megatron-zb = megatron_zb.cli:main"]},
)
