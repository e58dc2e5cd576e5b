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

# the heavy tiers first, dealt to the two halves of the run (below)
_TIER_ORDER = ("distributed", "e2e", "vllm")
# tiers whose tests share launches or module fixtures within a file (tests.torchrun.Cases,
# a module-scoped program run): their files are dealt whole
_SHARED_TIERS = ("distributed", "vllm")


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pytest.ini): one worker per core, at most one per 10 GiB of memory (a
    worker runs jobs of up to 4 ranks, each with its engine) and at most 8."""
    import psutil

    memory_gib = psutil.virtual_memory().total / 2**30
    return max(1, min(os.cpu_count() or 1, int(memory_gib // 10), 8))


def _tier(item) -> str:
    parts = item.nodeid.split("/")
    return parts[1] if len(parts) > 2 else ""


def pytest_collection_modifyitems(config, items):
    """The order that keeps pytest-xdist's two workers (``--dist worksteal``, which gives each
    worker one half of the list and lets an idle one take the back of the other's queue)
    busy to the end: the heavy tiers first, dealt alternately to the two halves (a file of
    the shared tiers as one unit), so that both workers start on heavy tests and end on the
    short unit tests, which are what an idle worker takes over."""
    units, by_file = [], {}
    for item in items:
        if _tier(item) in _SHARED_TIERS:
            path = item.nodeid.split("::", 1)[0]
            if path not in by_file:
                by_file[path] = []
                units.append(by_file[path])
            by_file[path].append(item)
        else:
            units.append([item])
    rank = {tier: i for i, tier in enumerate(_TIER_ORDER)}
    heavy = [unit for unit in units if _tier(unit[0]) in rank]
    heavy.sort(key=lambda unit: rank[_tier(unit[0])])  # stable: each tier keeps its order
    light = [item for unit in units if _tier(unit[0]) not in rank for item in unit]
    first = [item for unit in heavy[0::2] for item in unit]
    second = [item for unit in heavy[1::2] for item in unit]
    # each half: its heavy tests, then light ones up to half the run
    fill = max(0, min(len(light), (len(items) + 1) // 2 - len(first)))
    items[:] = first + light[:fill] + second + light[fill:]
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_collection_finish(session):
    """The fork server (tests/forkserver.py) starts its imports now, in the background, when
    this process will run tests that start programs: their first programs are then forked too."""
    if any(_tier(item) in _TIER_ORDER for item in session.items):
        from tests import forkserver

        forkserver.start()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and "gpu" not in item.keywords:
        report.outcome = "failed"
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        report.longrepr = (f"skipped in CI, where only gpu tests may skip: {reason}")


_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Adds each phase's duration to its file's total (on xdist's controller too, which
    receives every worker's reports)."""
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """Where the suite's time goes, by file (set-up, call and tear-down summed; with several
    workers the sum exceeds the wall time): the 20 slowest files."""
    if not _FILE_SECONDS or hasattr(terminalreporter.config, "workerinput"):
        return
    total = sum(_FILE_SECONDS.values())
    terminalreporter.write_sep("=", f"slowest files ({total:.0f} s in all tests)")
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:20]:
        terminalreporter.write_line(f"{seconds:9.1f}s {100 * seconds / total:5.1f}%  {path}")


@pytest.fixture(autouse=True)
def _rules_by_data_source():
    """Each test starts with the rewards by data_source: a command run in the test process
    with ``reward.function`` (``rlep config``, a job's checks) takes that function into use for
    the process, and would score the next test's answers with it."""
    yield
    from rlep_megatron.reward import rules

    rules.use_reward_function("")


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
    Qwen2 warm-started on it for 120 steps, built once per test run (whatever the number of
    pytest-xdist workers: the first to ask builds it in the run's shared temporary directory,
    the other reads it; a per-worker copy built it twice, up to 99 s of set-up each on a busy
    2-core machine): ``copy(task_dir, model_dir)`` puts a private copy where a test wants it
    and returns ``(task, model)``."""
    from tests.torchrun import once_per_run

    def make(root):
        from rlep_megatron.tiny_task import make_tiny_task, warm_start

        task = make_tiny_task(str(root / "task"), seed=0, num_train=6, num_val=2,
                              max_operand=2)
        model = make_tiny_model(str(root / "model"), seed=0)
        result = warm_start(model, task["solutions"], steps=120, lr=3e-3, batch_size=6,
                            eval_parquet=task["train"], show_progress=False)
        # what the tests need: the model answers the memorised questions (greedy); not a loss
        # value, whose digits differ from one CPU to another
        assert result["accuracy"] >= 5 / 6, result
        return {"root": str(root), "task": task, "model": model}

    built = once_per_run(tmp_path_factory, "memorised", make)
    root, task, model = built["root"], built["task"], built["model"]

    def copy(task_dir, model_dir):
        source = os.path.join(root, "task")
        shutil.copytree(source, task_dir)
        shutil.copytree(model, model_dir)
        return ({key: (str(task_dir) + value[len(source):]
                       if isinstance(value, str) and value.startswith(source) else value)
                 for key, value in task.items()}, str(model_dir))
    return copy
