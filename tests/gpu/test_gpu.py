"""On one GPU (``scripts/gpu_check.sh``; skipped without CUDA): the actor in bf16 against
transformers (local spec and TransformerEngine, padded and packed), Qwen3 and Qwen3-MoE in fp32
against transformers (local spec), one fp32 train step against
the transformers + AdamW reference, the same step in bf16 with TransformerEngine, the
rollout engine's sleep / wake / sync / generate cycle with parity after the wake, and the
engine's expert routing captured and replayed (``algo.routing_replay=rollout``'s engine).

Every program runs with the parent's ``CUDA_VISIBLE_DEVICES`` (unset stays unset) and reports
the device its parameters live on: a test that ran on the CPU fails.

Tolerances: bf16 keeps 8 bits of mantissa (relative rounding 2^-9 per operation); the tiny
model's logits are O(1), so per-token log-probs of the same weights differ by O(1e-2) between
two bf16 implementations (and between packed and padded batches, whose kernels differ); fp32
on a GPU may use other reduction orders than the CPU reference, so its bound is 1e-4 rather
than the CPU tests' 2e-6. fp32 checks run on megatron-core's local spec with TF32 disabled
(``NVIDIA_TF32_OVERRIDE=0``): TransformerEngine computes fp32 GEMMs in TF32 (10-bit mantissa),
which is a bf16-class error, not an fp32 one."""
import json

import pytest
import torch

from rlep_megatron.checkpoint.verify import hf_token_logprobs
from tests import requires
from tests.torchrun import run_ranks

pytestmark = pytest.mark.gpu

BF16_MEAN, BF16_MAX = 0.02, 0.15
NO_TF32 = {"NVIDIA_TF32_OVERRIDE": "0"}


def run_on_gpu(script: str, args: list[str], timeout_s: float = 600,
               env: dict[str, str] | None = None):
    """One rank on the GPU: the parent's CUDA_VISIBLE_DEVICES is kept as it is."""
    return run_ranks(script, 1, args, timeout_s=timeout_s, env=env, gpu=True)


def assert_on_cuda(device: str) -> None:
    assert device.startswith("cuda"), f"the program ran on {device}, not on the GPU"


def spec_flag(spec: str) -> str:
    """``te`` needs TransformerEngine: skipped (a gpu test may skip) on a GPU stack set up
    without it (WITH_TE=0), never silently run on the local spec."""
    if spec == "te":
        from rlep_megatron import platform

        usable, why = platform.transformer_engine_status()
        if not usable:
            pytest.skip(f"TransformerEngine is not usable here: {why}")
        return "required"
    return "off"


def token_diffs(logp, reference, lengths):
    positions = torch.arange(reference.shape[1]).unsqueeze(0)
    valid = (positions >= 1) & (positions < lengths[:, None])
    return (logp.double() - reference)[valid].abs()


def actor_logprobs(hf_dir, out, dtype, spec, pack_max_tokens=None, env=None):
    args = ["--hf-dir", hf_dir, "--dtype", dtype, "--transformer-engine", spec_flag(spec),
            "--out", str(out)]
    if pack_max_tokens:
        args += ["--pack-max-tokens", str(pack_max_tokens)]
    run_on_gpu("tests/distributed/actor_logprob_program.py", args, env=env)
    result = torch.load(out)
    assert_on_cuda(result["device"])
    assert result["transformer_engine"] == (spec == "te")
    return result


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("spec", ["local", "te"])
@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_bf16_actor_logprobs_match_transformers(arch, spec, packed, request, tmp_path):
    hf_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    result = actor_logprobs(hf_dir, tmp_path / "logp.pt", "bfloat16", spec,
                            pack_max_tokens=64 if packed else None)
    reference = hf_token_logprobs(hf_dir, result["input_ids"], result["lengths"])
    diffs = token_diffs(result["logp"], reference, result["lengths"])
    assert diffs.numel() > 50
    assert diffs.mean().item() <= BF16_MEAN and diffs.max().item() <= BF16_MAX, (
        diffs.mean().item(), diffs.max().item())


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_fp32_qwen3_actor_logprobs_match_transformers(arch, packed, request, tmp_path):
    """Qwen3 (q/k norms, head_dim apart from hidden / heads) and Qwen3-MoE (megatron's MoE
    layer: the router's softmax top-k, the all-to-all dispatcher, the experts as a loop on the
    local spec) in fp32 without TF32, at the GPU's fp32 bound; the MoE expert counts are
    transformers' own routing of the same tokens, so a router that picks other experts on the
    GPU fails even where the log-probs stay close."""
    from tests.distributed.test_actor_logprob_parity import hf_expert_counts

    hf_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    result = actor_logprobs(hf_dir, tmp_path / "logp.pt", "float32", "local",
                            pack_max_tokens=64 if packed else None, env=NO_TF32)
    reference = hf_token_logprobs(hf_dir, result["input_ids"], result["lengths"])
    diffs = token_diffs(result["logp"], reference, result["lengths"])
    assert diffs.numel() > 50 and diffs.max().item() <= 1e-4, diffs.max().item()
    if arch == "qwen3_moe":
        assert torch.equal(result["expert_counts"].cpu(), hf_expert_counts(
            hf_dir, result["input_ids"], result["lengths"]))


@pytest.mark.parametrize("spec", ["local", "te"])
def test_packed_equals_padded_on_the_gpu(spec, tiny_qwen2_dir, tmp_path):
    """The THD path (TransformerEngine's packed attention with ``te``) against the padded
    batch of the same layer spec: bf16 bound; and fp32 on the local spec without TF32."""
    padded = actor_logprobs(tiny_qwen2_dir, tmp_path / "padded.pt", "bfloat16", spec)
    packed = actor_logprobs(tiny_qwen2_dir, tmp_path / "packed.pt", "bfloat16", spec,
                            pack_max_tokens=64)
    diffs = token_diffs(packed["logp"], padded["logp"].double(), padded["lengths"])
    assert diffs.mean().item() <= BF16_MEAN and diffs.max().item() <= BF16_MAX, (
        diffs.mean().item(), diffs.max().item())
    if spec == "local":
        padded = actor_logprobs(tiny_qwen2_dir, tmp_path / "padded32.pt", "float32", spec,
                                env=NO_TF32)
        packed = actor_logprobs(tiny_qwen2_dir, tmp_path / "packed32.pt", "float32", spec,
                                pack_max_tokens=64, env=NO_TF32)
        diffs = token_diffs(packed["logp"], padded["logp"].double(), padded["lengths"])
        assert diffs.max().item() <= 1e-4, diffs.max().item()


def train_on_gpu(hf_dir, out, *extra, env=None):
    run_on_gpu("tests/distributed/actor_train_program.py",
               ["--hf-dir", hf_dir, "--tp", "1", "--pp", "1", "--out", str(out), *extra],
               env=env)
    step = torch.load(out)
    assert_on_cuda(step["device"])
    return step


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_one_fp32_train_step_matches_transformers_and_adamw(packed, tiny_qwen2_dir, tmp_path):
    from tests.distributed.test_actor_train_step import reference_step

    step = train_on_gpu(tiny_qwen2_dir, tmp_path / "step.pt", "--adam-eps", "1e-6",
                        "--weight-decay", "1.0", "--transformer-engine", "off",
                        *(["--packing"] if packed else []), env=NO_TF32)
    assert step["transformer_engine"] is False
    reference, reference_loss = reference_step(tiny_qwen2_dir, step["old_logp"].cpu(),
                                               eps=1e-6, weight_decay=1.0)
    assert step["metrics"]["step_applied"] == 1.0
    assert step["metrics"]["pg_loss"] == pytest.approx(reference_loss, abs=1e-4)
    for name, tensor in step["weights"].items():
        torch.testing.assert_close(tensor.cpu(), reference[name], rtol=0, atol=1e-4, msg=name)


@pytest.mark.parametrize("spec", ["local", "te"])
def test_one_bf16_train_step_follows_the_fp32_reference(spec, tiny_qwen2_dir, tmp_path):
    """bf16 weights (fp32 main parameters in the optimizer) after one step against the fp32
    transformers + AdamW step. Adam's first step moves each element by about lr = 1e-3 in the
    sign of its gradient, so bf16 gradient noise can flip the sign only where the gradient is
    near zero: the mean distance stays far below lr and the largest is at most 2 lr plus the
    bf16 rounding of the weight; a wrong gradient would put the mean near lr."""
    from safetensors.torch import load_file

    from tests.distributed.test_actor_train_step import reference_step

    step = train_on_gpu(tiny_qwen2_dir, tmp_path / "step.pt", "--adam-eps", "1e-6",
                        "--weight-decay", "1.0", "--dtype", "bfloat16",
                        "--transformer-engine", spec_flag(spec), "--packing")
    assert step["transformer_engine"] == (spec == "te")
    # the reference's old log-probs are its own (fp32) plus the same noise, so that its
    # ratios are those of our bf16 step (exp(-noise) on the first micro-batch) and bf16's
    # log-prob error does not move tokens across the clip boundary
    from tests.distributed.actor_train_program import global_batch

    input_ids = global_batch()[0]
    noise = (step["old_logp"] - step["clean_old_logp"]).cpu().float()
    reference_old = hf_token_logprobs(tiny_qwen2_dir, input_ids, step["lengths"]).float() + noise
    reference, _ = reference_step(tiny_qwen2_dir, reference_old, eps=1e-6, weight_decay=1.0)
    initial = load_file(f"{tiny_qwen2_dir}/model.safetensors")
    lr = 1e-3
    for name, tensor in step["weights"].items():
        ours, ref = tensor.cpu().float(), reference[name]
        diff = (ours - ref).abs()
        rounding = ref.abs() * 2.0 ** -8
        assert (diff <= 2 * lr + rounding + 1e-6).all(), (name, diff.max().item())
        if ref.dim() == 2 and ".layers." in name:
            assert diff.mean().item() <= 0.25 * lr, (name, diff.mean().item())
            assert (ours - initial[name].float()).abs().mean().item() > 0.5 * lr, name


def test_sleep_wake_sync_generate_cycle_keeps_parity(tiny_qwen2_dir, tmp_path):
    requires("vllm")  # a GPU stack without vLLM (only the actor's wheels) runs the rest
    out = tmp_path / "report.json"
    run_on_gpu("tests/vllm/rollout_sync_program.py",
               ["--hf-dir", tiny_qwen2_dir, "--rollout-tp", "1", "--layouts", "1x1",
                "--sleep-cycle", "--dtype", "bfloat16", "--out", str(out)], timeout_s=900)
    entry = json.loads(out.read_text())["layouts"]["1x1"]
    assert_on_cuda(entry["device"])
    assert entry["memory_after_wake"] == "weights only"  # staged: the KV cache comes later
    assert entry["memory_after_generate"] == "awake"
    for key in ("parity_after", "parity_after_sleep"):
        assert entry[key]["tokens"] > 50
        assert entry[key]["mean"] <= BF16_MEAN, (key, entry[key])


def test_engine_routing_is_captured_and_replayed_on_the_gpu(tiny_qwen3_moe_dir, tmp_path):
    """The engine ``algo.routing_replay=rollout`` builds on a GPU (vLLM's V1 runner, no CUDA
    graphs): its routing is captured; in fp32 without TF32 the actor's routers choose the
    engine's experts on (almost) every token and layer (on CPU: all), the engine's experts one
    position off disagree on many, and an actor that follows the engine uses exactly them."""
    requires("vllm")
    out = tmp_path / "report.json"
    run_on_gpu("tests/vllm/rollout_sync_program.py",
               ["--hf-dir", tiny_qwen3_moe_dir, "--rollout-tp", "1", "--layouts", "1x1",
                "--eager-for-routing", "--dtype", "float32", "--out", str(out)],
               timeout_s=900, env=NO_TF32)
    report = json.loads(out.read_text())
    entry = report["layouts"]["1x1"]
    assert_on_cuda(entry["device"])
    assert "routing" in entry, report["routing_unavailable"]
    routing = entry["routing"]
    assert routing["own"]["compared"] > 100, routing
    assert routing["own"]["mismatch_frac"] <= 0.01, routing
    assert routing["shifted"]["mismatch_frac"] > 0.3, routing
    assert routing["followed"]["engine_experts_used"], routing
    assert not routing["misaligned"]["engine_experts_used"], routing


def test_the_weight_source_waits_for_the_stream_that_wrote_a_tensor():
    """The NCCL weight sender's race on a real device: a tensor written on the current stream
    behind a delay (``torch.cuda._sleep``), then read on a side stream that waits for nothing,
    as vLLM's packing streams read what the trainer's weight source hands them. Handed on
    through :func:`~rlep_megatron.rollout.servers.weights.produced`, the reader sees the
    written values."""
    from rlep_megatron.rollout.servers.weights import produced

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for _ in range(3):
        tensor = torch.zeros(1 << 20, device="cuda")
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # about 0.1 s of the current stream's time
        tensor.fill_(1.0)
        side = torch.cuda.Stream()
        for _, ready in produced([("w", tensor)]):
            with torch.cuda.stream(side):
                copy = ready.clone()
        side.synchronize()
        assert float(copy.sum()) == tensor.numel()
