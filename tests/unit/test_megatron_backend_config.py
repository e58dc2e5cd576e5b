"""``rollout.backend=megatron`` before anything runs: the layouts it cannot decode with are
refused naming each setting, the ones it can are accepted; and its sampler's filters against a
float64 re-derivation (the distribution of its draws is tests/distributed's)."""
import math
import os

import pytest
import torch

from rlep_megatron import config as config_lib
from rlep_megatron.rollout.megatron import sampling

pytestmark = pytest.mark.unit

RECIPE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "tiny_cpu_baseline.yaml")
MEGATRON = "rollout.backend=megatron"


@pytest.mark.parametrize("overrides, needle", [
    (["parallel.pipeline_model_parallel_size=2"], "parallel.pipeline_model_parallel_size=2"),
    (["parallel.context_parallel_size=2"], "parallel.context_parallel_size=2"),
    (["parallel.expert_model_parallel_size=2"], "parallel.expert_model_parallel_size=2"),
    (["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
     "parallel.sequence_parallel=true"),
    (["rollout.placement=separate", "rollout.num_ranks=1"], "rollout.placement=separate"),
    (["rollout.tensor_model_parallel_size=2"], "the actor's 1 is the engine's"),
    (["algo.routing_replay=rollout"], "algo.routing_replay=rollout"),
    (["rollout.backend=sglang"], "not one of"),
    (["rollout.megatron_batch_size=0"], "megatron_batch_size must be >= 1"),
])
def test_what_it_cannot_run_is_refused_naming_it(overrides, needle):
    with pytest.raises(ValueError, match=needle):
        config_lib.load_config(RECIPE, [MEGATRON, *overrides])


def test_the_layouts_it_runs_are_accepted():
    cfg = config_lib.load_config(RECIPE, [MEGATRON, "parallel.tensor_model_parallel_size=2",
                                          "rollout.tensor_model_parallel_size=2",
                                          "trainer.max_staleness=1"])
    assert cfg.rollout.backend == "megatron"
    assert config_lib.load_config(RECIPE, []).rollout.backend == "vllm"  # the default


def reference_logprobs(logits: torch.Tensor, temperature: float, top_p: float, top_k: int):
    """float64, one row at a time, written from the definitions: scale, keep the top_k
    largest, then the most likely tokens until their mass reaches top_p, renormalise."""
    out = []
    for row in logits.to(torch.float64):
        z = row / temperature
        ranked = sorted(range(len(z)), key=lambda i: -float(z[i]))
        kept = ranked[:top_k] if top_k > 0 else ranked
        p = torch.softmax(z[kept], 0)
        final, mass = [], 0.0
        for index, prob in zip(kept, p.tolist()):
            if mass >= top_p:
                break
            final.append(index)
            mass += prob
        norm = torch.logsumexp(z[final], 0)
        out.append([float(z[i] - norm) if i in final else -math.inf for i in range(len(z))])
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("temperature, top_p, top_k", [(1.0, 1.0, -1), (0.7, 0.9, -1),
                                                       (1.3, 1.0, 5), (0.5, 0.8, 7)])
def test_processed_logprobs_match_a_float64_rederivation(temperature, top_p, top_k):
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(3)) * 3
    ours = sampling.process_logits(logits, temperature, top_p, top_k).to(torch.float64)
    theirs = reference_logprobs(logits, temperature, top_p, top_k)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    finite = torch.isfinite(theirs)
    assert torch.allclose(ours[finite], theirs[finite], atol=1e-5)


def test_draws_stay_in_the_kept_set_and_depend_on_the_seed_only():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 2
    kept = torch.isfinite(sampling.process_logits(logits, 0.8, 0.7, 10))
    for seed in range(50):
        gens = [sampling.generator(seed * 10 + r, torch.device("cpu")) for r in range(4)]
        tokens, logp = sampling.sample(logits, gens, 0.8, 0.7, 10)
        assert kept[torch.arange(4), tokens].all()
        # row 2 alone, with its seed, draws the same token
        [alone], _ = sampling.sample(logits[2:3], [sampling.generator(seed * 10 + 2,
                                                                       torch.device("cpu"))],
                                     0.8, 0.7, 10)
        assert int(alone) == int(tokens[2])
    # greedy: the argmax, and its log-prob of the unfiltered softmax whatever top-p and top-k
    # say (vLLM turns them off for greedy requests)
    for top_p, top_k in ((1.0, -1), (0.5, 3)):
        greedy, logp = sampling.sample(logits, [None] * 4, 0.0, top_p, top_k)
        assert torch.equal(greedy, logits.argmax(-1))
        assert torch.allclose(logp, torch.log_softmax(logits, -1).max(-1).values)
