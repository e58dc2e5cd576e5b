import pytest
import torch

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
    ("parallel.sequence_parallel=true", "sequence_parallel=true needs tensor_model_parallel"),
    ("model.params_dtype=float16", "loss scaling"),
])
def test_keys_that_would_be_silently_ignored_are_refused(override, needle):
    from rlep_megatron.config import load_config

    with pytest.raises(ValueError, match=needle):
        load_config(None, override.split())


def test_context_parallel_layout_of_the_worked_example():
    """megatron's load-balanced layout: a sequence of 8 tokens in 2 x CP = 4 chunks of 2;
    rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2; a pack pads each sequence (3 and 5
    tokens -> 4 and 8) and keeps the global offsets; per-token values of the micro-batch (the
    routers' token places) follow the tokens, added places filled; a MoE model may combine CP
    with EP."""
    from rlep_megatron.models.context_parallel import chunk_positions, gathered_order, layout

    assert chunk_positions([0, 8], 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_positions([0, 8], 2, 1).tolist() == [2, 3, 4, 5]
    order = gathered_order([0, 8], 2)  # [0, 1, 6, 7, 2, 3, 4, 5] back to 0..7
    assert torch.cat([chunk_positions([0, 8], 2, r) for r in (0, 1)])[order].tolist() == \
        list(range(8))
    ids = torch.arange(1, 9).unsqueeze(0)
    packed = {"cu_seqlens": torch.tensor([0, 3, 8], dtype=torch.int32)}
    lay = layout(ids, packed, cp=2, rank=1)
    assert lay.bounds == [0, 4, 12]
    assert lay.input_ids[0].tolist() == [1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 0, 0]
    assert lay.local.tolist() == [1, 2, 6, 7, 8, 9]  # chunk 1 and 2 of each sequence
    assert lay.original.tolist() == [0, 1, 2, 4, 5, 6, 7, 8]
    # with sequence parallelism at TP 4 each rank needs a multiple of 4: a filler sequence
    assert layout(ids[:, :3], {"cu_seqlens": torch.tensor(
        [0, 3], dtype=torch.int32)}, cp=2, rank=0, multiple=4).bounds == [0, 4, 8]
    assert lay.local_values(ids, fill=-1)[0].tolist() == [2, 3, 6, 7, 8, -1]
    first = layout(ids, packed, cp=2, rank=0)
    assert first.local_values(ids, fill=-1)[0].tolist() == [1, -1, 4, 5, -1, -1]
    mask = torch.zeros(1, 8, dtype=torch.bool)
    assert first.local_values(mask, fill=True)[0].tolist() == \
        [False, True, False, False, True, True]
    rows = torch.tensor([[1, 2, 3], [4, 5, 6]])  # padded rows: 3 columns -> 4, then chunks
    assert layout(rows, None, cp=2, rank=1).local_values(rows, fill=-1).tolist() == \
        [[2, 3], [5, 6]]
    assert layout(rows, None, cp=2, rank=0).local_values(rows, fill=-1).tolist() == \
        [[1, -1], [4, -1]]
    # CP2 x EP2 on 2 ranks: DP 1, the experts split over the two CP ranks
    assert validate_parallel_layout(2, ParallelConfig(context_parallel_size=2,
                                                      expert_model_parallel_size=2),
                                    4, 2, 4, num_experts=8) == 1
