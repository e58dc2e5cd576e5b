"""On one GPU (``scripts/gpu_check.sh``; skipped without CUDA): the actor in bf16 against
transformers, one train step against the transformers + AdamW reference, and the rollout
engine's sleep / wake / sync / generate cycle with parity after the wake.

Tolerances: bf16 keeps 8 bits of mantissa (relative rounding 2^-9 per operation); the tiny
model's logits are O(1), so per-token log-probs of the same weights differ by O(1e-2) between
two bf16 implementations; fp32 on a GPU may use other reduction orders than the CPU reference,
so its bound is 1e-4 rather than the CPU tests' 2e-6."""
import json

import pytest
import torch

from rlep_megatron.checkpoint.verify import hf_token_logprobs
from tests.torchrun import run_torchrun

pytestmark = pytest.mark.gpu

BF16_MEAN, BF16_MAX = 0.02, 0.15


def token_diffs(logp, reference, lengths):
    positions = torch.arange(reference.shape[1]).unsqueeze(0)
    valid = (positions >= 1) & (positions < lengths[:, None])
    return (logp.double() - reference)[valid].abs()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_bf16_actor_logprobs_match_transformers(arch, request, tmp_path):
    hf_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    out = tmp_path / "logp.pt"
    run_torchrun("tests/distributed/actor_logprob_program.py", 1,
                 ["--hf-dir", hf_dir, "--dtype", "bfloat16", "--out", str(out)])
    result = torch.load(out)
    reference = hf_token_logprobs(hf_dir, result["input_ids"], result["lengths"])
    diffs = token_diffs(result["logp"], reference, result["lengths"])
    assert diffs.numel() > 50
    assert diffs.mean().item() <= BF16_MEAN and diffs.max().item() <= BF16_MAX, (
        diffs.mean().item(), diffs.max().item())


def test_one_train_step_matches_transformers_and_adamw(tiny_qwen2_dir, tmp_path):
    from tests.distributed.test_actor_train_step import reference_step, train

    step = train(tiny_qwen2_dir, 1, 1, 1, tmp_path / "step.pt", "--adam-eps", "1e-6",
                 "--weight-decay", "1.0")
    reference, reference_loss = reference_step(tiny_qwen2_dir, step["old_logp"].cpu(),
                                               eps=1e-6, weight_decay=1.0)
    assert step["metrics"]["step_applied"] == 1.0
    assert step["metrics"]["pg_loss"] == pytest.approx(reference_loss, abs=1e-4)
    for name, tensor in step["weights"].items():
        torch.testing.assert_close(tensor.cpu(), reference[name], rtol=0, atol=1e-4, msg=name)


def test_sleep_wake_sync_generate_cycle_keeps_parity(tiny_qwen2_dir, tmp_path):
    out = tmp_path / "report.json"
    run_torchrun("tests/vllm/rollout_sync_program.py", 1,
                 ["--hf-dir", tiny_qwen2_dir, "--rollout-tp", "1", "--layouts", "1x1",
                  "--sleep-cycle", "--dtype", "bfloat16", "--out", str(out)], timeout_s=900)
    entry = json.loads(out.read_text())["layouts"]["1x1"]
    assert entry["memory_after_wake"] == "weights only"  # staged: the KV cache comes later
    assert entry["memory_after_generate"] == "awake"
    for key in ("parity_after", "parity_after_sleep"):
        assert entry[key]["tokens"] > 50
        assert entry[key]["mean"] <= BF16_MEAN, (key, entry[key])
