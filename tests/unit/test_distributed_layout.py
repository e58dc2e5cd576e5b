import pytest

from rlep_megatron.config import ParallelConfig
from rlep_megatron.distributed import validate_parallel_layout

pytestmark = pytest.mark.unit


def layout(tp=1, pp=1, vpp=None, cp=1, ep=1):
    return ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                          virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp,
                          expert_model_parallel_size=ep)


def test_data_parallel_size_is_what_remains():
    assert validate_parallel_layout(8, layout(tp=2, pp=2), 4, 2, 4) == 2
    assert validate_parallel_layout(4, layout(), 4, 2, 4) == 4


@pytest.mark.parametrize("world, cfg, heads, groups, layers, needles", [
    (6, layout(tp=4), 8, 8, 4, ["world size 6", "4"]),
    (4, layout(tp=4), 6, 2, 4, ["tensor_model_parallel_size=4", "attention heads (6)"]),
    (4, layout(tp=4), 8, 2, 4, ["tensor_model_parallel_size=4", "query groups", "heads, 2)"]),
    (4, layout(pp=4), 4, 2, 6, ["num_layers=6", "pipeline_model_parallel_size (4)"]),
    (4, layout(pp=2, vpp=2), 4, 2, 6, ["num_layers=6", "virtual_pipeline", "= 4"]),
])
def test_bad_layouts_name_the_numbers(world, cfg, heads, groups, layers, needles):
    with pytest.raises(ValueError) as err:
        validate_parallel_layout(world, cfg, heads, groups, layers)
    for needle in needles:
        assert needle in str(err.value)


@pytest.mark.parametrize("world, cfg, experts, needles", [
    (2, layout(ep=2), 0, ["expert_model_parallel_size=2", "dense"]),
    (4, layout(ep=4), 6, ["expert_model_parallel_size=4", "6 experts"]),
    (4, layout(tp=2, ep=4), 8, ["sequence_parallel=true", "tensor_model_parallel_size=2"]),
    (4, layout(pp=2, ep=4), 8, ["world size 4", "expert_model_parallel_size (4)", "= 8"]),
])
def test_bad_expert_layouts_name_the_numbers(world, cfg, experts, needles):
    with pytest.raises(ValueError) as err:
        validate_parallel_layout(world, cfg, 4, 2, 4, num_experts=experts)
    for needle in needles:
        assert needle in str(err.value)


def test_expert_parallelism_shares_ranks_with_data_parallelism():
    # EP2 x TP2 on 4 ranks: the dense part has DP 2, the experts are split in two
    cfg = ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                         sequence_parallel=True)
    assert validate_parallel_layout(4, cfg, 4, 2, 4, num_experts=8) == 2


@pytest.mark.parametrize("override, needle", [
    ("parallel.context_parallel_size=2", "context_parallel_size=2 is not supported"),
    ("parallel.sequence_parallel=true", "sequence_parallel=true needs tensor_model_parallel"),
    ("model.params_dtype=float16", "loss scaling"),
])
def test_keys_that_would_be_silently_ignored_are_refused(override, needle):
    from rlep_megatron.config import load_config

    with pytest.raises(ValueError, match=needle):
        load_config(None, [override])
