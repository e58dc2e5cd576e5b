"""``rlep train`` end to end on CPU: RLEP with a pool on 2 ranks (actor TP=2, two rollout
replicas), and exact resume on 2 ranks with actor PP=2."""
import json
import math
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.helpers import (CONTRACT_KEYS, read_jsonl, recipe, reference_pool,
                               resume_from_checkpoint, run_rlep, small_task, train_overrides)
from rlep_megatron.data.schema import read_prompt_file, rows_to_table, write_table_atomic
from tests.torchrun import run_tool_in_process
from tests import requires

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

requires("vllm")

G, M = 4, 2


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return small_task(str(tmp_path_factory.mktemp("task")))


@pytest.fixture(scope="module")
def pool(task, tmp_path_factory):
    # one correct and one wrong answer per question: replays are re-scored, not trusted
    return reference_pool(task, str(tmp_path_factory.mktemp("pool") / "pool.parquet"),
                          wrong_second=True)


def test_rlep_two_ranks_actor_tp2(tiny_qwen2_dir, task, pool, tmp_path):
    out = tmp_path / "run"
    run_rlep(["train", "--config", recipe("tiny_cpu_rlep.yaml"),
              *train_overrides(tiny_qwen2_dir, task, str(out), steps=2),
              f"replay.pool_files=[{pool}]", f"replay.num_replays_per_prompt={M}",
              "parallel.tensor_model_parallel_size=2"], nproc=2)
    entries = read_jsonl(out / "metrics.jsonl")
    assert [e["step"] for e in entries] == [0, 1, 2]
    assert "val/tiny_arith/mean@2" in entries[0]
    for entry in entries[1:]:
        for key in CONTRACT_KEYS:
            assert key in entry, key
            assert math.isfinite(entry[key]), (key, entry[key])
        # every training prompt has a pool: M of the G + M responses of each group are replays
        assert entry["replay/fraction"] == pytest.approx(M / (G + M), abs=1e-12)
        assert entry["replay/num_sequences"] == 4 * M
        # replays are re-scored (not assumed correct): each group replays its question's
        # correct and wrong answer (M = 2 = the pool size)
        assert entry["replay/acc_mean"] == 0.5
        assert entry["replay/reward_mean"] == 0.0  # +1 and -1, both far below the overlong zone
        # the engine and the actor agree on every fresh token (fp32, same weights)
        assert entry["rollout/logprob_abs_diff"] <= 1e-4
        assert entry["rollout/logprob_compared_tokens"] == entry[
            "rollout/response_len_mean"] * 4 * G
        # RLEP takes more optimizer steps than the G-only count: 4 x 6 sequences / (2 x 4)
        assert entry["train/num_optimizer_steps"] == 3
    assert "val/tiny_arith/mean@2" in entries[2]
    assert (out / "checkpoints" / "step_00000002" / "meta.json").is_file()
    assert (out / "config.yaml").is_file()

    # the trained checkpoint converts to HF; evaluating the HF files (loaded by vLLM) and the
    # training checkpoint (dist checkpoint -> actor -> weight sync) gives the same samples
    checkpoint = out / "checkpoints" / "step_00000002"
    hf_out = tmp_path / "hf"
    proc = run_tool_in_process("tools/convert_mcore_to_hf.py", [
        "--mcore-dir", str(checkpoint), "--out-dir", str(hf_out), "--hf-config-dir",
        tiny_qwen2_dir])
    assert proc.returncode == 0, proc.stderr[-3000:]
    trained, initial = load_file(hf_out / "model.safetensors"), load_file(
        os.path.join(tiny_qwen2_dir, "model.safetensors"))
    assert trained.keys() == initial.keys()
    assert any(not torch.equal(trained[k], initial[k]) for k in trained)
    # transformers loads the export and gives the log-probs of the training checkpoint's actor
    # (docs/checkpointing.md: exporting to HF)
    proc = run_tool_in_process("tools/verify_conversion.py", [
        "--hf-dir", str(hf_out), "--mcore-dir", str(checkpoint)])
    assert proc.returncode == 0 and "OK" in proc.stdout, (proc.stdout + proc.stderr)[-3000:]
    reports = []
    for source in (checkpoint, hf_out):
        path = tmp_path / f"eval_{source.name}.json"
        run_rlep(["eval", "--config", recipe("tiny_cpu_rlep.yaml"),
                  *train_overrides(tiny_qwen2_dir, task, str(tmp_path / "e"), steps=2),
                  f"eval.checkpoint={source}", f"eval.output_file={path}",
                  "eval.num_samples_per_prompt=4"])
        reports.append(json.loads(path.read_text())["report"])
    assert reports[0] == reports[1]


def test_resume_is_bit_for_bit_with_the_distributed_optimizer(tiny_qwen2_dir, task, pool,
                                                              tmp_path):
    """2 ranks = DP 2 with megatron's distributed optimizer (each rank saves and reloads its
    shard of the Adam state) and its overlapped gradient reduce / parameter gather, rollout TP2. Mini-batches of 23 sequences out of 4 x (G + M) = 24:
    the second holds one sequence, so one DP rank has none and takes part with a masked row.
    Sequence packing on, with the token-balanced split over the DP ranks."""
    common = [f"replay.pool_files=[{pool}]", f"replay.num_replays_per_prompt={M}",
              "rollout.tensor_model_parallel_size=2", "trainer.mini_batch_unit=sequences",
              "trainer.mini_batch_size=23", "trainer.sequence_packing=true",
              "optim.lr_warmup_steps=3", "optim.lr_warmup_unit=training_steps"]
    # 4 straight steps (checkpoints at 2 and 4), then resumed from the step-2 checkpoint with
    # megatron's overlapped gradient reduce-scatter and parameter gather (the defaults, on in
    # the straight run) turned off: the plain reduction after the backward is the same
    # arithmetic, so the redone steps 3 and 4 (step 3's rollouts and log-probs come from the
    # weights after 2 updates) equal the straight run's in every metric
    a = straight_equals_resumed(tiny_qwen2_dir, task, common, tmp_path, steps=4,
                                resume_with=("optim.overlap_grad_reduce=false",
                                             "optim.overlap_param_gather=false"))
    # the steps really trained (the comparison is not between two idle runs)
    assert a[4]["train/grad_norm"] > 0 and a[3]["replay/num_sequences"] > 0
    assert all(e["train/num_optimizer_steps"] == 2 for e in a[1:])
    # the trainer's warm-up counter, as the reference's scheduler: training step s (from 1)
    # runs at lr x (s - 1) / 3, the first at 0, across the resume too
    assert [e["train/lr"] for e in a[1:]] == pytest.approx([0.0, 1e-3 / 3, 2e-3 / 3, 1e-3],
                                                           rel=1e-12, abs=0)
    # packed micro-batches feed no padding; the phases report their throughput
    assert all(e["train/padding_frac"] == 0.0 for e in a[1:])
    assert all(e["timing/train_tokens_per_s"] > 0 for e in a[1:])


def test_dynamic_sampling_keeps_whole_groups_with_signal(tiny_qwen2_dir, task, pool, tmp_path):
    """Official DAPO's filter on a task the untrained model never solves: every group's fresh
    answers fail. With ``replay.policy=rescue`` each of them gets its replays (one correct),
    so its accuracy varies and one round fills the batch, the fresh answers pushed down and
    the replays up; without a pool no group has signal and the run stops with a clear error
    after the allowed rounds. (On this task the default policy, uniform, takes the same
    decisions; where the two differ, tests/unit/test_replay_policy.py.)"""
    out = tmp_path / "dyn"
    run_rlep(["train", "--config", recipe("tiny_cpu_rlep.yaml"),
              *train_overrides(tiny_qwen2_dir, task, str(out), steps=1),
              f"replay.pool_files=[{pool}]", f"replay.num_replays_per_prompt={M}",
              "replay.policy=rescue", "algo.dynamic_sampling=true",
              "algo.max_generation_rounds=3", "trainer.validation_interval_steps=0"])
    (entry,) = read_jsonl(out / "metrics.jsonl")
    assert entry["rollout/acc_mean"] == 0.0
    assert entry["rollout/generation_rounds"] == 1
    assert entry["rollout/num_groups"] == 4 and entry["replay/rescued_groups"] == 4
    assert entry["replay/fraction"] == pytest.approx(M / (G + M), abs=1e-12)
    assert entry["advantage/mean/fresh"] < 0 < entry["advantage/mean/replay"]
    failed = run_rlep(["train", "--config", recipe("tiny_cpu_baseline.yaml"),
                       *train_overrides(tiny_qwen2_dir, task, str(tmp_path / "none"), steps=1),
                       "algo.dynamic_sampling=true", "algo.max_generation_rounds=2",
                       "trainer.validation_interval_steps=0"], check=False)
    assert failed.returncode != 0
    assert "dynamic sampling kept 0 of 4 groups in 2 rounds" in failed.stdout + failed.stderr


@pytest.mark.parametrize("layout", [["replay.policy=unlikely"],
                                    ["parallel.context_parallel_size=2"]],
                         ids=["ep2-dp2-unlikely", "ep2-cp2"])
def test_moe_rlep_with_expert_parallelism_resumes_bit_for_bit(layout, tiny_qwen3_moe_dir, task,
                                                              pool, tmp_path):
    """The tiny Qwen3-MoE (8 experts, top-2) on 2 ranks with its experts split over EP=2
    (dense parts DP=2, or every sequence split over CP=2; distributed optimizer: the chained
    dense / expert optimizers), two rollout replicas, the engine's routing replayed
    (algo.routing_replay=rollout), the load-balancing loss on (EP ranks with fewer
    micro-batches run fillers): contract metrics finite, the engine agrees with the actor on
    every fresh token, in log-probs and in the experts the actor's routers would choose
    themselves (fp32), and step 3 redone from the step-2 checkpoint equals the straight run's
    step 3 in every metric. At DP 2 the replays are chosen by ``replay.policy=unlikely`` (here
    both of a question's pool answers, least likely first), each replica scoring half of the
    candidates: the scores every rank then holds are the old-log-prob pass's, and the resume
    redoes the choice."""
    common = [f"replay.pool_files=[{pool}]", f"replay.num_replays_per_prompt={M}",
              "parallel.expert_model_parallel_size=2", "algo.routing_replay=rollout",
              "algo.moe_aux_loss_coeff=0.001", *layout]
    a = straight_equals_resumed(tiny_qwen3_moe_dir, task, common, tmp_path)
    for entry in a[1:]:
        for key in CONTRACT_KEYS:
            assert math.isfinite(entry[key]), (key, entry[key])
        assert entry["rollout/logprob_abs_diff"] <= 1e-4
        assert entry["replay/num_sequences"] == 4 * M
        # max / mean tokens per expert of the worst layer: 1 (even) to 8 experts / top-2
        assert 1.0 <= entry["moe/load_imbalance"] <= 4.0
        assert entry["moe/load_imbalance_layer"] in (1.0, 2.0, 3.0)  # layer 0 is dense
        # the load-balancing loss (on, weight 1e-3): between 1 (even) and E / k = 4
        assert 1.0 <= entry["moe/aux_loss"] <= 4.0
        # every fresh sequence's positions but its last, on each of the 3 MoE layers
        assert entry["rollout/routing_compared"] >= 3 * 4 * 4 * 20
        assert entry["rollout/routing_mismatch_frac"] <= 0.01
        if "replay.policy=unlikely" in layout:
            assert entry["replay/chosen_logprob_mean"] == pytest.approx(
                -entry["train/old_nll_mean/replay"], abs=1e-5)
    assert a[3]["train/grad_norm"] > 0


# a reward that verifies about half of an untrained model's answers (by the parity of their
# length), so that the online experience pool fills
HALF_REWARD = ("def compute_score(data_source, solution_str, ground_truth):\n"
               "    ok = len(solution_str) % 2 == 0\n"
               "    return {'score': 1.0 if ok else -1.0, 'acc': ok}\n")


@pytest.mark.parametrize("layout", [
    ["parallel.context_parallel_size=2", "model.logprob_chunk_tokens=8",
     "replay.policy=low_pass"],
    ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
     "replay.mode=both", "replay.online_answers_per_question=2",
     "replay.online_low_pass_weight=true"],
], ids=["cp2-chunked-logprobs-low-pass", "tp2-sp-online-replay"])
def test_long_sequence_layouts_train_and_resume_bit_for_bit(layout, tiny_qwen2_dir, task, pool,
                                                            tmp_path):
    """RLEP on 2 ranks with each sequence split over 2 context-parallel ranks (log-probs 8
    tokens at a time) and replays drawn by the questions' tracked pass rates
    (replay.policy=low_pass), or with sequence parallelism at TP2 and online experience replay
    (replay.mode=both: the offline pool plus the run's own verified answers, at most 2 per
    question, replayed toward the questions that failed): contract metrics finite, the engine
    agrees with the actor on every fresh token, and step 3 redone from the step-2 checkpoint
    equals the straight run's step 3 in every metric (the online pool and the pass rates are
    part of the checkpoint; the low_pass run is killed with SIGKILL as step 3's training
    begins, then started again). Both train on the same 4 questions every step with a reward
    that verifies about half of the answers, so that the pass rates and the online pool
    change from step to step. The learning rate decays by a cosine from 1e-3 to 1e-4 over
    the 3 steps, and the resumed step 3 takes it up where the checkpoint left it."""
    common = [f"replay.pool_files=[{pool}]", f"replay.num_replays_per_prompt={M}",
              "optim.lr_decay=cosine", "optim.min_lr=1e-4", *layout]
    online = "replay.mode=both" in layout
    low_pass = "replay.policy=low_pass" in layout
    (tmp_path / "half.py").write_text(HALF_REWARD)
    # the same 4 questions every step, so that a step replays what the previous admitted, or
    # by the pass rates the previous steps left
    few = str(tmp_path / "four.parquet")
    write_table_atomic(rows_to_table(read_prompt_file(task["train"]).select(range(4))), few)
    common += [f"reward.function={tmp_path / 'half.py'}:compute_score",
               "reward.overlong_buffer_tokens=0", f"data.train_files=[{few}]"]
    a = straight_equals_resumed(tiny_qwen2_dir, task, common, tmp_path, kill=low_pass)
    for entry in a[1:]:
        for key in CONTRACT_KEYS:
            assert math.isfinite(entry[key]), (key, entry[key])
        assert entry["rollout/logprob_abs_diff"] <= 1e-4
    assert a[3]["train/grad_norm"] > 0
    # the cosine in float64: training step s (from 1, no warm-up) runs at
    # min + (peak - min) (1 + cos(pi (s - 1) / 3)) / 2
    cosine = [1e-4 + (1e-3 - 1e-4) * (1 + math.cos(math.pi * (s - 1) / 3)) / 2
              for s in (1, 2, 3)]
    assert [e["train/lr"] for e in a[1:]] == pytest.approx(cosine, rel=1e-12, abs=0)
    if online:
        # answers are admitted (capped at 2 per question; most of the untrained model's answers
        # are cut at the budget and never admitted, so a step may admit none), the pool grows
        # past the offline one (48 questions x 2), and later steps replay online answers of
        # earlier steps
        assert a[1]["replay/online_admitted"] > 0
        online_answers = [e["replay/online_answers"] for e in a[1:]]
        assert 0 < online_answers[0] <= online_answers[-1] <= 2 * 4
        assert [e["replay/pool_answers"] for e in a[1:]] == [96 + n for n in online_answers]
        assert a[1]["replay/online_age_mean"] == 0.0  # nothing online before step 1
        assert any(e["replay/online_age_mean"] >= 1 for e in a[2:])
    if low_pass:
        # step 1: every question unseen, all 4 groups replayed; later steps decide by the
        # tracked pass rates of the same 4 questions (every replay is one of M per group)
        assert a[1]["replay/groups_by_pass_rate/unseen"] == 4.0
        assert a[1]["replay/num_sequences"] == 4 * M
        # pass rates between 0 and 1 (about half the answers verify): some groups go without
        # (uniform would replay into all 4 every step), so the resume checks the tracker
        assert any(e["replay/num_sequences"] < 4 * M for e in a[2:])
        for e in a[2:]:
            assert e["replay/groups_by_pass_rate/unseen"] == 0.0
            assert e["replay/pass_rate_questions"] == 4.0
            replayed = sum(e[f"replay/groups_by_pass_rate/{b}"]
                           * e[f"replay/share_by_pass_rate/{b}"]
                           for b in ("lt25", "25to50", "50to75", "ge75"))
            assert e["replay/num_sequences"] == pytest.approx(M * replayed, abs=1e-9)


def straight_equals_resumed(hf_dir, task, common, tmp_path, steps=3, resume_with=(),
                            kill=False):
    """``steps`` straight steps on 2 ranks (checkpoints every 2 steps and at the end), then the
    same run (with the overrides ``resume_with`` added) resumed from its step-2 checkpoint: the
    steps after it redone, and every metric but the timings equal (the steps up to the
    checkpoint are the straight run's own records). ``kill``: the second run is a run of its
    own, killed with SIGKILL as step 3's training begins, then started again. Returns the
    straight run's metrics."""
    out = tmp_path / "run"

    def args_to(directory):
        return ["train", "--config", recipe("tiny_cpu_rlep.yaml"),
                *train_overrides(hf_dir, task, str(directory), steps=steps), *common]

    run_rlep(args_to(out), nproc=2)
    a = read_jsonl(out / "metrics.jsonl")
    if kill:
        out = tmp_path / "killed"
        proc = run_rlep(args_to(out), nproc=2, check=False,
                        env={"RLEP_FAULT_INJECT": "kill@train:3"})
        assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr[-3000:])
        assert [e["step"] for e in read_jsonl(out / "metrics.jsonl")] == [0, 1, 2]
        resumed = run_rlep([*args_to(out), *resume_with], nproc=2)
        assert "step_00000002 (step 2)" in resumed.stdout + resumed.stderr
    else:
        resume_from_checkpoint([*args_to(out), *resume_with], out, step=2)
    b = read_jsonl(out / "metrics.jsonl")
    assert [e["step"] for e in a] == [e["step"] for e in b] == list(range(steps + 1))
    for x, y in zip(a, b):
        keys = {k for k in x if not k.startswith("timing/")}
        assert keys == {k for k in y if not k.startswith("timing/")}
        assert {k: x[k] for k in keys} == {k: y[k] for k in keys}, x["step"]
    return a


def transformers_qwen3_moe(tiny_dir: str, out: str) -> str:
    """A Qwen3-MoE made by transformers' own config class and ``save_pretrained``, in sizes
    vLLM's CPU experts must pad: hidden 96, head_dim 32, 4 heads / 2 KV heads, 8 experts
    top-2 of intermediate 48 (the CPU kernel pads it to 64), layer 0 dense, untied; the tiny
    model's tokenizer."""
    import shutil

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    with open(os.path.join(tiny_dir, "config.json")) as f:
        tiny = json.load(f)
    config = Qwen3MoeConfig(
        vocab_size=tiny["vocab_size"], hidden_size=96, head_dim=32, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=48, intermediate_size=192, mlp_only_layers=[0],
        decoder_sparse_step=1, tie_word_embeddings=False, max_position_embeddings=512,
        bos_token_id=tiny.get("bos_token_id"), eos_token_id=tiny.get("eos_token_id"),
        pad_token_id=tiny.get("pad_token_id"))
    torch.manual_seed(0)
    shutil.copytree(tiny_dir, out, ignore=shutil.ignore_patterns("*.safetensors",
                                                                 "config.json"))
    Qwen3MoeForCausalLM(config).save_pretrained(out)
    return out


def test_a_transformers_made_moe_whose_experts_vllm_pads_trains(tiny_qwen3_moe_dir, task,
                                                               tmp_path):
    """The MoE of a user's own transformers checkpoint, with an expert intermediate size that
    vLLM's CPU kernel pads (48 -> 64): 2 steps at EP2 on 2 ranks, the weight sync into the
    engine in between; after it the engine's log-probs equal the actor's. (The padding is the
    engine's, whatever the actor's layout: the experts reach it whole, all-gathered here; the
    stream from an actor rank that holds every expert is tests/vllm/test_rollout_weight_sync.py's
    MoE layout 1x1.)"""
    model = transformers_qwen3_moe(tiny_qwen3_moe_dir, str(tmp_path / "model"))
    out = tmp_path / "run"
    run_rlep(["train", "--config", recipe("tiny_cpu_rlep.yaml"),
              *train_overrides(model, task, str(out), steps=2), "replay.pool_files=[]",
              "replay.num_replays_per_prompt=0", "trainer.validation_interval_steps=0",
              "checkpoint.save_interval_steps=0", "parallel.expert_model_parallel_size=2"],
             nproc=2)
    steps = read_jsonl(out / "metrics.jsonl")
    assert [e["step"] for e in steps] == [1, 2]  # (no validation step 0)
    # step 2 generated with the weights synced after step 1
    assert steps[1]["rollout/logprob_abs_diff"] <= 1e-4
    assert steps[1]["train/grad_norm"] > 0
