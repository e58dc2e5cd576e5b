"""The engine contract is the only way in: the training loop (``Trainer``), both rollout
schedulers and the weight-delivery lifecycle, driven with an engine and a request driver written
against ``rlep_megatron/rollout/contract.py`` alone (no vLLM). Checked: the order of the memory
hand-off, the pauses and the weight updates per capability, the version each update carries and
each token was sampled under, and that a failed update leaves the engine refusing to
generate."""
import contextlib
import types

import pytest
import torch

from rlep_megatron.rollout import contract
from rlep_megatron.rollout.response import Response
from rlep_megatron.rollout.scheduler import AheadScheduler, SynchronousScheduler
from rlep_megatron.weight_sync import sync_weights

pytestmark = pytest.mark.unit

WEIGHTS = [("a", torch.ones(2)), ("b", torch.zeros(3, dtype=torch.float64))]


class ContractEngine:
    """Implements :class:`contract.InferenceEngine`, and records what the loop asks of it."""

    eos_token_id = 0
    routing_unavailable = "a contract-only engine"
    capturing_routing = False
    receives_weights = True

    def __init__(self, overlaps_training: bool):
        self.overlaps_training = overlaps_training
        self.calls: list[str] = []
        self.version = None       # the weights' policy version
        self.updating = False
        self.releasing = False
        self.received: list[str] = []
        self.driver = None

    def get_tokenizer(self):
        return types.SimpleNamespace(pad_token_id=None, eos_token_id=0)

    def share(self, prompts, n=1, max_tokens=0):
        return range(len(prompts))

    def check_ready(self):
        if self.updating or self.version is None:
            raise RuntimeError("incomplete weights")

    def generate(self, prompts, n=None, **kwargs):
        self.check_ready()
        self.calls.append(f"generate v{self.version}")
        return [[Response(prompt_index=0, token_ids=[1, 2], logprobs=[-0.5, -0.5], text="",
                          finish_reason="stop")] for _ in prompts]

    def requests(self, cfg):
        self.driver = ContractDriver(self)
        return self.driver

    def all_gather(self, local, num_prompts):
        return local

    @property
    def weights_incomplete(self):
        return self.updating or self.version is None

    def plan_weights(self, plan):
        self.calls.append("plan")

    def start_weight_update(self):
        assert not self.releasing, "weights sent while the devices are released"
        self.updating = True

    def send_weights(self, weights):
        for name, tensor in weights:
            self.received.append(name)
            if name == "fail":
                raise ConnectionError("the stream broke")

    def finish_weight_update(self, version=None):
        self.updating, self.version = False, version
        self.calls.append(f"weights v{version}")

    def abort_weight_update(self, error, tensors_sent):
        self.calls.append(f"abort after {tensors_sent}")

    @contextlib.contextmanager
    def released(self):
        self.releasing = True
        self.calls.append("release")
        yield
        self.releasing = False
        self.calls.append("reclaim")

    def abandon(self):
        self.calls.append("abandon")

    def shutdown(self, process_ending=False):
        self.calls.append(f"shutdown (process ending: {process_ending})")


class ContractDriver:
    """Implements :class:`contract.RequestDriver` over :class:`ContractEngine`."""

    def __init__(self, engine):
        self.engine, self.version = engine, 0
        self.pending: dict = {}

    def submit(self, key, prompt, seed):
        self.pending[key] = None

    def run_until(self, done):
        self.engine.check_ready()
        for key in self.pending:
            if self.pending[key] is None:
                self.pending[key] = self.version
        self.engine.calls.append(f"generate v{self.version}")
        assert done()

    def pause(self, carry_over):
        self.engine.calls.append("pause")

    def resume(self, version):
        self.version = version
        self.engine.calls.append(f"resume v{version}")

    def finished(self, step):
        return all(v is not None for (s, _, _), v in self.pending.items() if s == step)

    def take(self, step, tokenizer):
        keys = sorted(k for k in self.pending if k[0] == step)
        out = [[Response(prompt_index=0, token_ids=[1], logprobs=[-1.0], text="", finish_reason="stop",
                         versions=[(self.pending[k], 1)])] for k in keys]
        for k in keys:
            del self.pending[k]
        return out

    def rollout_metrics(self):
        return {}


def test_the_contract_engine_implements_the_contract():
    engine = ContractEngine(overlaps_training=False)
    assert isinstance(engine, contract.InferenceEngine)
    assert isinstance(engine.requests(None), contract.RequestDriver)


@pytest.fixture(autouse=True)
def one_process(monkeypatch):
    """The loop's collectives on one process: the barrier of a normal close is recorded."""
    from rlep_megatron import distributed

    barriers = []
    monkeypatch.setattr(distributed, "barrier", lambda group=None: barriers.append(group))
    return barriers


def the_loop(engine, scheduler_kind: str, steps: int = 2):
    """A ``Trainer`` around ``engine``: the real loop, schedulers and weight lifecycle; the
    rollout side draws one prompt a step through the scheduler; the learner records."""
    from rlep_megatron.trainer import Trainer

    cfg = types.SimpleNamespace(
        trainer=types.SimpleNamespace(total_steps=steps, validation_interval_steps=0,
                                      max_staleness=1),
        checkpoint=types.SimpleNamespace(save_interval_steps=0),
        rollout=types.SimpleNamespace(num_samples_per_prompt=1, max_response_tokens=4,
                                      carry_over="resume"))
    side = types.SimpleNamespace(sampler=types.SimpleNamespace(next_global_batch=lambda: [0]),
                                 prompt_ids=lambda rows, r: [5, 6], seed=lambda s, r: s,
                                 train_rows=None)
    scheduler = (SynchronousScheduler(engine) if scheduler_kind == "synchronous"
                 else AheadScheduler(engine, cfg, ends_at_checkpoint=lambda step: False))
    sampled = []

    def next_batch(step, timer):
        rows, groups = scheduler.next_round(side, step, 0)
        sampled.append(groups[0][0].versions)
        return types.SimpleNamespace(sequences=[], generated_tokens=0, length=len)

    def update(batch, timer, version):
        assert engine.releasing or engine.overlaps_training
        engine.calls.append(f"train v{version}")
        return {}, {}

    learner = types.SimpleNamespace(
        advantage=lambda batch: None, update=update, train_state_offloaded=False,
        streamer=types.SimpleNamespace(names=[n for n, _ in WEIGHTS],
                                       iter_tensors=lambda: iter(WEIGHTS)))
    trainer = Trainer.__new__(Trainer)
    trainer.__dict__.update(
        cfg=cfg, engine=engine, learner=learner, scheduler=scheduler, step=0, metrics=None,
        val_rows=None, rollout=types.SimpleNamespace(next_batch=next_batch, close=lambda: None),
        checkpoints=types.SimpleNamespace(maybe_resume=lambda trainer: False,
                                          save=lambda trainer: engine.calls.append("save")),
        step_metrics=lambda b, t, o: {}, _log=lambda step, metrics: None)
    trainer.run()
    trainer.close()
    return sampled


@pytest.mark.parametrize("scheduler_kind", ["synchronous", "ahead"])
def test_a_colocated_engine_releases_the_devices_to_each_update(scheduler_kind):
    engine = ContractEngine(overlaps_training=False)
    sampled = the_loop(engine, scheduler_kind)
    pause = ["pause"] if scheduler_kind == "ahead" else []
    resume = ["resume v1"] if scheduler_kind == "ahead" else []
    assert engine.calls == [
        "weights v0",                                   # the dummy weights replaced first
        "generate v0", *pause, "release", "train v0", "reclaim", "weights v1",
        *resume, "generate v1", *pause, "release", "train v1", "reclaim", "weights v2",
        "save", "shutdown (process ending: False)"]
    assert engine.received == ["a", "b"] * 3
    if scheduler_kind == "ahead":
        # step 1's batch was generated ahead, under version 0: one version old when trained
        assert sampled == [[(0, 1)], [(0, 1)]]


def test_an_engine_that_overlaps_training_pauses_only_for_the_weight_update():
    engine = ContractEngine(overlaps_training=True)
    sampled = the_loop(engine, "ahead")
    assert engine.calls == [
        "weights v0", "generate v0", "release", "train v0", "reclaim",
        "pause", "weights v1", "resume v1",             # paused around the update alone
        "generate v1", "release", "train v1", "reclaim", "pause", "weights v2", "resume v2",
        "save", "shutdown (process ending: False)"]
    assert sampled == [[(0, 1)], [(0, 1)]]


def test_a_failed_update_aborts_and_the_engine_refuses_to_generate():
    engine = ContractEngine(overlaps_training=False)
    broken = types.SimpleNamespace(names=["a", "fail", "b"],
                                   iter_tensors=lambda: iter([("a", torch.ones(1)),
                                                              ("fail", torch.ones(1)),
                                                              ("b", torch.ones(1))]))
    with pytest.raises(ConnectionError):
        sync_weights(engine, broken, version=3)
    assert engine.calls[-1] == "abort after 2" and engine.weights_incomplete
    with pytest.raises(RuntimeError, match="incomplete"):
        engine.generate([[1]])
    short = types.SimpleNamespace(names=["a", "b", "c"], iter_tensors=lambda: iter(WEIGHTS))
    with pytest.raises(RuntimeError, match="delivered 2 of 3 tensors"):
        sync_weights(engine, short, version=4)
    # a stream that ends short is never declared complete
    assert engine.calls[-1] == "abort after 2" and engine.weights_incomplete
    result = sync_weights(engine, types.SimpleNamespace(names=["a", "b"],
                                                        iter_tensors=lambda: iter(WEIGHTS)), 5)
    assert (result["tensors"], result["bytes"]) == (2, 2 * 4 + 3 * 8)
    assert engine.version == 5 and not engine.weights_incomplete


def test_a_failed_job_abandons_the_engine_without_a_collective(one_process):
    from rlep_megatron.trainer import Trainer

    engine = ContractEngine(overlaps_training=True)
    trainer = Trainer.__new__(Trainer)
    trainer.__dict__.update(engine=engine, metrics=None,
                            rollout=types.SimpleNamespace(close=lambda: None))
    trainer.close(failed=True)
    assert engine.calls == ["abandon"] and one_process == []
    trainer.close(process_ending=True)  # a normal end in a process that exits right after
    assert engine.calls[1:] == ["shutdown (process ending: True)"] and one_process == [None]
