"""Sequence packing: packed log-probs and a packed train step equal the padded ones at TP2xPP2,
DP2 and PP2 with virtual stages (ragged sequences of 5 to 17 tokens, packs of at most 24 tokens)."""
import pytest
import torch

from tests.distributed.actor_train_program import global_batch
from tests.distributed.test_actor_train_step import STEPS, train

pytestmark = pytest.mark.distributed

LAYOUTS = {"TP1": (1, 1, 1), "TP2xPP2": (4, 2, 2), "DP2": (2, 1, 1), "PP2xVPP2": (2, 1, 2)}


def packed_args(layout):
    # a smaller budget than the padded run's 40 (rows x longest): several packs on every rank
    return ("--packing", "--micro-batch-max-tokens", "24",
            *(("--vpp", "2") if layout == "PP2xVPP2" else ()))


# taken in the same launches as the train-step module's steps of the same rank count
for _layout, (_nproc, _tp, _pp) in LAYOUTS.items():
    STEPS.add(("qwen2", _nproc, _tp, _pp, packed_args(_layout)), _nproc, "qwen2",
              ("--tp", _tp, "--pp", _pp, *packed_args(_layout)))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_equals_padded(layout, request):
    nproc, tp, pp = LAYOUTS[layout]
    padded = train(request, "qwen2", 1, 1, 1)
    packed = train(request, "qwen2", nproc, tp, pp, *packed_args(layout))
    _, response_mask, _, _, _ = global_batch()
    lengths = packed["lengths"]
    columns = torch.arange(response_mask.shape[1])
    # every column that has a prefix inside its sequence (prompt tokens included)
    scored = (columns > 0) & (columns < lengths[:, None])
    diff = (packed["clean_old_logp"] - padded["clean_old_logp"]).abs()[scored]
    assert diff.max() <= 1e-6, f"packed vs padded log-probs differ by {diff.max():.2e}"
    # outside the sequences the packed result is exactly 0 (nothing leaks across boundaries)
    assert torch.all(packed["clean_old_logp"][~scored] == 0)
    # the packs really were packs: fewer token slots than padded micro-batches of the budget
    assert packed["metrics"]["padding_frac"] == 0.0 or layout == "PP2xVPP2"
    assert padded["metrics"]["padding_frac"] > 0.1
    assert packed["metrics"]["num_micro_batches"] > 1
    for name, tensor in padded["weights"].items():
        torch.testing.assert_close(packed["weights"][name], tensor, rtol=0, atol=1e-6,
                                   msg=f"{name} packed at {layout}")
    assert packed["metrics"]["pg_loss"] == pytest.approx(padded["metrics"]["pg_loss"], abs=1e-6)
    assert packed["metrics"]["grad_norm"] == pytest.approx(padded["metrics"]["grad_norm"],
                                                           rel=1e-5)
