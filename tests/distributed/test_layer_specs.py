"""Checkpoints across layer specs, the conversion skeleton on a GPU node (faked CUDA), and the
local spec's dense MLP and parameter-gather overlap as built."""
import json

import pytest

from tests.torchrun import run_function

pytestmark = pytest.mark.distributed

PROGRAM = "tests.distributed.layer_spec_program"


def test_the_conversion_skeleton_allocates_nothing_on_a_gpu_node(tiny_qwen2_dir, tmp_path):
    out = tmp_path / "skeleton.json"
    run_function(f"{PROGRAM}:meta_skeleton_on_a_gpu_node", 1,
                 {"hf_dir": tiny_qwen2_dir, "out": str(out)})
    result = json.loads(out.read_text())
    assert result["devices"] == ["meta"] and result["params"] > 0
    assert result["use_te"] is False


def test_a_checkpoint_without_transformer_engine_extra_state_loads(tiny_qwen2_dir, tmp_path):
    out = tmp_path / "extra.json"
    run_function(f"{PROGRAM}:extra_state_is_reconciled", 1,
                 {"hf_dir": tiny_qwen2_dir, "work": str(tmp_path), "out": str(out)})
    result = json.loads(out.read_text())
    assert result["plain_load"] != "loaded"  # what the reconciliation is for
    assert result["dropped"] and result["weights_equal"]
    assert result["kept_value"] == "fp8"
    assert result["missing_param"].startswith("checkpoint does not fit the model: missing")


@pytest.mark.parametrize("tp, replicas", [(2, False), (1, True)])
def test_local_spec_mlp_and_the_param_gather_overlap_only_with_replicas(tiny_qwen2_dir, tmp_path,
                                                                         tp, replicas):
    """Two ranks: at TP2 there is no data-parallel replica and the parameter-gather overlap is
    dropped (the gradient reduction's, which sets the checkpointed bucket layout, stays); at
    DP2 both stay. Every dense layer runs the gated MLP."""
    out = tmp_path / "overlap.json"
    run_function(f"{PROGRAM}:local_spec_mlp_and_overlap", 2,
                 {"hf_dir": tiny_qwen2_dir, "tp": tp, "out": str(out)})
    result = json.loads(out.read_text())
    assert result["mlps"] == ["GatedMLP"]
    assert result["overlap_param_gather"] is replicas
    assert result["overlap_grad_reduce"] is True
