"""The CPU shim for megatron-core: scoped to megatron's modules, CPU-only, separate RNG streams."""
import os
import warnings

import pytest
import torch

from rlep_megatron import platform

pytestmark = pytest.mark.unit

needs_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is CPU-only")


def test_select_platform_cpu():
    plat = platform.select_platform()
    if torch.cuda.is_available():
        assert plat.backend == "nccl" and plat.is_cuda
    else:
        assert plat.backend == "gloo" and plat.device == torch.device("cpu")


def test_shim_is_inactive_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(platform.probe, "cuda_available", lambda: True)
    assert platform.install_megatron_cpu_shim() is False


@needs_cpu_only
def test_shim_is_scoped_to_megatron_modules():
    assert platform.install_megatron_cpu_shim() is True
    from megatron.core.pipeline_parallel import p2p_communication, schedules
    from megatron.core.tensor_parallel import layers

    # megatron sees a CPU "current device" and CPU allocations for device="cuda" literals ...
    assert p2p_communication.torch.cuda.current_device() == torch.device("cpu")
    assert schedules.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert layers.torch.cuda.synchronize() is None
    # ... while torch itself (and so vLLM and user code) is untouched.
    assert torch.cuda.current_device is not p2p_communication.torch.cuda.current_device
    assert torch.zeros is not schedules.torch.zeros
    assert schedules.torch.Tensor is torch.Tensor


@needs_cpu_only
def test_megatron_seed_uses_separate_generator_states():
    platform.install_megatron_cpu_shim()
    from megatron.core.tensor_parallel import random as mcore_random

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "CPU RNG state changed within GPU RNG context" fails
        mcore_random.model_parallel_cuda_manual_seed(1234, tp_rank=0, ep_rank=0, etp_rank=0)
        tracker = mcore_random.get_cuda_rng_tracker()
        assert isinstance(tracker, platform.CpuRNGStatesTracker)

        torch.manual_seed(0)
        expected_default = torch.rand(4)
        torch.manual_seed(0)
        first = torch.rand(2)
        with tracker.fork():
            forked_a = torch.rand(3)
        with tracker.fork():
            forked_b = torch.rand(3)
        second = torch.rand(2)
    # the default stream continues as if no fork happened
    assert torch.equal(torch.cat([first, second]), expected_default)
    # the model-parallel stream is its own generator, advancing across forks
    name = mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME
    reference = torch.Generator().manual_seed(1234 + 2718)  # megatron's tensor-parallel offset
    assert name in tracker.get_states()
    assert torch.equal(torch.cat([forked_a, forked_b]), torch.rand(6, generator=reference))


def test_rng_tracker_rejects_duplicates_and_unknown_names():
    tracker = platform.CpuRNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(Exception, match="seed 1"):
        tracker.add("b", 1)
    with pytest.raises(Exception, match="not added"):
        with tracker.fork("c"):
            pass
    states = tracker.get_states()
    with tracker.fork("a"):
        torch.rand(5)
    tracker.set_states(states)
    with tracker.fork("a"):
        again = torch.rand(5)
    assert torch.equal(again, torch.rand(5, generator=torch.Generator().manual_seed(1)))


@needs_cpu_only
def test_tensor_cuda_is_identity_only_inside_wrapped_megatron_methods():
    platform.install_megatron_cpu_shim()
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original_cuda = torch.Tensor.cuda
    assert getattr(LanguageModule.setup_embeddings_and_output_layer, "_rlep_cpu_shim", False)
    seen = {}

    def probe(self):
        seen["moved"] = torch.ones(2).cuda()  # would raise without CUDA outside the shim

    from rlep_megatron.platform import megatron_shim

    wrapped = megatron_shim._tensor_cuda_is_identity(probe)
    wrapped(None)
    assert seen["moved"].device.type == "cpu"
    assert torch.Tensor.cuda is original_cuda
    with pytest.raises((AssertionError, RuntimeError)):
        torch.ones(1).cuda()


@needs_cpu_only
def test_cpu_rotary_embedding_equals_the_formula_and_megatrons_own():
    """The CPU rotary embedding: megatron's arithmetic bit for bit (values and gradients), the
    rotation formula in float64 within rounding, its cos/sin tables kept only where they are
    reused and never stale, and megatron's own function for a partial rotation."""
    platform.install_megatron_cpu_shim()
    from megatron.core.models.common.embeddings import rope_utils

    from rlep_megatron.platform import megatron_shim

    ours, megatrons = megatron_shim._cpu_rotary_bshd, megatron_shim._megatron_rotary_bshd
    assert rope_utils._apply_rotary_pos_emb_bshd is ours and megatrons is not ours
    generator = torch.Generator().manual_seed(0)
    t = torch.randn(7, 3, 4, 16, generator=generator, dtype=torch.float64)
    freqs = torch.randn(7, 1, 1, 16, generator=generator, dtype=torch.float64)
    half = 8
    rotated = torch.cat([-t[..., half:], t[..., :half]], -1)
    for mscale in (1.0, 0.7):
        formula = t * torch.cos(freqs) * mscale + rotated * torch.sin(freqs) * mscale
        for dtype in (torch.float32, torch.bfloat16):
            x, f = t.to(dtype).requires_grad_(), freqs.float()
            y = x.detach().clone().requires_grad_()
            out, ref = ours(x, f, mscale=mscale), megatrons(y, f, mscale=mscale)
            assert torch.equal(out, ref)
            weights = torch.randn(out.shape, generator=generator).to(dtype)
            (out * weights).sum().backward()
            (ref * weights).sum().backward()
            assert torch.equal(x.grad, y.grad)
            if dtype == torch.float32:
                torch.testing.assert_close(out.double(), formula, rtol=0, atol=1e-5)
    # tables are kept for frequencies seen twice (every layer of an unpacked batch), and
    # recomputed when those change in place; a new tensor per call (packed batches) or a call
    # under inference mode leaves nothing behind
    megatron_shim._rotary_tables.clear()
    f = freqs.float()
    ours(t.float(), f)
    assert not megatron_shim._rotary_tables
    ours(t.float(), f)
    entry = megatron_shim._rotary_tables[0]
    assert entry[0] is f
    assert megatron_shim._rotary_cos_sin(f, 1.0, torch.float32)[0] is entry[4]
    f.mul_(2)
    assert torch.equal(ours(t.float(), f), megatrons(t.float(), f))
    assert megatron_shim._rotary_cos_sin(f, 1.0, torch.float32)[0] is not entry[4]
    megatron_shim._rotary_tables.clear()
    for _ in range(3):
        ours(t.float(), freqs.float())
    with torch.inference_mode():
        g = freqs.float()
        ours(t.float(), g)
        ours(t.float(), g)
    assert not megatron_shim._rotary_tables
    # the rotation covers half of each head: megatron's own function
    partial = freqs[..., :8].float()
    assert torch.equal(ours(t.float(), partial), megatrons(t.float(), partial))


def test_pipeline_sends_are_unbatched_on_gloo(monkeypatch):
    monkeypatch.setattr(platform.probe, "cuda_available", lambda: False)
    assert platform.megatron_config_overrides() == {"batch_p2p_comm": False}
    monkeypatch.setattr(platform.probe, "cuda_available", lambda: True)
    assert platform.megatron_config_overrides() == {}


def test_a_broken_transformer_engine_is_reported_once_with_its_error(monkeypatch, caplog):
    import logging
    import sys

    monkeypatch.setattr(platform.probe, "cuda_available", lambda: True)  # a GPU node, faked
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # import fails
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    platform.probe.transformer_engine_status.cache_clear()
    platform.report_layer_spec.cache_clear()
    try:
        assert platform.use_transformer_engine("auto") is False
        with caplog.at_level(logging.INFO, logger="rlep_megatron.platform"):
            platform.report_layer_spec(False)
            platform.report_layer_spec(False)
        warnings_logged = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings_logged) == 1
        assert "importing transformer_engine.pytorch failed" in warnings_logged[0].getMessage()
        assert "local spec" in warnings_logged[0].getMessage()
    finally:
        platform.probe.transformer_engine_status.cache_clear()
        platform.report_layer_spec.cache_clear()


def test_megatron_accelerator_warnings_are_silenced():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        platform.quiet_megatron_accelerator_warnings()
        warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch "
                      "optimizers.", UserWarning)
        warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning)
        warnings.warn("something else", UserWarning)
    assert [str(w.message) for w in caught] == ["something else"]


def test_no_fused_softmax_without_its_kernels_on_a_gpu(monkeypatch, tiny_qwen2_dir):
    """The local layer spec on a GPU without apex's softmax kernels must not ask megatron for
    the fused softmax (it imports them when a batch shape selects that path)."""
    import sys

    from rlep_megatron.models.megatron import transformer_config
    from rlep_megatron.checkpoint.hf_io import load_hf_config

    monkeypatch.setattr(platform.probe, "cuda_available", lambda: True)  # a GPU node, faked
    for name in ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda"):
        monkeypatch.setitem(sys.modules, name, None)
    hf = load_hf_config(tiny_qwen2_dir)
    assert transformer_config(hf, 1, 1, torch.bfloat16, use_te=False).masked_softmax_fusion \
        is False
    assert transformer_config(hf, 1, 1, torch.bfloat16, use_te=True).masked_softmax_fusion \
        is True


def test_transformer_engine_modes(monkeypatch):
    monkeypatch.setattr(platform.probe, "transformer_engine_status",
                        lambda: (False, "importing transformer_engine.pytorch failed: boom"))
    assert platform.use_transformer_engine("auto") is False
    assert platform.use_transformer_engine("off") is False
    with pytest.raises(RuntimeError, match="required, but importing transformer_engine"):
        platform.use_transformer_engine("required")
    with pytest.raises(ValueError, match="auto, required, off"):
        platform.use_transformer_engine("yes")
    monkeypatch.setattr(platform.probe, "transformer_engine_status", lambda: (True, ""))
    assert platform.use_transformer_engine("auto") is True
    assert platform.use_transformer_engine("required") is True
    assert platform.use_transformer_engine("off") is False


def test_device_choice_refuses_gpus_torch_cannot_use(monkeypatch):
    """``trainer.device=auto`` falls back to the CPU only where no NVIDIA GPU exists or the
    GPUs are hidden on purpose; a GPU that torch cannot use is an error naming the driver and
    the CUDA torch was built for."""
    import warnings

    from rlep_megatron import platform

    def no_cuda():
        warnings.warn("CUDA initialization: The NVIDIA driver on your system is too old "
                      "(found version 12020).")
        return False

    monkeypatch.setattr(torch.cuda, "is_available", no_cuda)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(platform.probe, "nvidia_driver_version", lambda: "535.104.05")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(platform.probe, "nvidia_gpus", lambda: [])
    assert platform.choose_device("auto") == "cpu"  # no NVIDIA GPU here
    with pytest.raises(platform.DeviceError, match="trainer.device=cuda, but torch"):
        platform.choose_device("cuda")
    monkeypatch.setattr(platform.probe, "nvidia_gpus", lambda: ["GPU 0: NVIDIA H100", "GPU 1: X"])
    with pytest.raises(platform.DeviceError) as err:
        platform.choose_device("auto")
    message = str(err.value)
    assert "NVIDIA driver 535.104.05 sees 2 GPU(s)" in message
    assert "built for CUDA 13.0" in message and "driver on your system is too old" in message
    assert "trainer.device=cpu" in message
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # hidden on purpose: the CPU, quietly
    assert platform.choose_device("auto") == "cpu"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert platform.choose_device("cpu") == "cpu"  # vLLM's CPU build is installed here
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "NoDevFiles")  # SLURM without GPUs
    assert platform.choose_device("auto") == "cpu"
    # vLLM's CUDA build ignores CUDA_VISIBLE_DEVICES (NVML): cpu on a GPU node is refused
    monkeypatch.setattr(platform.probe, "vllm_is_cpu_build", lambda: False)
    with pytest.raises(platform.DeviceError, match="vLLM's CPU build"):
        platform.choose_device("cpu")
    with pytest.raises(ValueError, match="auto, cuda, cpu"):
        platform.choose_device("gpu")


def test_truncated_inductor_kernels_are_removed_and_live_builds_kept(tmp_path):
    """A job killed while inductor links a kernel leaves a cut-short library in the shared
    cache, which the loader refuses on every later run; the repair removes exactly those."""
    import subprocess
    import sys

    from filelock import FileLock

    # a kernel library made the way inductor makes them: gcc -shared
    (tmp_path / "kernel.c").write_text("int kernel(void) { return 42; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(tmp_path / "kernel.so"),
                    str(tmp_path / "kernel.c")], check=True)
    whole = (tmp_path / "kernel.so").read_bytes()
    root = tmp_path / "inductor"
    kernels = {"ckeep": whole, "cempty": b"", "chead": whole[:64], "cpage": whole[:4096],
               "chalf": whole[:len(whole) // 2], "cbusy": whole[:4096]}
    paths = {}
    for key, data in kernels.items():
        paths[key] = root / key[1:3] / f"{key}.main.so"
        paths[key].parent.mkdir(parents=True, exist_ok=True)
        paths[key].write_bytes(data)
    source = root / "ke" / "ckeep.main.cpp"
    source.write_text("// source")

    # the independent references: binutils' readelf reports every cut-short copy as reaching
    # past its end (or as no ELF file at all), and the dynamic loader loads the whole one
    for key in kernels:
        report = subprocess.run(["readelf", "-h", "-l", "-S", "-W", str(paths[key])],
                                capture_output=True, text=True)
        assert ("Error" in report.stderr) == (key != "ckeep"), (key, report.stderr)
    probe = f"import ctypes; assert ctypes.CDLL({str(paths['ckeep'])!r}).kernel() == 42"
    subprocess.run([sys.executable, "-c", probe], check=True)

    (root / "locks").mkdir()
    with FileLock(str(root / "locks" / "cbusy.lock")):  # another process is writing it
        removed = platform.remove_truncated_inductor_binaries([str(root)])
    assert sorted(removed) == sorted(str(paths[k]) for k in ("cempty", "chead", "cpage", "chalf"))
    assert paths["ckeep"].read_bytes() == whole and source.exists()
    assert paths["cbusy"].exists()
    # once its writer is gone, a still-truncated library goes too; a second pass finds nothing
    assert platform.remove_truncated_inductor_binaries([str(root)]) == [str(paths["cbusy"])]
    assert platform.remove_truncated_inductor_binaries([str(root)]) == []


@needs_cpu_only
def test_vllm_cpu_helpers_run_uncompiled_and_count_like_a_loop():
    """vLLM's torch.compile-wrapped helpers are called as the functions they wrap on the CPU
    backend (no tracing or kernel build at the first rollout); the token-rank count still
    equals a plain count."""
    import importlib

    pytest.importorskip("vllm")
    replaced = platform.run_vllm_cpu_helpers_eagerly()
    sampler = importlib.import_module("vllm.v1.sample.sampler")
    embedding = importlib.import_module("vllm.model_executor.layers.vocab_parallel_embedding")
    for function in (sampler.batched_count_greater_than, embedding.get_masked_input_and_mask):
        assert not hasattr(function, "_torchdynamo_orig_callable"), function
    assert platform.run_vllm_cpu_helpers_eagerly() == []  # idempotent
    assert len(replaced) in (0, 2)  # 0: an earlier test of this process replaced them
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 40, generator=generator).round(decimals=1)  # ties included
    values = x[torch.arange(5), torch.randint(0, 40, (5,), generator=generator)].unsqueeze(1)
    expected = [sum(1 for v in row if v >= value) for row, value in
                zip(x.tolist(), values[:, 0].tolist())]
    assert sampler.batched_count_greater_than(x, values).tolist() == expected


@needs_cpu_only
def test_vllm_cpu_shm_names_differ_between_jobs_and_agree_within_one(monkeypatch):
    """vLLM's CPU tensor-parallel shared-memory files carry the job's token: the ranks of one
    job (same torchrun master port and run id) get one name per group, a concurrent job with the
    same layout another (vLLM's own name is the same for both: 'errno: 17' for the second); the
    name is one shm_open accepts (vLLM's own starts with '//', which only leads harmlessly)."""
    import types
    from _posixshmem import shm_open, shm_unlink

    pytest.importorskip("vllm")
    from vllm.distributed.device_communicators import cpu_communicator

    shm_class = cpu_communicator._CPUSHMDistributed
    saved = shm_class.__dict__["make_group_name"]
    monkeypatch.setenv("VLLM_DIST_IDENT", "//")  # what every external_launcher engine gets
    group = types.SimpleNamespace(unique_name="tp:0", ranks=[0, 1])
    vllm_name = shm_class.make_group_name(group)
    try:
        platform.name_vllm_cpu_shm_per_job()
        assert platform.name_vllm_cpu_shm_per_job() is False  # idempotent
        names = {}
        for job, port, run_id in (("a", "29500", "9f1c"), ("a", "29500", "9f1c"),
                                  ("b", "29501", "77d0")):
            monkeypatch.setenv("MASTER_PORT", port)
            monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
            name = shm_class.make_group_name(group)
            assert name.endswith(vllm_name.lstrip("/")) and "/" not in name
            names.setdefault(job, set()).add(name)
        assert len(names["a"]) == 1 and len(names["b"]) == 1 and names["a"] != names["b"]
        shm_name = next(iter(names["b"])) + f"_test{os.getpid()}"  # as vLLM's C++ opens it
        os.close(shm_open(shm_name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
        shm_unlink(shm_name)
        monkeypatch.delenv("MASTER_PORT")
        monkeypatch.delenv("TORCHELASTIC_RUN_ID")
        assert f"pid{os.getpid()}" in shm_class.make_group_name(group)
    finally:
        shm_class.make_group_name = saved


def test_cpu_kv_cache_holds_the_most_concurrent_sequences_at_full_length():
    """Counted by hand: K and V of every layer and KV head, fp32, for vLLM's 256 sequences per
    engine rank at max_model_len rounded up to 256 tokens; a rank keeps its share of the KV heads
    (one, replicated, when there are fewer than ranks); within [64 MiB, 1 GiB]."""
    from rlep_megatron.platform.vllm_cpu import cpu_kv_cache_bytes

    tiny = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "hidden_size": 128}
    assert cpu_kv_cache_bytes(tiny, 128) == (2 * 4 * 2 * 32 * 4) * (256 * 256) == 128 * 2**20
    assert cpu_kv_cache_bytes(tiny, 300) == (2 * 4 * 2 * 32 * 4) * (256 * 512)
    assert cpu_kv_cache_bytes(tiny, 128, 2) == (2 * 4 * 1 * 32 * 4) * (512 * 256)
    assert cpu_kv_cache_bytes(tiny, 128, 4) == (2 * 4 * 1 * 32 * 4) * (1024 * 256)
    # head_dim from hidden_size / heads, and the config nested as a multimodal one's text part
    small = {"num_hidden_layers": 1, "num_attention_heads": 2, "hidden_size": 32}
    assert cpu_kv_cache_bytes({"text_config": small}, 256) == 64 * 2**20  # 16 MiB: the floor
    assert cpu_kv_cache_bytes({"text_config": small}, 2048) == (2 * 1 * 2 * 16 * 4) * (256 * 2048)
    qwen2_7b = {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                "hidden_size": 3584}
    assert cpu_kv_cache_bytes(qwen2_7b, 4096) == 2**30  # the backend's former size, the cap


def test_startup_heap_is_frozen_without_a_collection_and_collection_resumes():
    """A job pauses automatic collection while it imports, then freezes the heap as it is
    before vLLM builds its engine: live objects are frozen (later full collections skip them),
    the little garbage made during the pause is frozen with them (no full collection, which
    would cost about 0.5 s of every start-up), and automatic collection is back on."""
    import gc
    import weakref

    from rlep_megatron.platform import heap

    class Node:
        pass

    assert gc.isenabled()
    frozen_before = gc.get_freeze_count()
    try:
        heap.pause_gc_for_startup()
        assert not gc.isenabled()
        garbage, live = Node(), Node()
        garbage.me, live.me = garbage, live          # two reference cycles
        freed = []
        weakref.finalize(garbage, freed.append, "garbage")
        del garbage
        for _ in range(3 * gc.get_threshold()[0]):   # enough allocations for a collection
            Node()
        assert freed == []                           # paused: nobody collected the cycle
        heap.freeze_startup_heap()
        assert gc.isenabled()
        assert gc.get_freeze_count() > frozen_before
        gc.collect()
        assert freed == []                           # frozen, not collected
        assert live.me is live
        # a second call (e.g. a second engine in one process) keeps collection on
        heap.freeze_startup_heap()
        assert gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()
    gc.collect()
    assert freed == ["garbage"]                      # unfrozen, it is ordinary garbage again


def test_a_job_that_fails_before_its_engine_leaves_collection_on(tmp_path):
    """`rlep train` pauses automatic collection while it starts; called in-process, a job that
    fails before building its engine (here: a recipe that does not exist) returns its error
    code with collection back on."""
    import gc

    from rlep_megatron import cli

    assert gc.isenabled()
    assert cli.main(["train", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert gc.isenabled()
