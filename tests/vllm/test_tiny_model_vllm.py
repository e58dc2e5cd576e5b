"""The tiny checkpoints load in vLLM from files and generate; vLLM's log-probs of its own samples
agree with HF transformers on the same tokens (fp32), so vLLM really runs our weights."""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.torchrun import REPO_ROOT

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")


def hf_logprobs(model_dir, prompt_ids, token_ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True,
                                                 dtype=torch.float32)
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1:-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(token_ids)[:, None])[:, 0]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_vllm_generates_with_logprobs_matching_hf(arch, request, tmp_path):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    out = tmp_path / "samples.jsonl"
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "tests/vllm/vllm_generate.py", model_dir, str(out)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    samples = [json.loads(line) for line in open(out)]
    assert len(samples) == 6
    assert all(s["token_ids"] and s["finish_reason"] in ("stop", "length") for s in samples)
    # different samples for the same prompt: the sampler is really sampling
    assert len({tuple(s["token_ids"]) for s in samples}) > 2
    diffs = []
    for sample in samples:
        reference = hf_logprobs(model_dir, sample["prompt_ids"], sample["token_ids"])
        diffs.append((reference - torch.tensor(sample["logprobs"], dtype=torch.float64)).abs())
    mean_abs = torch.cat(diffs).mean().item()
    assert mean_abs <= 1e-4, mean_abs
