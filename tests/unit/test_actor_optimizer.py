"""ActorOptimizer's own logic (warmup schedule, non-finite skip) around a stand-in for the
megatron optimizer that records what it is asked to do."""
import math

import pytest

from rlep_megatron.actor.optimizer import ActorOptimizer
from rlep_megatron.config import OptimConfig

pytestmark = pytest.mark.unit


class RecordingOptimizer:
    def __init__(self, norms):
        self.norms = list(norms)
        self.param_groups = [{"lr": None}]
        self.calls = []

    def prepare_grads(self):
        self.calls.append("prepare")

    def get_grad_norm(self):
        return self.norms.pop(0)

    def clip_grad_norm(self, clip):
        self.calls.append(("clip", clip))

    def step_with_ready_grads(self):
        self.calls.append(("step", self.param_groups[0]["lr"]))


def test_warmup_then_constant_and_non_finite_skip():
    inner = RecordingOptimizer([2.0, float("nan"), 3.0, float("inf"), 1.0, 0.5])
    optimizer = ActorOptimizer(inner, OptimConfig(lr=1e-6, lr_warmup_steps=3, clip_grad=1.0))
    results = [optimizer.step() for _ in range(6)]
    assert [applied for applied, _ in results] == [True, False, True, False, True, True]
    assert math.isnan(results[1][1]) and results[0][1] == 2.0
    assert optimizer.num_skipped == 2 and optimizer.num_steps == 4
    steps = [call[1] for call in inner.calls if isinstance(call, tuple) and call[0] == "step"]
    # linear warmup over 3 applied steps, then constant; skipped steps do not advance it
    assert steps == pytest.approx([1e-6 / 3, 2e-6 / 3, 1e-6, 1e-6])
    assert ("clip", 1.0) in inner.calls
    state = optimizer.state_dict()
    restored = ActorOptimizer(RecordingOptimizer([]), OptimConfig(lr=1e-6, lr_warmup_steps=3))
    restored.load_state_dict(state)
    assert restored.current_lr() == optimizer.current_lr()
