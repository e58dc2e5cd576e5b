"""The engine routing capture against a hand-worked schedule: a model runner stand-in lays out
steps the way vLLM's V1 runner does (chunked prefill, a prefix-cache hit, decode steps, a
padded batch), its MoE layers report top-k ids that encode (request, position, layer), and
every request must get back exactly its own rows, at its own positions."""
import numpy as np
import pytest
import torch

from tests import requires

pytestmark = pytest.mark.vllm

requires("vllm")

LAYERS, TOPK = 3, 2
MOE_LAYERS = (1, 2)  # layer 0 dense


def experts(seed, position, layer, prompt_len):
    """The stand-in model's routing: prompt positions depend on the position only (the same
    prefix routes alike in every request), response positions on the request too."""
    base = position * 7 + layer if position < prompt_len else seed * 13 + position * 3 + layer
    return [base % 64, (base + 1) % 64]


class Layer(torch.nn.Module):
    def __init__(self, layer_id):
        super().__init__()
        self.layer_id, self.capture_fn = layer_id, None


class Runner:
    """What :class:`RoutingCapture` reads of vLLM's V1 model runner."""

    def __init__(self):
        from types import SimpleNamespace

        self.device = torch.device("cpu")
        self.compilation_config = None
        self.scheduler_config = SimpleNamespace(max_num_batched_tokens=64)
        self.model = torch.nn.ModuleList([Layer(layer) for layer in MOE_LAYERS])
        self.input_batch = SimpleNamespace(req_ids=[], num_computed_tokens_cpu=np.zeros(8))
        self.requests = {}

    def get_model(self):
        return self.model

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        return None

    def add(self, req_id, seed, prompt):
        from types import SimpleNamespace

        self.requests[req_id] = SimpleNamespace(sampling_params=SimpleNamespace(seed=seed),
                                                prompt_token_ids=prompt)

    def step(self, scheduled: list[tuple[str, int, int]], padding: int = 0):
        """One engine step: ``(request, first position, tokens)`` in batch order."""
        self.input_batch.req_ids = [r for r, _, _ in scheduled]
        self.input_batch.num_computed_tokens_cpu[:len(scheduled)] = [s for _, s, _ in scheduled]
        counts = np.array([n for _, _, n in scheduled], dtype=np.int32)
        self._prepare_inputs(None, counts)
        for module in self.model:
            rows = [experts(self.requests[r].sampling_params.seed, s + q, module.layer_id,
                            len(self.requests[r].prompt_token_ids))
                    for r, s, n in scheduled for q in range(n)]
            rows += [[63, 62]] * padding  # a padded batch: rows that belong to no request
            if module.capture_fn is not None:
                module.capture_fn(torch.tensor(rows))


def test_each_request_gets_its_own_rows_at_its_positions():
    from rlep_megatron.rollout.routing_capture import RoutingCapture

    runner = Runner()
    capture = RoutingCapture(runner, LAYERS, TOPK)
    prompt = list(range(100, 120))          # 20 tokens, shared by both requests
    other = list(range(100, 110)) + [7] * 5  # shares the first 10 tokens
    runner.add("a", 10, prompt)
    runner.add("b", 11, prompt)
    runner.add("c", 12, other)
    runner.step([("a", 0, 12)])                              # before arming: not kept
    capture.arm()
    runner.step([("a", 0, 12)], padding=3)                   # chunked prefill
    runner.step([("a", 12, 8), ("b", 16, 4), ("c", 10, 5)])  # b: 16 cached, c: 10 cached
    runner.step([("a", 20, 1), ("b", 20, 1), ("c", 15, 1)])  # decode
    runner.step([("b", 21, 1), ("a", 21, 1)])                # a different batch order
    got = capture.take()
    assert sorted(got) == [10, 11, 12]
    # a and b sampled 3 tokens (fed back: 2), c 2 (fed back: 1); the last is never fed back
    lengths = {10: 23, 11: 23, 12: 17}
    for seed, routing in got.items():
        prompt_len = 20 if seed != 12 else 15
        assert routing.shape == (lengths[seed], LAYERS, TOPK)
        assert (routing[:, 0] == -1).all()  # the dense layer
        assert (routing[-1] == -1).all()    # the last token
        for position in range(lengths[seed] - 1):
            for layer in MOE_LAYERS:
                assert routing[position, layer].tolist() == experts(
                    seed, position, layer, prompt_len), (seed, position, layer)
    # disarmed after take: a later step is not kept
    runner.step([("a", 22, 1)])
    assert capture.take() == {}


def test_prefix_rows_are_forgotten_with_the_prefix_cache():
    from rlep_megatron.rollout.routing_capture import RoutingCapture

    runner = Runner()
    capture = RoutingCapture(runner, LAYERS, TOPK)
    prompt = list(range(30, 40))
    runner.add("a", 1, prompt)
    capture.arm()
    runner.step([("a", 0, 10)])
    capture.take()
    capture.reset_prefixes()  # new weights: the cached prefix is recomputed by vLLM...
    runner.add("b", 2, prompt)
    capture.arm()
    runner.step([("b", 8, 2)])  # ...but were it not, its rows would be missing, not stale
    routing = capture.take()[2]
    assert (routing[:8] == -1).all() and (routing[8:10, 1:] >= 0).all()


def test_capture_refuses_runners_it_cannot_read():
    from rlep_megatron.rollout.routing_capture import capture_supported

    class V2Runner:
        device = torch.device("cuda")

    assert "V1 model runner" in capture_supported(V2Runner())
    graphs = Runner()
    graphs.device = torch.device("cuda")
    graphs.compilation_config = type("C", (), {"cudagraph_mode": "CUDAGraphMode.FULL"})()
    assert "CUDA graphs" in capture_supported(graphs)
    graphs.compilation_config.cudagraph_mode = "CUDAGraphMode.NONE"
    assert capture_supported(graphs) is None


def test_a_gpu_engine_is_built_eager_on_the_v1_runner_when_its_routing_is_replayed(
        monkeypatch):
    """On a GPU, routing_replay=rollout builds the engine on vLLM's V1 runner without CUDA
    graphs (where the capture can read it); on CPU nothing changes; an environment that asks
    for the V2 runner is refused on either. The variable means to vLLM what this module assumes."""
    import vllm.envs

    from rlep_megatron.rollout.routing_capture import eager_v1_engine_settings

    assert eager_v1_engine_settings(False, {}) == ({}, {})
    eager, variables = eager_v1_engine_settings(True, {})
    assert eager == {"enforce_eager": True} and variables == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert eager_v1_engine_settings(True, {"VLLM_USE_V2_MODEL_RUNNER": "0"})[0] == eager
    for cuda in (True, False):
        with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER=1 asks for V2"):
            eager_v1_engine_settings(cuda, {"VLLM_USE_V2_MODEL_RUNNER": "1"})
    for value, v2 in (("0", False), ("1", True)):
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", value)
        assert vllm.envs.VLLM_USE_V2_MODEL_RUNNER is v2


def test_engine_routing_comes_from_vllms_output_on_a_gpu_and_from_the_hook_on_cpu():
    """rollout.engine_routing: auto reads vLLM's own routed experts on a GPU (V2 runner, CUDA
    graphs kept: no eager, no runner variable) and hooks the V1 runner on CPU; capture on a
    GPU is the eager V1 engine; output is refused on CPU and where V1 is forced."""
    from rlep_megatron.rollout.routing_capture import engine_routing_settings

    assert engine_routing_settings("auto", True, {}) == (
        {"enable_return_routed_experts": True}, {}, "output")
    assert engine_routing_settings("auto", False, {}) == ({}, {}, "capture")
    assert engine_routing_settings("capture", True, {}) == (
        {"enforce_eager": True}, {"VLLM_USE_V2_MODEL_RUNNER": "0"}, "capture")
    with pytest.raises(ValueError, match="CPU build lacks"):
        engine_routing_settings("output", False, {})
    with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER=0 asks for V1"):
        engine_routing_settings("output", True, {"VLLM_USE_V2_MODEL_RUNNER": "0"})
    with pytest.raises(ValueError, match="must be one of"):
        engine_routing_settings("v2", True, {})
    # vLLM 0.32 returns the experts to the first rank of a TP engine only: such an engine
    # captures (auto), and output is refused
    assert engine_routing_settings("auto", True, {}, tensor_parallel_size=2)[2] == "capture"
    with pytest.raises(ValueError, match="an engine of one GPU"):
        engine_routing_settings("output", True, {}, tensor_parallel_size=2)
    # the engine's keyword is one vLLM's engine arguments know
    from vllm.engine.arg_utils import EngineArgs

    assert EngineArgs(model="m", enable_return_routed_experts=True).enable_return_routed_experts


def test_vllms_own_routed_experts_become_signed_rows_per_position():
    """vLLM's ``routed_experts`` (uint8, one row per computed position): int16, cut or filled
    with -1 to prompt + response like the captured ones."""
    from types import SimpleNamespace

    from rlep_megatron.rollout.colocated.engine import _response

    logprobs = SimpleNamespace(token_ids=[5, 6, 7], logprobs=[-1.0] * 3, end_indices=[1, 2, 3])
    completion = SimpleNamespace(token_ids=[5, 6, 7], logprobs=logprobs, finish_reason="stop")
    rows = (np.arange(7 * LAYERS * TOPK) % 200).astype(np.uint8).reshape(7, LAYERS, TOPK)
    tokenizer = SimpleNamespace(decode=lambda ids, **options: "x")
    response = _response(0, completion, tokenizer, rows, prompt=[1] * 5)
    assert response.routing.dtype == np.int16 and response.routing.shape[0] == 8
    assert np.array_equal(response.routing[:7], rows.astype(np.int16))
    assert (response.routing[7] == -1).all()


def test_the_engine_variables_are_put_back_and_nothing_else_touched(monkeypatch):
    """The runner variable is set only while the engine is built (also when building fails);
    what was unset is unset again, and variables the build itself sets stay."""
    import os

    from rlep_megatron.rollout.colocated.engine import _environment

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.delenv("RLEP_TEST_SET_INSIDE", raising=False)
    with _environment({"VLLM_USE_V2_MODEL_RUNNER": "0"}):
        assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
        os.environ["RLEP_TEST_SET_INSIDE"] = "1"
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ
    assert os.environ.pop("RLEP_TEST_SET_INSIDE") == "1"
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0 ")
    with pytest.raises(RuntimeError):
        with _environment({"VLLM_USE_V2_MODEL_RUNNER": "0"}):
            raise RuntimeError("the engine failed to build")
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0 "


def test_a_response_gets_one_row_per_position():
    """An engine that runs one more forward after a stop (async scheduling) captures a row past
    the response: it is cut; a missing last row is filled with -1."""
    from types import SimpleNamespace

    from rlep_megatron.rollout.colocated.engine import _response

    logprobs = SimpleNamespace(token_ids=[5, 6, 7], logprobs=[-1.0] * 3, end_indices=[1, 2, 3])
    completion = SimpleNamespace(token_ids=[5, 6, 7], logprobs=logprobs, finish_reason="stop")
    rows = np.arange(9 * LAYERS * TOPK, dtype=np.int16).reshape(9, LAYERS, TOPK)
    tokenizer = SimpleNamespace(decode=lambda ids, **options: "x")
    longer = _response(0, completion, tokenizer, rows, prompt=[1] * 5)
    assert np.array_equal(longer.routing, rows[:8])
    shorter = _response(0, completion, tokenizer, rows[:7], prompt=[1] * 5)
    assert np.array_equal(shorter.routing[:7], rows[:7]) and (shorter.routing[7] == -1).all()
