"""Sequence packing: packed log-probs and a packed train step equal the padded ones at TP2xPP2,
DP2 and PP2 with virtual stages (ragged sequences of 5 to 17 tokens, packs of at most 24 tokens)."""
import pytest
import torch

from tests.distributed.actor_train_program import global_batch
from tests.distributed.test_actor_train_step import train

pytestmark = pytest.mark.distributed

LAYOUTS = {"TP1": (1, 1, 1), "TP2xPP2": (4, 2, 2), "DP2": (2, 1, 1), "PP2xVPP2": (2, 1, 2)}


@pytest.fixture(scope="module")
def padded(tiny_qwen2_dir, tmp_path_factory):
    return train(tiny_qwen2_dir, 1, 1, 1, tmp_path_factory.mktemp("padded") / "padded.pt")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_equals_padded(layout, padded, tiny_qwen2_dir, tmp_path):
    nproc, tp, pp = LAYOUTS[layout]
    extra = ["--vpp", "2"] if layout == "PP2xVPP2" else []
    # a smaller budget than the padded run's 40 (rows x longest): several packs on every rank
    packed = train(tiny_qwen2_dir, nproc, tp, pp, tmp_path / "packed.pt", "--packing",
                   "--micro-batch-max-tokens", "24", *extra)
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
