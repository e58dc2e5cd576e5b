"""``rlep train`` with LoRA end to end: on 2 ranks at actor TP2 the run trains the adapter only
(the rollout engine serves it as a vLLM LoRA on its own base and agrees with the actor on every
token) and resumes exactly from a checkpoint; its checkpoint's adapter exports to PEFT's
format, which peft loads, and merges into an HF checkpoint that transformers loads, both giving
the same log-probs. The adapter mode on a rollout server, and against the merged mode."""
import json
import os
import re

import pytest
import torch

from tests import requires
from tests.e2e.helpers import read_jsonl, recipe, run_rlep, small_task, train_overrides
from tests.e2e.test_train import straight_equals_resumed

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

requires("vllm")

LORA = ["lora.rank=8", "lora.alpha=16", "lora.lr=1e-2", "parallel.tensor_model_parallel_size=2",
        "replay.num_replays_per_prompt=0", "replay.pool_files=[]"]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return small_task(str(tmp_path_factory.mktemp("task")))


def test_a_lora_run_resumes_exactly_and_exports_its_adapter(tiny_qwen2_dir, task, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.torchrun import run_tool_in_process

    # resumed from the step-2 checkpoint of the finished run (a SIGKILL and restart, generic,
    # is tests/e2e/test_train.py's cp2 layout's, test_one_step_off.py's and
    # test_separate_placement.py's)
    metrics = straight_equals_resumed(tiny_qwen2_dir, task, [*LORA, "rollout.lora_sync=adapter"],
                                      tmp_path, steps=3)
    for entry in metrics[1:]:
        # the engine samples with base + scale x B A as the actor computes it, also after
        # the resume (whose engine had no adapter until its first sync)
        assert entry["rollout/logprob_abs_diff"] <= 1e-5, entry["step"]
        assert entry["train/grad_norm"] > 0
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000003"
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    for tool, args in (("tools/lora_export.py", ["--checkpoint", str(checkpoint),
                                                 "--out-dir", str(adapter)]),
                       ("tools/lora_merge.py", ["--adapter", str(adapter), "--hf-dir",
                                                tiny_qwen2_dir, "--out-dir", str(merged)])):
        done = run_tool_in_process(tool, args)
        assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(adapter)) == ["adapter_config.json", "adapter_model.safetensors"]
    # read as plain weights, a LoRA checkpoint would lose its adapters: refused, saying how
    refused = run_tool_in_process("tools/convert_mcore_to_hf.py", [
        "--mcore-dir", str(checkpoint), "--out-dir", str(tmp_path / "plain")])
    assert refused.returncode == 2 and "tools/lora_export.py" in refused.stderr, refused.stderr
    assert not os.path.exists(tmp_path / "plain")
    ids = torch.tensor([list(range(3, 40))])
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, local_files_only=True,
                                                dtype=torch.float32)
    with torch.no_grad():
        base_logits = base(ids).logits
        peft_logits = PeftModel.from_pretrained(base, str(adapter)).eval()(ids).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(
            str(merged), local_files_only=True, dtype=torch.float32)(ids).logits
    torch.testing.assert_close(merged_logits, peft_logits, rtol=0, atol=1e-5)
    # three steps at lr 1e-2 moved B off zero: the adapted model is not the base
    assert (peft_logits - base_logits).abs().max() > 1e-3

    # rlep eval of the LoRA checkpoint samples the adapted policy: greedy answers token for
    # token those of the merged HF checkpoint
    def eval_of(checkpoint_dir, out):
        run_rlep(["eval", "--config", recipe("tiny_cpu_baseline.yaml"),
                  f"model.hf_dir={tiny_qwen2_dir}", f"eval.checkpoint={checkpoint_dir}",
                  f"eval.files=[{task['train']}]", f"eval.output_file={out}",
                  "eval.num_samples_per_prompt=1", "eval.temperature=0", "reward.num_workers=1",
                  "rollout.max_response_tokens=32", f"trainer.output_dir={tmp_path}"])
        return [q["responses"] for q in json.load(open(out))["samples"]]

    from_checkpoint = eval_of(checkpoint, tmp_path / "eval_lora.json")
    assert from_checkpoint == eval_of(merged, tmp_path / "eval_merged.json")
    assert from_checkpoint != eval_of(tiny_qwen2_dir, tmp_path / "eval_base.json")


def test_the_adapter_mode_on_a_server_serves_each_update_as_a_new_adapter(tiny_qwen2_dir, task,
                                                                        tmp_path):
    """Separate placement with ``rollout.lora_sync=adapter``: the job's own vLLM server loads
    the base itself, each sync sends it the adapter alone (loaded as a new vLLM LoRA), and its
    log-probs of its own samples equal the actor's after every sync; no adapter of the job is
    left on the server's host at the end."""
    import glob
    import tempfile

    out = tmp_path / "run"
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "rlep-server-adapters", "*")))
    run_rlep(["train", "--config", recipe("tiny_cpu_rlep.yaml"),
              *train_overrides(tiny_qwen2_dir, task, str(out), steps=2),
              *[o for o in LORA if not o.startswith("parallel.")],
              "rollout.placement=separate", "rollout.num_ranks=1",
              "rollout.lora_sync=adapter", "rollout.server_log_requests=true"], nproc=2)
    entries = read_jsonl(out / "metrics.jsonl")
    assert [e["step"] for e in entries] == [0, 1, 2]
    for entry in entries[1:]:
        assert entry["rollout/logprob_abs_diff"] <= 1e-5, entry["step"]
        assert entry["weight_sync/bytes"] == entries[1]["weight_sync/bytes"] < 400_000
    # an adapter per sync (the first + 2 steps), and the requests of step 2 sampled with the
    # adapter the first step trained (the base alone would be off by far more than 1e-5)
    log = open(out / "rollout_server_0.log").read()
    loaded = re.findall(r"Loaded new LoRA adapter: name '(rlep-[0-9a-f]+-\d+)'", log)
    assert len(set(loaded)) == 3, log[-3000:]
    after = set(glob.glob(os.path.join(tempfile.gettempdir(), "rlep-server-adapters", "*")))
    assert after <= before, after - before


def test_the_adapter_mode_moves_the_adapter_alone_and_samples_the_same_policy(tiny_qwen2_dir,
                                                                              task, tmp_path):
    """``rollout.lora_sync=adapter``: the engine keeps its base and serves the adapter as a vLLM
    LoRA; each sync moves the adapter's bytes only, and the run's every metric equals the
    merged mode's within float noise (the same policy sampled, the same updates). At PEFT's
    default targets for this architecture (``q_proj``, ``v_proj``; the other runs here adapt
    every projection), with a KL term: its reference is the initial adapter on the actor's own
    base, the base itself at the first step."""
    runs = {}
    for mode in ("merged", "adapter"):
        out = tmp_path / mode
        run_rlep(["train", "--config", recipe("tiny_cpu_rlep.yaml"),
                  *train_overrides(tiny_qwen2_dir, task, str(out), steps=3),
                  *[o for o in LORA if not o.startswith("parallel.")],
                  "lora.target_modules=[q_proj,v_proj]", "algo.kl_coef=0.01",
                  f"rollout.lora_sync={mode}"])
        runs[mode] = read_jsonl(out / "metrics.jsonl")
    merged, adapter = runs["merged"], runs["adapter"]
    for a, b in zip(merged[1:], adapter[1:]):
        assert b["rollout/logprob_abs_diff"] <= 1e-5, b["step"]
        assert b["rollout/response_len_mean"] == a["rollout/response_len_mean"]
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-4)
        assert b["train/kl"] == pytest.approx(a["train/kl"], rel=1e-4, abs=1e-9)
        ratio = a["weight_sync/bytes"] / b["weight_sync/bytes"]
        print(f"step {a['step']}: merged {a['weight_sync/bytes']:.0f} B, adapter "
              f"{b['weight_sync/bytes']:.0f} B per sync ({ratio:.1f}x fewer)")
        assert ratio >= 50
    assert adapter[1]["train/ref_logp_abs_diff_max"] == 0  # B = 0: the policy is the base
    assert adapter[2]["train/ref_logp_abs_diff_max"] > 1e-4
