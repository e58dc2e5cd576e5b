"""Checkpoints across layer specs and the conversion skeleton on a GPU node (faked CUDA)."""
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
