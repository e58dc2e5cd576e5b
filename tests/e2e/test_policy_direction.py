"""The RLEP loss moves the policy the right way on a fixed batch (TP=2 on 2 ranks), replays with
their advantage's sign as fresh responses."""
import json

import pytest

from tests.torchrun import run_function

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]


def test_negative_advantage_tokens_lose_probability(tiny_qwen2_dir, tmp_path):
    out = tmp_path / "change.json"
    run_function("tests.e2e.policy_direction:main", 2,
                 {"hf_dir": tiny_qwen2_dir, "out": str(out), "tp": 2})
    result = json.loads(out.read_text())
    assert result["applied"] == 1.0
    positive, negative = result["change"][0::2], result["change"][1::2]
    assert all(c > 0 for c in positive), result
    assert all(c < 0 for c in negative), result
