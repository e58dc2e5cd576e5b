"""``rlep plan`` against what the actor really holds: parameter, gradient-buffer and optimizer
elements counted on the built model and its megatron optimizer at several layouts, and the
activation estimate against the bytes autograd saves in a real forward pass."""
import json
import os
import subprocess
import sys

import pytest

from tests.torchrun import REPO_ROOT, run_torchrun

pytestmark = pytest.mark.distributed

PROGRAM = "tests/distributed/memory_program.py"


def rlep_plan(hf_config: str, gpus: int, *overrides: str, extra=()) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "rlep_megatron.cli", "plan", "--json", "--gpus", str(gpus),
         "--hf-config", hf_config, *extra, "model.params_dtype=float32", *overrides],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("arch, nproc, tp, pp, ep, cp", [
    ("qwen2", 2, 2, 1, 1, 1),   # TP2, tied embeddings
    ("qwen2", 2, 1, 2, 1, 1),   # PP2: the last stage's own copy of the tied output weight
    ("qwen3", 4, 1, 2, 1, 1),   # PP2 x DP2: the optimizer state sharded over DP
    ("qwen3_moe", 2, 1, 1, 2, 1),  # EP2: experts split, their state over the expert DP
    ("qwen3", 4, 1, 1, 1, 2),   # CP2 x DP2: the optimizer state sharded over DP x CP
])
def test_plan_counts_what_the_actor_holds(arch, nproc, tp, pp, ep, cp, request, tmp_path):
    hf_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    config = os.path.join(hf_dir, "config.json")
    layout = ["--tp", str(tp), "--pp", str(pp), "--ep", str(ep), "--cp", str(cp)]
    sp = ["--sp"] if tp > 1 and ep > 1 else []
    run_torchrun(PROGRAM, nproc, ["--hf-config", config, "--state", *layout, *sp,
                                  "--out", str(tmp_path / "state.json")])
    with open(tmp_path / "state.json") as f:
        ranks = json.load(f)
    planned = rlep_plan(config, nproc, f"parallel.tensor_model_parallel_size={tp}",
                        f"parallel.pipeline_model_parallel_size={pp}",
                        f"parallel.expert_model_parallel_size={ep}",
                        f"parallel.context_parallel_size={cp}",
                        f"parallel.sequence_parallel={bool(sp)}",
                        "rollout.tensor_model_parallel_size=1")
    assert len(planned["stages"]) == pp
    for stage in planned["stages"]:
        real = next(r for r in ranks if r["stage"] == stage["stage"])  # the stage's first rank
        assert stage["params"] == real["dense"] + real["expert"]
        assert stage["param_bytes"] == 4 * stage["params"]
        # megatron pads its gradient buffer (and so the optimizer's shards) to aligned sizes
        assert stage["grad_bytes"] / 4 == pytest.approx(real["grad_elements"], rel=0.02)
        assert stage["grad_bytes"] / 4 <= real["grad_elements"]
        assert stage["optimizer_bytes"] / 4 == pytest.approx(real["optimizer_elements"],
                                                             rel=0.02)
    if ep > 1:
        assert ranks[0]["expert"] > 0


def test_activation_estimate_matches_the_saved_tensors(tmp_path):
    """A mid-size model (hidden 1024, 8 layers, GQA 16/4 heads, SwiGLU 2816) on 2048 tokens:
    the planner's local-spec activation bytes within 20% of what autograd saves on CPU."""
    shape = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1024,
             "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
             "num_key_value_heads": 4, "vocab_size": 1000, "max_position_embeddings": 4096,
             "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}
    config = tmp_path / "config.json"
    config.write_text(json.dumps(shape))
    run_torchrun(PROGRAM, 1, ["--hf-config", str(config), "--activations", "2048",
                              "--out", str(tmp_path / "act.json")])
    measured = json.loads((tmp_path / "act.json").read_text())["saved_bytes"]
    planned = rlep_plan(str(config), 1, "trainer.micro_batch_max_tokens=2048",
                        "model.recompute_activations=false", "rollout.tensor_model_parallel_size=1",
                        extra=["--local-spec"])
    estimate = planned["stages"][0]["activation_bytes_without_recompute"]
    assert estimate == pytest.approx(measured, rel=0.2)
    # TransformerEngine's spec keeps less than the local one (fused norms and SwiGLU)
    te = rlep_plan(str(config), 1, "trainer.micro_batch_max_tokens=2048",
                   "rollout.tensor_model_parallel_size=1")
    assert te["stages"][0]["activation_bytes_without_recompute"] < 0.8 * estimate


@pytest.mark.parametrize("recipe, shape, gpus, total, non_embedding", [
    # published sizes: Qwen2.5-7B 7.61B (6.53B without embeddings), Qwen3-8B 8.2B (6.95B),
    # Qwen3-30B-A3B 30.5B (29.9B; 3.3B activated, embeddings included)
    ("rlep", "qwen2.5-math-7b", 64, 7.61e9, 6.53e9),
    ("rlep_16k", "qwen2.5-7b", 64, 7.61e9, 6.53e9),
    ("qwen3_8b_rlep", "qwen3-8b", 64, 8.2e9, 6.95e9),
    ("qwen3_30b_a3b_rlep", "qwen3-30b-a3b", 64, 30.5e9, 3.3e9 - 151936 * 2048 * 2),
])
def test_plan_of_the_recipes(recipe, shape, gpus, total, non_embedding):
    """The shipped recipes fit per the planner, whose model sizes are the published ones; a
    layout without recompute nor SP at 32k tokens per micro-batch does not fit and the advice names the knob."""
    config = os.path.join(REPO_ROOT, "examples", "model_shapes", f"{shape}.json")
    extra = ["--config", os.path.join(REPO_ROOT, "examples", f"{recipe}.yaml")]
    result = rlep_plan(config, gpus, "model.params_dtype=bfloat16", extra=extra)
    assert result["total_params"] == pytest.approx(total, rel=0.01)
    assert result["active_params"] == pytest.approx(non_embedding, rel=0.02)
    assert result["fits"], result["advice"]
    assert 0 < result["peak_train_gib"] < 80 and 0 < result["peak_rollout_gib"] < 80
    assert result["params_per_gpu"] == max(s["params"] for s in result["stages"])
    if recipe == "rlep_16k":
        tight = rlep_plan(config, gpus, "model.params_dtype=bfloat16",
                          "model.recompute_activations=false",
                          "parallel.sequence_parallel=false",
                          "trainer.micro_batch_max_tokens=32768", extra=extra)
        assert not tight["fits"] and tight["peak_train_gib"] > 80
        assert any("recompute_activations" in advice for advice in tight["advice"])


def test_plan_refuses_bad_input(tiny_qwen2_dir):
    config = os.path.join(tiny_qwen2_dir, "config.json")
    for args, message in (
            (["--gpus", "3", "parallel.tensor_model_parallel_size=2"], "not divisible"),
            (["--gpus", "2", "--gpu", "v100"], "--gpu must be one of"),
            (["--gpus", "2", "--gpu-mem-gib", "0"], "--gpu-mem-gib must be > 0")):
        proc = subprocess.run([sys.executable, "-m", "rlep_megatron.cli", "plan", "--hf-config",
                               config, *args], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
