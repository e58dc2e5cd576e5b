"""Megatron actor -> vLLM engine weight sync: after every sync vLLM's log-probs of its own samples
equal the actor's recomputation (fp32, every token within 1e-4), for several actor TP x PP layouts against
rollout TP 1 and 2; an optimizer step moves the engine's log-probs (so the sync really moved
weights); a sync broken midway leaves an engine that refuses to generate until a full sync.
The programs run on local ranks (tests.torchrun.run_ranks) with vLLM in-process on every rank
(external_launcher)."""
import json

import pytest

from tests.torchrun import run_ranks
from tests import requires

pytestmark = [pytest.mark.vllm, pytest.mark.distributed]

requires("vllm")

PARITY_TOL = 1e-4


def run_program(tmp_path, model_dir, nproc, rollout_tp, layouts, fail_sync=False):
    out = tmp_path / "report.json"
    args = ["--hf-dir", model_dir, "--rollout-tp", str(rollout_tp), "--layouts", layouts,
            "--out", str(out)] + (["--fail-sync"] if fail_sync else [])
    run_ranks("tests/vllm/rollout_sync_program.py", nproc, args, timeout_s=900)
    return json.loads(out.read_text())


def check_layouts(report, expected_layouts):
    assert sorted(report["layouts"]) == sorted(expected_layouts)
    for name, entry in report["layouts"].items():
        assert entry["sync1"]["tensors"] == entry["tensors"] > 0, name
        assert entry["buckets"] > 1, name  # small buckets: the stream really is bucketed
        for key in ("parity_before", "parity_after", "parity_t07"):
            assert entry[key]["tokens"] > 50, (name, key)
            # every token, not only on average (measured: max about 1e-6 in fp32)
            assert entry[key]["max"] <= PARITY_TOL, (name, key, entry[key])
        assert entry["parity_t07_at_t1"]["mean"] > 100 * PARITY_TOL, name
        # the step between the two syncs moved the engine's log-probs of the same tokens far
        # beyond the parity tolerance
        assert entry["moved_tokens"] > 0, name
        assert entry["moved_mean_abs"] > 100 * PARITY_TOL, (name, entry["moved_mean_abs"])


def check_sampling(report, dp_size):
    assert report["rollout_dp"] == dp_size
    assert report["reproducible"] is True
    assert report["seed_changes_samples"] is True
    # one prompt four times (spread over the replicas): four different groups of samples
    assert report["same_prompt_distinct_groups"] == 4
    assert set(report["finish_reasons"]) <= {"stop", "length"}
    texts = report["texts_as_vllm_decodes"]
    assert texts["equal"] and texts["checked"] > 0, texts
    assert report["eos_token_id"] == 258


def test_qwen2_rollout_tp2_actor_layouts_and_failed_sync(tmp_path, tiny_qwen2_dir):
    report = run_program(tmp_path, tiny_qwen2_dir, 2, 2, "1x1,2x1,1x2", fail_sync=True)
    check_sampling(report, dp_size=1)
    check_layouts(report, ["1x1", "2x1", "1x2"])
    last = report["layouts"]["1x2"]
    assert last["fail_raised"] == "simulated loss of the weight stream"
    assert last["incomplete_refused"] and "last weight sync failed" in last["incomplete_refused"]
    assert last["parity_recovered"]["max"] <= PARITY_TOL


def test_llama_four_ranks_actor_tp2_pp2_rollout_tp2(tmp_path, tiny_llama_dir):
    """Llama's weights through the stream from actor TP2 x PP2 into two rollout TP2 replicas.
    (Actor layouts 1x1, 2x1 and 1x2 into two rollout TP1 replicas, which Llama also ran here
    once, are the MoE case's below, with the dense layers' weights among them.)"""
    report = run_program(tmp_path, tiny_llama_dir, 4, 2, "2x2")
    check_sampling(report, dp_size=2)
    check_layouts(report, ["2x2"])


def test_qwen3_actor_tp2_and_tp1_rollout_tp2(tmp_path, tiny_qwen3_dir):
    """Qwen3's q/k norms and its head_dim != hidden / heads through the weight stream, from
    the rollout's layout (TP2) and from another (the whole model on each rank)."""
    report = run_program(tmp_path, tiny_qwen3_dir, 2, 2, "2x1,1x1")
    check_sampling(report, dp_size=1)
    check_layouts(report, ["2x1", "1x1"])


def test_qwen3_moe_actor_ep2_tp2_pp2_cp2_rollout_tp1_and_engine_routing(
        tmp_path, tiny_qwen3_moe_dir):
    """Every expert of the tiny Qwen3-MoE into vLLM's MoE layers: from one actor rank, from
    experts split over 2 EP ranks (all-gathered in the stream), from TP2 with sequence
    parallelism (each expert's matrices split over TP), from two pipeline stages and from
    experts split over 2 EP ranks that also split every sequence (CP2), into two rollout
    replicas. And the experts the engine routed each token to (captured on both replicas), at
    the checkpoint's weights: in fp32 the actor's routers choose the same on every token and
    MoE layer (packed micro-batches), the engine's experts one position off
    disagree on about half, and routing by the engine's experts routes every token the engine
    routed through them (a replay mutated to read them one position early fails that)."""
    report = run_program(tmp_path, tiny_qwen3_moe_dir, 2, 1, "1x1,1x1x2,2x1,1x2,1x1x2x2")
    check_sampling(report, dp_size=2)
    check_layouts(report, ["1x1", "1x1x2", "2x1", "1x2", "1x1x2x2"])
    for name, entry in report["layouts"].items():
        routing = entry["routing"]
        # 8 sequences of at least 25 positions on 3 MoE layers, each compared once
        assert routing["own"]["compared"] >= 8 * 25 * 3, (name, routing)
        assert routing["own"]["compared"] == routing["followed"]["compared"], (name, routing)
        assert routing["own"]["mismatch_frac"] <= 0.01, (name, routing)
        assert routing["shifted"]["mismatch_frac"] >= 0.3, (name, routing)
        assert routing["followed"]["engine_experts_used"] is True, (name, routing)
        # a replay that reads the engine's experts one position early is caught
        assert routing["misaligned"]["engine_experts_used"] is False, (name, routing)


def test_extension_methods_do_not_shadow_vllm_worker():
    from vllm.v1.worker.worker_base import WorkerBase
    from vllm.v1.worker.gpu_worker import Worker

    from rlep_megatron.rollout.colocated.worker_ext import RolloutWorkerExtension

    ours = {n for n in vars(RolloutWorkerExtension) if not n.startswith("__")}
    assert ours and all(n.startswith("rlep_") for n in ours)
    assert not ours & (set(dir(Worker)) | set(dir(WorkerBase)))
    assert hasattr(Worker, "reload_weights")  # the vLLM entry point the extension calls
