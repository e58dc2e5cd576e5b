"""One-step-off rollout's engine requests carried over a weight update (``rollout.carry_over``):
each token's recorded log-prob is that of the policy version its span names, checked against
transformers' teacher-forced log-probs of that version's checkpoint (fp32)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from rlep_megatron.checkpoint.verify import hf_token_logprobs
from rlep_megatron.tiny_model import make_tiny_model
from tests import forkserver, requires
from tests.torchrun import REPO_ROOT, _env, once_per_run, store_port

pytestmark = pytest.mark.vllm

requires("vllm")


@pytest.fixture(scope="module")
def run(tiny_qwen2_dir, tmp_path_factory):
    """The program's report, made once per test run (its tests may land on two pytest-xdist
    workers; the other worker's tiny Qwen2 is the same files, seed 0)."""
    def make(root):
        other = make_tiny_model(str(root / "tiny-qwen2-seed1"), seed=1, arch="qwen2")
        out = root / "out.json"
        proc = subprocess.run([sys.executable, *forkserver.command([
                               "tests/vllm/carry_over_program.py", tiny_qwen2_dir, other,
                               str(out)])], cwd=REPO_ROOT,
                              env=_env({"MASTER_PORT": str(store_port())}),
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
        return {"other": other, "report": json.load(open(out))}
    made = once_per_run(tmp_path_factory, "carry_over", make)
    return {"0": tiny_qwen2_dir, "1": made["other"], "2": tiny_qwen2_dir}, made["report"]


def teacher_forced(model_dir: str, response: dict) -> torch.Tensor:
    """transformers' log-prob of each response token given its prompt and the tokens before."""
    sequence = response["prompt"] + response["token_ids"]
    reference = hf_token_logprobs(model_dir, torch.tensor([sequence]),
                                  torch.tensor([len(sequence)]))
    return reference[0, len(response["prompt"]):]


def test_resumed_tokens_carry_the_log_prob_of_the_version_that_sampled_them(run):
    models, out = run
    responses = out["resume"]
    assert len(responses) == 6
    carried = [r for r in responses if [v for v, _ in r["versions"]] == [0, 1]]
    assert carried, [r["versions"] for r in responses]  # six steps in, none had finished
    worst, control = 0.0, []
    for response in responses:
        assert sum(n for _, n in response["versions"]) == len(response["token_ids"])
        assert response["versions"][0][0] == 0  # started under version 0
        start = 0
        for version, count in response["versions"]:
            recorded = torch.tensor(response["logprobs"][start:start + count], dtype=torch.float64)
            reference = teacher_forced(models[str(version)], response)[start:start + count]
            worst = max(worst, float((recorded - reference).abs().max()))
            if version == 1:  # the same tokens under the other version: far off
                wrong = teacher_forced(models["0"], response)[start:start + count]
                control.append(float((recorded - wrong).abs().max()))
            start += count
    print(f"max |recorded - teacher-forced| {worst:.2e}; other version {min(control):.2e}")
    assert worst <= 1e-5
    assert min(control) > 1e-2


def test_restarted_requests_start_over_under_the_new_version(run):
    models, out = run
    for response in out["restart"]:
        # the six tokens sampled under version 1 were dropped: every token is version 2's
        assert response["versions"] == [[2, len(response["token_ids"])]]
        assert len(response["token_ids"]) == 24 or response["finish_reason"] == "stop"
        reference = teacher_forced(models["2"], response)
        recorded = torch.tensor(response["logprobs"], dtype=torch.float64)
        assert float((recorded - reference).abs().max()) <= 1e-5
