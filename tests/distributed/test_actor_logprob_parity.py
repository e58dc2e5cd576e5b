"""Megatron actor log-probs vs HF transformers (the independent reference), fp32, on the tiny
Qwen2 (tied, QKV bias) and Llama (untied) checkpoints, at TP1xPP1, TP2xPP1, TP1xPP2, TP2xPP2
(and PP2 x 2 virtual stages), on a right-padded batch of different lengths."""
import pytest
import torch

from rlep_megatron.checkpoint.verify import hf_token_logprobs, max_abs_logprob_diff
from tests.torchrun import run_torchrun

pytestmark = pytest.mark.distributed

PROGRAM = "tests/distributed/actor_logprob_program.py"


# every layout on the tied Qwen2 model (virtual pipeline stages too); Llama and Qwen3 at TP1
# and at TP2 x PP2, which holds both splits
@pytest.mark.parametrize("arch, tp, pp, vpp", [
    ("qwen2", tp, pp, None) for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2))]
    + [("qwen2", 1, 2, 2), ("llama", 1, 1, None), ("llama", 2, 2, None)]
    # Qwen3: q/k norms over heads split by TP, head_dim != hidden / heads
    + [("qwen3", 1, 1, None), ("qwen3", 2, 2, None)])
def test_logprobs_match_transformers(arch, tp, pp, vpp, request, tmp_path):
    hf_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    out = tmp_path / "logp.pt"
    extra = ["--vpp", str(vpp)] if vpp else []
    run_torchrun(PROGRAM, tp * pp, ["--hf-dir", hf_dir, "--tp", str(tp), "--pp", str(pp),
                                    "--out", str(out), *extra])
    result = torch.load(out)
    reference = hf_token_logprobs(hf_dir, result["input_ids"], result["lengths"])
    diff = max_abs_logprob_diff(result["logp"], reference, result["lengths"])
    assert diff <= 1e-5, f"max |delta logprob| = {diff}"
    # entropy over the vocabulary of config.json (320): positive and at most log(320)
    lengths = result["lengths"]
    valid = torch.arange(result["entropy"].shape[1])[None, :] < lengths[:, None]
    valid[:, 0] = False
    entropy = result["entropy"][valid]
    assert (entropy > 0).all() and (entropy <= torch.log(torch.tensor(320.0)) + 1e-4).all()
