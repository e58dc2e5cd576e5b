"""The tiny checkpoints load in vLLM from files and generate; vLLM's log-probs of its own samples
agree with HF transformers on the same tokens (fp32), so vLLM really runs our weights."""
import json
import os
import subprocess
import sys

import pytest
import torch

from rlep_megatron.checkpoint.verify import hf_token_logprobs
from tests.torchrun import REPO_ROOT, once_per_run
from tests import forkserver, requires

pytestmark = pytest.mark.vllm

requires("vllm")


ARCHS = ["qwen2", "qwen3", "qwen3_moe", "llama"]


@pytest.fixture(scope="module")
def samples_files(request, tmp_path_factory) -> dict[str, str]:
    """Every architecture's samples, from one run of the program (one vLLM import, an engine
    per model, built one after another), made once per test run: its tests may land on two
    pytest-xdist workers (worksteal), and the other worker's tiny checkpoints are the same
    files (seed 0), which each test reads for the transformers side."""
    def make(root):
        outs = {arch: str(root / f"{arch}.jsonl") for arch in ARCHS}
        pairs = [item for arch in ARCHS
                 for item in (request.getfixturevalue(f"tiny_{arch}_dir"), outs[arch])]
        env = dict(os.environ, PYTHONPATH=REPO_ROOT, CUDA_VISIBLE_DEVICES="")
        proc = subprocess.run([sys.executable,
                               *forkserver.command(["tests/vllm/vllm_generate.py", *pairs])],
                              cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
        return outs
    return once_per_run(tmp_path_factory, "vllm_samples", make)


@pytest.mark.parametrize("arch", ARCHS)
def test_vllm_generates_with_logprobs_matching_hf(arch, samples_files, request):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    samples = [json.loads(line) for line in open(samples_files[arch])]
    assert len(samples) == 6
    assert all(s["token_ids"] and s["finish_reason"] in ("stop", "length") for s in samples)
    # different samples for the same prompt: the sampler is really sampling
    assert len({tuple(s["token_ids"]) for s in samples}) > 2
    # HF log-probs of the same tokens: column t of the reference is token t given tokens < t
    sequences = [s["prompt_ids"] + s["token_ids"] for s in samples]
    lengths = torch.tensor([len(seq) for seq in sequences])
    input_ids = torch.zeros(len(sequences), int(lengths.max()), dtype=torch.long)
    for row, seq in enumerate(sequences):
        input_ids[row, :len(seq)] = torch.tensor(seq)
    reference = hf_token_logprobs(model_dir, input_ids, lengths)
    diffs = [(reference[row, len(s["prompt_ids"]):len(sequences[row])]
              - torch.tensor(s["logprobs"], dtype=torch.float64)).abs()
             for row, s in enumerate(samples)]
    mean_abs = torch.cat(diffs).mean().item()
    print(f"{arch}: mean |vLLM - HF| log-prob {mean_abs:.2e}, max {torch.cat(diffs).max():.2e}")
    assert mean_abs <= 1e-4, mean_abs
