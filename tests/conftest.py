"""Shared fixtures: tiny HF checkpoints built once per test session, GPU skipping, and no
silent skips in CI.

Only ``gpu``-marked tests may skip (without CUDA). Elsewhere an optional dependency is taken
with :func:`tests.requires`: a skip on a developer's machine without it, but with ``CI`` set (as
``.ci/run`` does) a missing dependency is an error, and any skip of a non-gpu test is turned
into a failure, so a broken install cannot pass CI by skipping.
"""
import os
import shutil

import pytest
import torch

from rlep_megatron.tiny_model import make_tiny_model

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# one thread for the torch work done in the test processes themselves (as the jobs they start
# get OMP_NUM_THREADS=1): with a second worker or job on the other core, torch's default of one
# thread per core spins on a busy core (the memorised warm start: 22 s instead of 6 with one
# core busy, on a 2-core AMD EPYC)
torch.set_num_threads(1)

# the heavy tiers first: pytest-xdist's workers then end on short unit tests, not one waiting
# for the other's long job
_TIER_ORDER = ("distributed", "e2e", "vllm")


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pytest.ini): one worker per core, at most one per 10 GiB of memory (a
    worker runs jobs of up to 4 ranks, each with its engine) and at most 8."""
    import psutil

    memory_gib = psutil.virtual_memory().total / 2**30
    return max(1, min(os.cpu_count() or 1, int(memory_gib // 10), 8))


def pytest_collection_modifyitems(config, items):
    def tier(item):
        parts = item.nodeid.split("/")
        return (_TIER_ORDER.index(parts[1]) if len(parts) > 2 and parts[1] in _TIER_ORDER
                else len(_TIER_ORDER))

    items.sort(key=tier)  # stable: each tier keeps its order
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and "gpu" not in item.keywords:
        report.outcome = "failed"
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        report.longrepr = (f"skipped in CI, where only gpu tests may skip: {reason}")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    """The tiny Qwen2 checkpoint (tied embeddings, QKV bias), seed 0."""
    return make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny-qwen2"), seed=0,
                           arch="qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    """The tiny Qwen3 checkpoint (q/k norms, head_dim 64 != hidden / heads, untied head)."""
    return make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny-qwen3"), seed=0,
                           arch="qwen3")


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory):
    """The tiny Qwen3-MoE checkpoint (8 experts, top-2, renormalised gates, layer 0 dense)."""
    return make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny-qwen3-moe"), seed=0,
                           arch="qwen3_moe")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """The tiny Llama checkpoint (untied embeddings, no biases), seed 0."""
    return make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny-llama"), seed=0,
                           arch="llama")


@pytest.fixture(scope="session")
def memorised(tmp_path_factory):
    """A task the tiny model can memorise (6 training questions, operands <= 2) and the tiny
    Qwen2 warm-started on it for 120 steps, built once per session: ``copy(task_dir,
    model_dir)`` puts a private copy where a test wants it and returns ``(task, model)``."""
    from rlep_megatron.tiny_task import make_tiny_task, warm_start

    root = tmp_path_factory.mktemp("memorised")
    task = make_tiny_task(str(root / "task"), seed=0, num_train=6, num_val=2, max_operand=2)
    model = make_tiny_model(str(root / "model"), seed=0)
    result = warm_start(model, task["solutions"], steps=120, lr=3e-3, batch_size=6,
                        eval_parquet=task["train"], show_progress=False)
    # what the tests need: the model answers the memorised questions (greedy); not a loss
    # value, whose digits differ from one CPU to another
    assert result["accuracy"] >= 5 / 6, result

    def copy(task_dir, model_dir):
        shutil.copytree(root / "task", task_dir)
        shutil.copytree(model, model_dir)
        source = str(root / "task")
        return ({key: (str(task_dir) + value[len(source):]
                       if isinstance(value, str) and value.startswith(source) else value)
                 for key, value in task.items()}, str(model_dir))
    return copy
