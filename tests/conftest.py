"""Shared fixtures: tiny HF checkpoints built once per test session, GPU skipping."""
import pytest
import torch

from rlep_megatron.tiny_model import make_tiny_model


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    """The tiny Qwen2 checkpoint (tied embeddings, QKV bias), seed 0."""
    return make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny-qwen2"), seed=0,
                           arch="qwen2")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """The tiny Llama checkpoint (untied embeddings, no biases), seed 0."""
    return make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny-llama"), seed=0,
                           arch="llama")
