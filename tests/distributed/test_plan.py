"""``rlep plan`` against what the actor really holds: parameter, gradient-buffer and optimizer
elements counted on the built model and its megatron optimizer at several layouts, and the
activation estimate against the bytes autograd saves in a real forward pass."""
import contextlib
import json
import os
import re

import pytest

from tests.torchrun import REPO_ROOT, Cases, command_in_this_process

pytestmark = pytest.mark.distributed

# a mid-size model (hidden 1024, 8 layers, GQA 16/4 heads, SwiGLU 2816) for the activations
MID_SIZE = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1024,
            "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
            "num_key_value_heads": 4, "vocab_size": 1000, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}


def wide_config(tiny_qwen2_dir: str) -> dict:
    """The tiny Qwen2 with norms and biases that are not multiples of 64 elements."""
    with open(os.path.join(tiny_qwen2_dir, "config.json")) as f:
        hf_config = json.load(f)
    hf_config.update(hidden_size=72, head_dim=18, intermediate_size=100)
    return hf_config


def model_dirs(root, request) -> dict[str, str]:
    """Directories holding only the config.json of the cases' own model shapes."""
    dirs = {}
    for word, config in (("WIDE", wide_config(request.getfixturevalue("tiny_qwen2_dir"))),
                         ("MID", MID_SIZE)):
        directory = root / word.lower()
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(config))
        dirs[word] = str(directory)
    return dirs


def read_json(path: str):
    with open(path) as f:
        return json.load(f)


# the memory program's cases; those of one rank count run in one launch
MEMORY = Cases("tests/distributed/memory_program.py", "memory_cases", placeholders=model_dirs,
               load=read_json)
LAYOUTS = [
    ("qwen2", 1, 1, 1, 1, 1),   # one rank, tied embeddings
    ("qwen3_moe", 1, 1, 1, 1, 1),  # one rank, every expert on it
    ("qwen2", 2, 2, 1, 1, 1),   # TP2, tied embeddings
    ("qwen2", 2, 1, 2, 1, 1),   # PP2: the last stage's own copy of the tied output weight
    ("qwen3", 4, 1, 2, 1, 1),   # PP2 x DP2: the optimizer state sharded over DP
    ("qwen3_moe", 2, 1, 1, 2, 1),  # EP2: experts split, their state over the expert DP
    ("qwen3", 4, 1, 1, 1, 2),   # CP2 x DP2: the optimizer state sharded over DP x CP
]
for _arch, _nproc, _tp, _pp, _ep, _cp in LAYOUTS:
    MEMORY.add((_arch, _nproc, _tp, _pp, _ep, _cp), _nproc, _arch,
               ["--state", "--tp", _tp, "--pp", _pp, "--ep", _ep, "--cp", _cp,
                *(["--sp"] if _tp > 1 and _ep > 1 else [])])
MEMORY.add("buckets", 2, None, ["--hf-dir", "WIDE", "--state", "--bucket-size", "5000"])
MEMORY.add("activations", 1, None, ["--hf-dir", "MID", "--activations", "2048"])


def rlep(*args: str) -> tuple[int, str, str]:
    """``rlep ARGS`` in this process (the planner builds the model on the meta device inside a
    simulated process group, torn down afterwards): exit code, stdout, stderr."""
    from rlep_megatron.cli import main

    with command_in_this_process() as (out, err):
        try:
            code = main(list(args))
        except SystemExit as exit_:
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


def rlep_plan(hf_config: str, gpus: int, *overrides: str, extra=()) -> dict:
    code, out, err = rlep("plan", "--json", "--gpus-per-node", str(gpus), "--hf-config", hf_config,
                          *extra, "model.params_dtype=float32", *overrides)
    assert code == 0, err[-3000:]
    return json.loads(out)


@pytest.mark.parametrize("arch, nproc, tp, pp, ep, cp", LAYOUTS)
def test_plan_counts_what_the_actor_holds(arch, nproc, tp, pp, ep, cp, request):
    hf_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    config = os.path.join(hf_dir, "config.json")
    sp = tp > 1 and ep > 1
    ranks = MEMORY.result((arch, nproc, tp, pp, ep, cp), request)
    planned = rlep_plan(config, nproc, f"parallel.tensor_model_parallel_size={tp}",
                        f"parallel.pipeline_model_parallel_size={pp}",
                        f"parallel.expert_model_parallel_size={ep}",
                        f"parallel.context_parallel_size={cp}",
                        f"parallel.sequence_parallel={sp}",
                        "rollout.tensor_model_parallel_size=1")
    assert len(planned["stages"]) == pp
    for stage in planned["stages"]:
        held = [r for r in ranks if r["stage"] == stage["stage"]]
        assert stage["params"] == held[0]["dense"] + held[0]["expert"]
        # the weights and the gradients in megatron's padded buffers, and the Adam moments (two
        # float32 elements per parameter element) of the rank whose shards hold the most
        assert stage["param_bytes"] / 4 == max(r["param_buffer_elements"] for r in held)
        assert stage["grad_bytes"] / 4 == max(r["grad_elements"] for r in held)
        assert stage["optimizer_bytes"] / 4 == max(r["optimizer_elements"] for r in held)
    if ep > 1:
        assert ranks[0]["expert"] > 0


def test_plan_lays_out_gradient_buckets_as_megatron(tiny_qwen2_dir, request):
    """Several gradient buckets (overlapped reduction, 5000-element buckets) at DP2 on a model
    whose norms and biases are not multiples of 64 elements (hidden 72): parameters aligned,
    every bucket padded to equal shards, parameters straddling the shards. The buffer and each
    rank's optimizer state are what megatron's DDP and distributed optimizer allocate."""
    from rlep_megatron import plan
    from rlep_megatron.config import load_config

    hf_config = wide_config(tiny_qwen2_dir)
    ranks = MEMORY.result("buckets", request)
    cfg = load_config(None, ["model.params_dtype=float32", "parallel.tensor_model_parallel_size=1",
                             "optim.overlap_grad_reduce=true"])
    (counted,) = plan.stage_params(hf_config, cfg, 2)
    params = counted.dense_chunks[0]
    buckets, ranges = plan.ddp_buffer_layout(params, 2, True, 5000)
    assert len(buckets) > 3
    grads, state = plan.buffer_elements(counted, cfg, 0, 2, 1, 1, bucket_size=5000)
    assert grads == ranks[0]["grad_elements"] == ranks[1]["grad_elements"]
    assert grads > sum(numel for numel, _ in params)  # the padding is there
    per_rank = plan.optimizer_shard_elements(buckets, ranges, 2)
    assert [2 * held for held in per_rank] == [r["optimizer_elements"] for r in ranks]
    assert per_rank[0] != per_rank[1] and state == max(per_rank)
    one_bucket, _ = plan.buffer_elements(counted, cfg, 0, 2, 1, 1, bucket_size=10 ** 9)
    assert one_bucket < grads  # each bucket's own padding counted


def test_activation_estimate_matches_the_saved_tensors(request, tmp_path):
    """A mid-size model (hidden 1024, 8 layers, GQA 16/4 heads, SwiGLU 2816) on 2048 tokens:
    the planner's local-spec activation bytes within 20% of what autograd saves on CPU."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(MID_SIZE))
    measured = MEMORY.result("activations", request)["saved_bytes"]
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
    # every peak under 90% of an H100's usable 79.6 GiB, 3 GiB of overhead per GPU included
    assert result["gpu_mem_gib"] == 79.6 and result["assumptions"]["overhead_gib"] >= 3
    assert max(result["peak_train_gib"], result["peak_rollout_gib"]) < 0.9 * 79.6
    assert result["peak_fraction"] < 0.9 and not result["advice"]
    # and the recipe's own comment says what the planner says
    with open(os.path.join(REPO_ROOT, "examples", f"{recipe}.yaml")) as f:
        said = re.search(r"training peak ([\d.]+) GiB, rollout peak ([\d.]+) GiB", f.read())
    assert (float(said[1]), float(said[2])) == (round(result["peak_train_gib"], 1),
                                                round(result["peak_rollout_gib"], 1))
    assert result["params_per_gpu"] == max(s["params"] for s in result["stages"])
    if recipe == "rlep_16k":
        tight = rlep_plan(config, gpus, "model.params_dtype=bfloat16",
                          "model.recompute_activations=false",
                          "parallel.sequence_parallel=false",
                          "trainer.micro_batch_max_tokens=32768", extra=extra)
        assert not tight["fits"] and tight["peak_train_gib"] > 80
        assert any("recompute_activations" in advice for advice in tight["advice"])


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_step_flops_match_a_count_of_the_transformers_forward(arch, request):
    """The planner's FLOPs of one full-length forward (its rollout figure for one sequence)
    against torch's FLOP counter on transformers' own forward (eager attention, the MoE's
    per-expert loop over the tokens routed to it) at two lengths, which separate the part
    linear in the length (2 x the parameters a token passes through, the output layer
    included) from the quadratic one (attention: the counter sees the full score matrix, the
    planner counts its causal half)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    hf_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    # eager experts: the counter does not see the grouped GEMM transformers uses by default
    experts = {"experts_implementation": "eager"} if arch == "qwen3_moe" else {}
    model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True,
                                                 dtype=torch.float32,
                                                 attn_implementation="eager", **experts)
    ours, counted = {}, {}
    for length in (64, 192):
        planned = rlep_plan(os.path.join(hf_dir, "config.json"), 1,
                            "data.train_batch_size=1", "rollout.num_samples_per_prompt=1",
                            f"data.max_prompt_tokens={length // 2}",
                            f"rollout.max_response_tokens={length // 2}")
        ours[length] = planned["flops_per_step"]["rollout"]
        tokens = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(0))
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(tokens)
        counted[length] = counter.get_total_flops()

    def split(flops):  # a L + b L^2 at the two lengths -> (a, b)
        b = (flops[192] / 192 - flops[64] / 64) / (192 - 64)
        return flops[64] / 64 - b * 64, b

    (ours_linear, ours_square), (counted_linear, counted_square) = split(ours), split(counted)
    # the planner's 2 N also counts the layers' norm weights, which take part in no matrix
    # product (these models have no biases; the final norm is counted with the embeddings)
    norms = sum(p.numel() for name, p in model.named_parameters()
                if "norm" in name and ".layers." in name)
    assert ours_linear - 2 * norms == pytest.approx(counted_linear, rel=1e-9)
    assert ours_square == pytest.approx(counted_square / 2, rel=1e-9)


def test_lora_train_flops_match_a_count_of_a_peft_models_forward_and_backward(tiny_qwen3_dir):
    """With LoRA the planner's train FLOPs of one sequence (the frozen weights: forward and
    input gradients, no weight gradient; the adapters and attention: forward and both
    gradients) against torch's FLOP counter on peft's model over transformers, its base frozen,
    forward and backward (the embedding output requires grad, as the actor makes it), at two
    lengths, split as in the forward test above."""
    import torch
    from peft import LoraConfig, get_peft_model
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, local_files_only=True,
                                                dtype=torch.float32, attn_implementation="eager")
    norms = sum(p.numel() for name, p in base.named_parameters()
                if "norm" in name and ".layers." in name)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                            target_modules="all-linear"))
    ours, counted, full = {}, {}, {}
    for length in (64, 192):
        shape = ("data.train_batch_size=1", "rollout.num_samples_per_prompt=1",
                 "replay.num_replays_per_prompt=0", f"data.max_prompt_tokens={length // 2}",
                 f"rollout.max_response_tokens={length // 2}")
        config = os.path.join(tiny_qwen3_dir, "config.json")
        ours[length] = rlep_plan(config, 1, *shape, "lora.rank=4")["flops_per_step"]["train"]
        full[length] = rlep_plan(config, 1, *shape)["flops_per_step"]["train"]
        tokens = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(0))
        embeds = model.get_input_embeddings()(tokens).detach().requires_grad_()
        with FlopCounterMode(display=False) as counter:
            model(inputs_embeds=embeds).logits.sum().backward()
        counted[length] = counter.get_total_flops()

    def split(flops):
        b = (flops[192] / 192 - flops[64] / 64) / (192 - 64)
        return flops[64] / 64 - b * 64, b

    (ours_linear, ours_square), (counted_linear, counted_square) = split(ours), split(counted)
    # the norm weights (in the planner's N, in no matrix product) pass twice: 2 x 2 N
    assert ours_linear - 4 * norms == pytest.approx(counted_linear, rel=1e-9)
    assert ours_square == pytest.approx(counted_square / 2, rel=1e-9)
    assert ours[192] < 0.8 * full[192]  # no weight gradients of the base


def test_the_lora_recipe_fits_one_gpu_where_full_fine_tuning_does_not():
    """``examples/rlep_lora.yaml`` (the 7B RLEP recipe with rank-32 adapters and their own
    ``lora.lr``) on one H100: the LoRA job fits, the same job without LoRA (planned beside it)
    does not, as docs/lora.md's table says."""
    code, out, err = rlep("plan", "--nodes", "1", "--gpus-per-node", "1", "--config",
                          os.path.join(REPO_ROOT, "examples", "rlep_lora.yaml"), "--hf-config",
                          os.path.join(REPO_ROOT, "examples", "model_shapes",
                                       "qwen2.5-math-7b.json"))
    assert code == 0, err[-2000:]
    assert "verdict (an estimate): FITS (train peak 29.9 GiB" in out, out[-2000:]
    assert "full fine-tuning on these GPUs: train peak 142.0 GiB" in out
    assert "(does not fit)" in out


def test_plan_refuses_bad_input(tiny_qwen2_dir):
    config = os.path.join(tiny_qwen2_dir, "config.json")
    for args, message in (
            (["--gpus-per-node", "3", "parallel.tensor_model_parallel_size=2"], "not divisible"),
            (["--nodes", "3", "parallel.tensor_model_parallel_size=2"], "world size 3"),
            (["--gpus-per-node", "2", "--gpu", "v100"], "--gpu must be one of"),
            (["--gpus-per-node", "2", "--gpu-mem-gib", "0"], "--gpu-mem-gib must be > 0"),
            # the old spelling meant all GPUs here and GPUs per node in `rlep init`: refused
            (["--gpus", "8"], "--gpus-per-node")):
        code, _, err = rlep("plan", "--hf-config", config, *args)
        assert code != 0 and message in err, err[-2000:]


def test_a_reader_that_stops_early_is_not_an_error(tiny_qwen2_dir):
    """``rlep plan --json | head -1``: the pipe closes before the plan is written out; the
    command ends with 0 and no traceback (it used to end in BrokenPipeError)."""
    from rlep_megatron.cli import main

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone
    pipe = open(write_end, "w")
    with command_in_this_process() as (_, err):
        with contextlib.redirect_stdout(pipe):
            code = main(["plan", "--json", "--gpus-per-node", "2", "--hf-config",
                         os.path.join(tiny_qwen2_dir, "config.json")])
    assert code == 0 and "Traceback" not in err.getvalue(), err.getvalue()[-2000:]
    pipe.close()  # its descriptor now points at /dev/null: closing it raises nothing


def test_plan_counts_dynamic_samplings_generation_rounds(tiny_qwen2_dir):
    """With algo.dynamic_sampling the plan says that each further round adds one rollout's
    FLOPs, up to algo.max_generation_rounds; without it, one round."""
    config = os.path.join(tiny_qwen2_dir, "config.json")
    plain = rlep_plan(config, 1)
    assert plain["max_generation_rounds"] == 1
    code, out, err = rlep("plan", "--gpus-per-node", "1", "--hf-config", config,
                          "algo.dynamic_sampling=true", "algo.max_generation_rounds=4")
    assert code == 0, err[-2000:]
    rollout, total = plain["flops_per_step"]["rollout"], plain["flops_per_step"]["total"]
    assert (f"adds {rollout:.3g} rollout FLOPs (up to 4 rounds: {total + 3 * rollout:.3g} per "
            "step)") in out
    assert "verdict (an estimate): FITS" in out
