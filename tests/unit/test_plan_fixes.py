"""`rlep plan` on the Qwen3-30B-A3B recipe: it fits 8 nodes of 8 H100 under 90%, and on one node
it is refused with planned changes that fit. The one-node optimizer state is re-derived here
from the model's shape: with EP8 on 8 GPUs the experts have no data-parallel replica, so their
Adam moments and fp32 master weights are not sharded."""
import json
import os

import pytest

from rlep_megatron import config as config_lib
from rlep_megatron import plan

pytestmark = pytest.mark.unit

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
GIB = 1024 ** 3


@pytest.fixture(scope="module")
def recipe():
    cfg = config_lib.load_config(os.path.join(EXAMPLES, "qwen3_30b_a3b_rlep.yaml"))
    with open(os.path.join(EXAMPLES, "model_shapes", "qwen3-30b-a3b.json")) as f:
        return cfg, json.load(f)


def expert_params(hf: dict) -> int:
    return (hf["num_hidden_layers"] * hf["num_experts"] * 3 * hf["hidden_size"]
            * hf["moe_intermediate_size"])


def test_eight_nodes_fit_under_the_headroom(recipe):
    cfg, hf = recipe
    result = plan.plan(cfg, hf, 64, gpus_per_node=8)
    assert result["fits"] and result["peak_fraction"] <= plan.PEAK_HEADROOM, result["advice"]
    assert result["fixes"] == []


def test_one_node_is_refused_with_planned_changes_that_fit(recipe):
    cfg, hf = recipe
    result = plan.plan(cfg, hf, 8, gpus_per_node=8)
    assert not result["fits"]
    # Adam's two moments and the fp32 master copy (12 B a parameter) of this rank's 16 of 128
    # experts per layer, unsharded, and of the dense part sharded over its 8 data-parallel
    # ranks (about 1.5e9 parameters: attention, embedding, head, routers, norms)
    total = result["total_params"]
    experts = expert_params(hf)
    derived = 12 * (experts / 8 + (total - experts) / 8)
    assert result["stages"][0]["optimizer_bytes"] == pytest.approx(derived, rel=0.02)
    assert derived / GIB > 40
    fixes = result["fixes"]
    assert fixes, plan.format_plan(result)
    for fix in fixes:
        assert fix["gpus"] > 8, fix  # nothing planned here fits one node
        again = plan.plan(plan._changed(cfg, fix["changes"]), hf, fix["gpus"])
        assert again["fits"] and again["peak_fraction"] <= plan.PEAK_HEADROOM, fix
    text = plan.format_plan(result)
    assert "DOES NOT FIT" in text and "16 GPUs (2 nodes of 8)" in text


def test_a_plan_that_fits_with_margin_lists_no_fixes(recipe):
    cfg, hf = recipe
    small = dict(hf, num_hidden_layers=8)
    result = plan.plan(cfg, small, 8, gpus_per_node=8)
    assert result["fits"] and result["peak_fraction"] <= plan.PEAK_HEADROOM
    assert result["fixes"] == [] and "planned changes" not in plan.format_plan(result)
