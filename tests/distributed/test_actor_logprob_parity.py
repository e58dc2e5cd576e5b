"""Megatron actor log-probs vs HF transformers (the independent reference), fp32, on the tiny
Qwen2 (tied, QKV bias), Llama (untied), Qwen3 and Qwen3-MoE checkpoints, at TP1xPP1, TP2xPP1,
TP1xPP2, TP2xPP2 (and PP2 x 2 virtual stages), with expert and sequence parallelism, on a
right-padded batch of different lengths (padded or packed micro-batches), and with every
sequence split over context-parallel ranks."""
import pytest
import torch

from rlep_megatron.checkpoint.verify import hf_token_logprobs, max_abs_logprob_diff
from tests.torchrun import Cases

pytestmark = pytest.mark.distributed

PROGRAM = "tests/distributed/actor_logprob_program.py"


def forced_routing(input_ids):
    """Random experts (top-2 of 8) for every token of the MoE layers 1-3, far from what the
    router would choose, for the routing-replay cases."""
    generator = torch.Generator().manual_seed(5)
    return {layer: torch.rand(input_ids.shape + (8,), generator=generator).argsort(-1)[..., :2]
            for layer in (1, 2, 3)}


def prompt_batch():
    from rlep_megatron.actor.forward import pad_sequences
    from rlep_megatron.checkpoint.verify import DEFAULT_PROMPTS

    return pad_sequences([list(p.encode()) for p in DEFAULT_PROMPTS], pad_id=256)


def forced_file(root, _request) -> dict[str, str]:
    torch.save(forced_routing(prompt_batch()[0]), root / "forced.pt")
    return {"FORCED": str(root / "forced.pt")}


# every case of this module (ranks, model, arguments); the cases of one rank count run in one
# launch of the program
CASES = Cases(PROGRAM, "logprob_cases", placeholders=forced_file)


def case(case_id: str, nproc: int, arch: str, args: list[str]) -> str:
    return CASES.add(case_id, nproc, arch, args)


# every layout on the tied Qwen2 model (virtual pipeline stages too); Llama and Qwen3 at TP1
# and at TP2 x PP2, which holds both splits
@pytest.mark.parametrize("case_id", [
    case(f"{arch}-tp{tp}-pp{pp}" + (f"-vpp{vpp}" if vpp else ""), tp * pp, arch,
         ["--tp", str(tp), "--pp", str(pp)] + (["--vpp", str(vpp)] if vpp else []))
    for arch, tp, pp, vpp in [("qwen2", tp, pp, None) for tp, pp in ((1, 1), (2, 1), (1, 2),
                                                                     (2, 2))]
    + [("qwen2", 1, 2, 2), ("llama", 1, 1, None), ("llama", 2, 2, None)]
    # Qwen3: q/k norms over heads split by TP, head_dim != hidden / heads
    + [("qwen3", 1, 1, None), ("qwen3", 2, 1, None), ("qwen3", 1, 2, None),
       ("qwen3", 2, 2, None)]])
def test_logprobs_match_transformers(case_id, request):
    check_against_transformers(case_id, request)


# Qwen3-MoE (8 experts, top-2, layer 0 dense): experts split over EP ranks (tokens reach them
# by all-to-all), over TP ranks with sequence parallelism (which megatron's MoE layer needs at
# TP > 1), both on 4 ranks, and over pipeline stages; packed (THD) and padded batches.
# Sequence parallelism on the dense Qwen2 (TP2, packed).
SPLIT_CASES = [case(*spec) for spec in [
    ("moe-ep1", 1, "qwen3_moe", []),
    ("moe-ep1-packed", 1, "qwen3_moe", ["--pack-max-tokens", "64"]),
    ("moe-ep2", 2, "qwen3_moe", ["--ep", "2"]),
    ("moe-ep2-packed", 2, "qwen3_moe", ["--ep", "2", "--pack-max-tokens", "64"]),
    ("moe-tp2-ep2-sp", 4, "qwen3_moe", ["--tp", "2", "--ep", "2", "--sp"]),
    ("moe-tp2-ep2-sp-packed", 4, "qwen3_moe",
     ["--tp", "2", "--ep", "2", "--sp", "--pack-max-tokens", "64"]),
    ("moe-pp2", 2, "qwen3_moe", ["--pp", "2"]),
    ("moe-pp2-ep2-packed", 4, "qwen3_moe", ["--pp", "2", "--ep", "2", "--pack-max-tokens", "64"]),
    # Qwen3 dense packed, without context parallelism
    ("qwen3-tp2-pp2-packed", 4, "qwen3", ["--tp", "2", "--pp", "2", "--pack-max-tokens", "64"]),
    # experts with context parallelism: each CP rank routes its chunks of every sequence
    ("moe-cp2-ep2", 2, "qwen3_moe", ["--cp", "2", "--ep", "2"]),
    ("moe-cp2-ep2-packed", 2, "qwen3_moe", ["--cp", "2", "--ep", "2", "--pack-max-tokens", "64"]),
    ("moe-cp2-tp2-ep2-sp-packed", 4, "qwen3_moe",
     ["--cp", "2", "--tp", "2", "--ep", "2", "--sp", "--pack-max-tokens", "64"]),
    ("moe-cp2-pp2-ep2-packed", 4, "qwen3_moe",
     ["--cp", "2", "--pp", "2", "--ep", "2", "--pack-max-tokens", "64"]),
    # EP4 over CP2 x DP2: each expert-parallel group spans data- and context-parallel ranks
    ("moe-cp2-ep4", 4, "qwen3_moe", ["--cp", "2", "--ep", "4"]),
    ("qwen2-tp2-sp-packed", 2, "qwen2", ["--tp", "2", "--sp", "--pack-max-tokens", "64"]),
    ("qwen2-tp2-sp", 2, "qwen2", ["--tp", "2", "--sp"]),
    # context parallelism: every sequence (lengths 26, 55, 1, 66, 3: odd, and two shorter than
    # 2 x CP, one of them with scored tokens) split in 2 x CP chunks over the CP ranks; padded and packed; with TP (+ SP), PP
    ("qwen2-cp2", 2, "qwen2", ["--cp", "2"]),
    ("qwen2-cp2-packed", 2, "qwen2", ["--cp", "2", "--pack-max-tokens", "64"]),
    ("qwen2-cp2-tp2", 4, "qwen2", ["--cp", "2", "--tp", "2"]),
    ("qwen2-cp2-tp2-sp-packed", 4, "qwen2",
     ["--cp", "2", "--tp", "2", "--sp", "--pack-max-tokens", "64"]),
    ("qwen3-cp2-pp2-packed", 4, "qwen3", ["--cp", "2", "--pp", "2", "--pack-max-tokens", "64"]),
]]


@pytest.mark.parametrize("case_id", SPLIT_CASES)
def test_expert_and_sequence_parallel_logprobs_match_transformers(case_id, request):
    arch = CASES.cases[case_id][1]
    hf_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    result = check_against_transformers(case_id, request)
    if arch == "qwen3_moe":
        # the expert-load counts (moe/load_imbalance) are transformers' own routing of the
        # real tokens: its router logits' top-2 per token, counted per layer and expert (a
        # paused pass before it not counted)
        assert torch.equal(result["expert_counts"], hf_expert_counts(
            hf_dir, result["input_ids"], result["lengths"]))


# the unsplit layout of each model: one rank, padded
UNSPLIT = {"qwen2": "qwen2-tp1-pp1", "qwen3": "qwen3-tp1-pp1", "qwen3_moe": "moe-ep1"}


@pytest.mark.parametrize("case_id", [c for c in SPLIT_CASES if c not in UNSPLIT.values()])
def test_split_layouts_match_the_unsplit_one(case_id, request):
    """Each expert-, sequence- or context-parallel layout (and the packed one-rank MoE case)
    against the same model on one rank with padded micro-batches, directly (the test above
    holds each against transformers): log-probs and entropy within 1e-5 on every real
    token."""
    result = CASES.result(case_id, request)
    unsplit = CASES.result(UNSPLIT[CASES.cases[case_id][1]], request)
    assert torch.equal(result["input_ids"], unsplit["input_ids"])
    lengths = result["lengths"]
    diff = max_abs_logprob_diff(result["logp"], unsplit["logp"].double(), lengths)
    assert diff <= 1e-5, f"max |delta logprob| = {diff}"
    valid = torch.arange(lengths.max())[None, :] < lengths[:, None]
    valid[:, 0] = False  # no prediction for the first token
    entropy = (result["entropy"] - unsplit["entropy"]).abs()[:, :valid.shape[1]][valid]
    assert entropy.max() <= 1e-5, f"max |delta entropy| = {entropy.max()}"


@pytest.mark.parametrize("case_id", [
    case(f"qwen2-cp2-{mutation}" + ("-packed" if packed else ""), 2, "qwen2",
         ["--cp", "2", "--mutate-cp-mask", mutation]
         + (["--pack-max-tokens", "64"] if packed else []))
    for packed, mutation in [(False, "own-keys-only"), (True, "own-keys-only"),
                             (True, "no-cross-chunk-causality")]])
def test_context_parallel_attention_with_a_wrong_mask_fails(case_id, tiny_qwen2_dir, request):
    """Mutations of the CP attention's mask: each rank attends only within its own chunks
    (other ranks' keys masked out), or sees the keys other ranks hold without the causal mask
    (future tokens leak in). The parity check must see both. (They run in the same launch as
    correct CP cases, after them: each case restores the mask.)"""
    result = CASES.result(case_id, request)
    reference = hf_token_logprobs(tiny_qwen2_dir, result["input_ids"], result["lengths"])
    assert max_abs_logprob_diff(result["logp"], reference, result["lengths"]) > 1e-2


def hf_expert_counts(hf_dir, input_ids, lengths):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True,
                                                 dtype=torch.float32)
    config = model.config
    with torch.no_grad():
        out = model(input_ids, output_router_logits=True)
    real = (torch.arange(input_ids.shape[1])[None, :] < lengths[:, None]).reshape(-1)
    sparse = [i for i in range(config.num_hidden_layers) if i not in config.mlp_only_layers]
    counts = torch.zeros(config.num_hidden_layers, config.num_experts, dtype=torch.float64)
    for layer, logits in zip(sparse, out.router_logits):
        top = logits.reshape(-1, config.num_experts)[real].topk(config.num_experts_per_tok).indices
        counts[layer] = torch.bincount(top.reshape(-1), minlength=config.num_experts).double()
    return counts


def check_against_transformers(case_id, request):
    hf_dir = request.getfixturevalue(f"tiny_{CASES.cases[case_id][1]}_dir")
    result = CASES.result(case_id, request)
    reference = hf_token_logprobs(hf_dir, result["input_ids"], result["lengths"])
    diff = max_abs_logprob_diff(result["logp"], reference, result["lengths"])
    assert diff <= 1e-5, f"max |delta logprob| = {diff}"
    check_entropy(result)
    return result


def check_entropy(result):
    # entropy over the vocabulary of config.json (320): positive and at most log(320)
    lengths = result["lengths"]
    valid = torch.arange(result["entropy"].shape[1])[None, :] < lengths[:, None]
    valid[:, 0] = False
    entropy = result["entropy"][valid]
    assert (entropy > 0).all() and (entropy <= torch.log(torch.tensor(320.0)) + 1e-4).all()


@pytest.mark.parametrize("case_id", [
    case("moe-replay-pp2-packed", 2, "qwen3_moe",
         ["--pp", "2", "--pack-max-tokens", "64", "--forced-routing", "FORCED"]),
    case("moe-replay-tp2-ep2-sp", 4, "qwen3_moe",
         ["--tp", "2", "--ep", "2", "--sp", "--forced-routing", "FORCED"]),
    case("moe-replay-cp2-ep2-packed", 2, "qwen3_moe",
         ["--cp", "2", "--ep", "2", "--pack-max-tokens", "64", "--forced-routing", "FORCED"]),
    case("moe-replay-cp2-tp2-ep2-sp-packed", 4, "qwen3_moe",
         ["--cp", "2", "--tp", "2", "--ep", "2", "--sp", "--pack-max-tokens", "64",
          "--forced-routing", "FORCED"])])
def test_replayed_routing_reaches_every_token(case_id, tiny_qwen3_moe_dir, request):
    """Routing replay: each token is routed through the experts given for its (row, column)
    and layer, whatever the micro-batch layout. The given experts are random (not what the
    router would choose), and the log-probs equal transformers' with its routers forced to the
    same experts."""
    input_ids, lengths = prompt_batch()
    forced = forced_routing(input_ids)
    result = CASES.result(case_id, request)
    assert torch.equal(result["input_ids"], input_ids)
    reference = hf_forced_logprobs(tiny_qwen3_moe_dir, input_ids, lengths, forced)
    diff = max_abs_logprob_diff(result["logp"], reference, lengths)
    assert diff <= 1e-5, f"max |delta logprob| = {diff}"
    # the forced routing is far from the router's own choice
    assert max_abs_logprob_diff(result["logp"], hf_token_logprobs(
        tiny_qwen3_moe_dir, input_ids, lengths), lengths) > 1e-2


def hf_forced_logprobs(hf_dir, input_ids, lengths, forced):
    """transformers' log-probs with each sparse layer's router forced to ``forced[layer]``
    (``[rows, columns, k]``); gate weights: its softmax renormalised over the forced experts."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True,
                                                 dtype=torch.float32)
    for number, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if number not in forced or gate is None or not hasattr(gate, "top_k"):
            continue

        def forward(hidden, gate=gate, chosen=forced[number].reshape(-1, 2)):
            logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, chosen)
            return logits, (probs / probs.sum(-1, keepdim=True)).to(logits.dtype), chosen
        gate.forward = forward
    with torch.no_grad():
        logits = model(input_ids).logits.double()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1)
