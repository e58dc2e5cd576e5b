"""ActorOptimizer's own logic (warmup schedule, non-finite skip) around a stand-in for the
megatron optimizer that records what it is asked to do."""
import math
import types

import pytest
import torch

from rlep_megatron.actor.optimizer import ActorOptimizer
from rlep_megatron.config import OptimConfig, load_config
from tests.torchrun import REPO_ROOT

pytestmark = pytest.mark.unit


class RecordingOptimizer:
    def __init__(self, norms):
        self.norms = list(norms)
        self.param_groups = [{"lr": None}]
        self.calls = []
        self.params = []  # nothing to clip unless a test gives parameters
        self.config = types.SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False)

    def prepare_grads(self):
        self.calls.append("prepare")

    def get_grad_norm(self):
        return self.norms.pop(0)

    def get_parameters(self):
        return self.params

    def step_with_ready_grads(self):
        self.calls.append(("step", self.param_groups[0]["lr"]))


def test_warmup_then_constant_and_non_finite_skip(monkeypatch):
    from megatron.core.optimizer import optimizer as mcore_optimizer

    inner = RecordingOptimizer([2.0, float("nan"), 3.0, float("inf"), 1.0, 0.5])
    inner.params = ["param"]
    # clipping scales by clip_grad / total norm, the norm measured before it
    monkeypatch.setattr(mcore_optimizer, "clip_grad_by_total_norm_fp32",
                        lambda params, max_norm, total_norm, use_decoupled_grad:
                        inner.calls.append(("clip", max_norm, total_norm, tuple(params))))
    optimizer = ActorOptimizer(inner, OptimConfig(lr=1e-6, lr_warmup_steps=3, clip_grad=1.0,
                                                  lr_warmup_unit="optimizer_steps"))
    results = [optimizer.step() for _ in range(6)]
    assert [applied for applied, _ in results] == [True, False, True, False, True, True]
    assert math.isnan(results[1][1]) and results[0][1] == 2.0
    assert optimizer.num_skipped == 2 and optimizer.num_steps == 4
    steps = [call[1] for call in inner.calls if isinstance(call, tuple) and call[0] == "step"]
    # linear warmup over 3 applied steps, then constant; skipped steps do not advance it
    assert steps == pytest.approx([1e-6 / 3, 2e-6 / 3, 1e-6, 1e-6])
    clips = [call for call in inner.calls if call[0] == "clip"]
    assert clips == [("clip", 1.0, norm, ("param",)) for norm in (2.0, 3.0, 1.0, 0.5)]
    state = optimizer.state_dict()
    restored = ActorOptimizer(RecordingOptimizer([]), OptimConfig(
        lr=1e-6, lr_warmup_steps=3, lr_warmup_unit="optimizer_steps"))
    restored.load_state_dict(state)
    assert restored.current_lr() == optimizer.current_lr()


def reference_lrs(lr: float, warmup: int, optimizer_steps_per_training_step: list[int]):
    """The reference's schedule: torch's LambdaLR with the constant-with-warm-up lambda
    (min(1, s / warm-up)), stepped once per training step after that step's updates."""
    import torch

    param = torch.nn.Parameter(torch.zeros(1))
    torch_optimizer = torch.optim.AdamW([param], lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        torch_optimizer, lambda s: float(s) / max(1, warmup) if s < warmup else 1.0)
    lrs = []
    for count in optimizer_steps_per_training_step:
        lrs += [torch_optimizer.param_groups[0]["lr"]] * count
        torch_optimizer.step()  # no gradient: nothing moves; keeps the call order torch wants
        scheduler.step()
    return lrs


def run_ours(cfg: OptimConfig, optimizer_steps_per_training_step: list[int]):
    inner = RecordingOptimizer([1.0] * sum(optimizer_steps_per_training_step))
    optimizer = ActorOptimizer(inner, cfg)
    for training_step, count in enumerate(optimizer_steps_per_training_step):
        optimizer.training_step = training_step
        for _ in range(count):
            optimizer.step()
    return [call[1] for call in inner.calls if isinstance(call, tuple) and call[0] == "step"]


def test_warmup_counts_training_steps_like_the_reference():
    plan = [9, 9, 8, 9, 9, 9, 9]  # RLEP: 9 optimizer steps per training step (one short)
    ours = run_ours(OptimConfig(lr=1e-3, lr_warmup_steps=4), plan)
    reference = reference_lrs(1e-3, 4, plan)
    assert ours == pytest.approx(reference, rel=1e-12, abs=0)
    assert ours[:9] == [0.0] * 9  # the reference's first training step runs at lr 0
    assert len(set(ours[9:18])) == 1  # one lr for all optimizer steps of a training step


@pytest.mark.parametrize("recipe", ["rlep.yaml", "dapo_nodyn_bs64.yaml", "official_dapo.yaml"])
def test_7b_recipes_warm_up_as_the_reference(recipe):
    """docs/ALGORITHM.md section 4: lr 1e-6, 10 training steps of linear warm-up, first at lr 0."""
    import os

    cfg = load_config(os.path.join(REPO_ROOT, "examples", recipe))
    assert cfg.optim.lr_warmup_unit == "training_steps"
    plan = [9] * 14
    assert run_ours(cfg.optim, plan) == pytest.approx(reference_lrs(1e-6, 10, plan), rel=1e-12)


def test_offload_releases_grads_then_optimizer_and_restores_in_reverse():
    """``optim.offload_during_rollout`` (GPU only, not run here): the gradient buffers of every
    chunk and the optimizer state leave the GPU through megatron-core's own calls, and come
    back optimizer first (the gradient buffers are zeroed on restore)."""
    from rlep_megatron.actor.optimizer import ActorOptimizer
    from rlep_megatron.config import OptimConfig

    calls = []

    class Chunk:
        def __init__(self, name):
            self.name = name

        def offload_grad_buffers(self):
            calls.append(f"offload grads {self.name}")

        def restore_grad_buffers(self):
            calls.append(f"restore grads {self.name}")

    class MegatronOptimizer:
        def offload_to_cpu(self):
            calls.append("offload optimizer")

        def restore_from_cpu(self):
            calls.append("restore optimizer")

    optimizer = ActorOptimizer(MegatronOptimizer(), OptimConfig())
    chunks = [Chunk("a"), Chunk("b")]
    optimizer.offload(chunks)
    optimizer.restore(chunks)
    assert calls == ["offload grads a", "offload grads b", "offload optimizer",
                     "restore optimizer", "restore grads a", "restore grads b"]


class FakeVLLM:
    """Stands in for ``vllm.LLM`` on a GPU with sleep mode: a level-2 sleep discards the
    weights, a wake-up brings back uninitialised memory, and generating from weights that were
    not reloaded since is an error (as garbage weights would be on a GPU)."""

    def __init__(self, calls):
        self.calls = calls
        self.weights_valid = True

    def sleep(self, level):
        self.calls.append(f"engine sleeps (level {level})")
        if level == 2:
            self.weights_valid = False

    def wake_up(self, tags=None):
        self.calls.append(f"engine wakes {tags}")

    def collective_rpc(self, method, args=()):
        assert method in ("rlep_start_weight_update", "rlep_load_weights",
                          "rlep_finish_weight_update"), method
        if method == "rlep_load_weights":
            for _ in args[0]:
                pass
        if method == "rlep_finish_weight_update":
            self.weights_valid = True
            self.calls.append("weights synced")

    def reset_prefix_cache(self):
        pass

    def get_tokenizer(self):
        return None  # nothing to decode: generate returns no outputs

    def generate(self, requests, params, use_tqdm=False, lora_request=None):
        assert self.weights_valid, "generated from discarded weights"
        self.calls.append("generate")
        return []


def fake_engine(calls):
    """The real :class:`RolloutEngine` (staleness, staged wake-up) around :class:`FakeVLLM`."""
    from rlep_megatron.config import RolloutConfig
    from rlep_megatron.rollout.colocated.engine import RolloutEngine

    engine = object.__new__(RolloutEngine)
    engine.__dict__.update(cfg=RolloutConfig(), rank=0, tp_size=1, dp_size=1, dp_rank=0,
                           sleep_enabled=True, _asleep=False, _kv_cache_asleep=False,
                           _incomplete_reason="started with dummy weights", llm=FakeVLLM(calls),
                           eos_token_id=0)
    return engine


def test_offload_with_a_checkpoint_between_two_steps_keeps_the_engine_usable():
    """``optim.offload_during_rollout``: the checkpoint needs the optimizer state back on the
    GPU, so it comes back only while the engine sleeps and leaves again before the engine
    wakes; that sleep discards the engine's weights, so the weights are synced again before
    the next step's rollout (before, the second step raised IncompleteWeightsError)."""
    import types

    from rlep_megatron.actor.learner import LearningSide
    from rlep_megatron.rollout.scheduler import SynchronousScheduler
    from rlep_megatron.trainer import Trainer

    calls = []
    engine = fake_engine(calls)
    optimizer = types.SimpleNamespace(offload=lambda chunks: calls.append("offload"),
                                      restore=lambda chunks: calls.append("restore"))
    checkpoints = types.SimpleNamespace(save=lambda trainer: calls.append("save"),
                                        maybe_resume=lambda trainer: False)
    streamer = types.SimpleNamespace(names=["w"], iter_tensors=lambda: iter([("w", torch.zeros(2))]))
    batch = types.SimpleNamespace(sequences=[], generated_tokens=0, length=len)

    def next_batch(step, timer):
        engine.generate([[1, 2, 3]], n=1)
        return batch

    cfg = types.SimpleNamespace(
        trainer=types.SimpleNamespace(total_steps=2, validation_interval_steps=0),
        checkpoint=types.SimpleNamespace(save_interval_steps=1))
    learner = LearningSide.__new__(LearningSide)
    learner.__dict__.update(cfg=cfg, optimizer=optimizer, chunks=[],
                            streamer=streamer, offload_train_state=True,
                            _train_state_offloaded=True)
    learner.advantage = lambda b: None
    learner.old_logprob = lambda b, plan, version: (calls.append("old log-probs") or ([], {}))
    learner.train = lambda tb, version: (calls.append("train") or {})
    trainer = Trainer.__new__(Trainer)
    trainer.__dict__.update(
        cfg=cfg, engine=engine, learner=learner, checkpoints=checkpoints, step=0, metrics=None,
        val_rows=None, rollout=types.SimpleNamespace(next_batch=next_batch),
        scheduler=SynchronousScheduler(engine),
        step_metrics=lambda b, t, o: {}, _log=lambda step, metrics: None)
    cfg.rollout = types.SimpleNamespace(num_samples_per_prompt=1, placement="colocated")
    cfg.trainer.mini_batch_size, cfg.trainer.mini_batch_unit = 1, "prompts"
    checkpoints.maybe_resume = lambda trainer: calls.append("resume?") or False
    trainer.run()  # built with the train state offloaded (so the engine could size its cache)
    assert trainer.step == 2
    sleep, wake = "engine sleeps (level 2)", "engine wakes ['weights']"
    checkpoint = [sleep, "restore", "save", "offload", wake, "weights synced"]
    one_step = ["generate", sleep, "restore", "old log-probs", "train", "offload", wake,
                "weights synced"]
    assert calls == [sleep, "restore", "resume?", "offload", wake, "weights synced",
                     "engine wakes ['kv_cache']", *one_step, *checkpoint,
                     "engine wakes ['kv_cache']", *one_step, *checkpoint]
    assert learner._train_state_offloaded and not engine.weights_incomplete


@pytest.mark.parametrize("decay", ["linear", "cosine"])
@pytest.mark.parametrize("decay_steps", [0, 5])
def test_lr_decay_after_the_warm_up_follows_torchs_schedulers(decay, decay_steps):
    """optim.lr_decay against torch's own LinearLR / CosineAnnealingLR stepped once per
    training step after a 3-step warm-up (decay_steps 0: until total_steps = 12), then
    min_lr; the warm-up's steps are unchanged."""
    lr, min_lr, warmup, total = 1e-3, 1e-4, 3, 12
    cfg = OptimConfig(lr=lr, lr_warmup_steps=warmup, lr_decay=decay, min_lr=min_lr,
                      lr_decay_steps=decay_steps)
    length = decay_steps or total - warmup
    param = torch.nn.Parameter(torch.zeros(1))
    reference_optimizer = torch.optim.SGD([param], lr=lr)
    if decay == "linear":
        scheduler = torch.optim.lr_scheduler.LinearLR(
            reference_optimizer, start_factor=1.0, end_factor=min_lr / lr, total_iters=length)
    else:
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(reference_optimizer,
                                                               T_max=length, eta_min=min_lr)
    ours = ActorOptimizer(RecordingOptimizer([]), cfg, total_steps=total)
    constant = ActorOptimizer(RecordingOptimizer([]), OptimConfig(lr=lr, lr_warmup_steps=warmup))
    for step in range(total + 3):
        ours.training_step = constant.training_step = step
        if step < warmup:
            assert ours.current_lr() == constant.current_lr()
            continue
        expected = reference_optimizer.param_groups[0]["lr"] if step - warmup <= length \
            else min_lr
        assert ours.current_lr() == pytest.approx(expected, rel=1e-9), step
        if step - warmup < length:
            reference_optimizer.step()
            scheduler.step()
    assert ours.current_lr() == pytest.approx(min_lr, rel=1e-12)


@pytest.mark.parametrize("override, message", [
    ({"lr_decay": "step"}, "optim.lr_decay must be constant, linear or cosine"),
    ({"min_lr": 2.0}, "optim.min_lr must be between 0 and optim.lr"),
    ({"lr_decay_steps": -1}, "optim.lr_decay_steps must be >= 0"),
])
def test_bad_lr_decay_settings_are_refused(override, message):
    with pytest.raises(ValueError, match=message):
        OptimConfig(lr=1e-3, **override)
