"""LoRA on the megatron actor against the independent reference, transformers + peft: the
adapters are made and saved by peft itself (random A and B, so every factor matters), loaded
into the actor at TP1, TP2, PP2 and TP2 + SP, padded and packed; the actor's log-probs equal
peft's model's. One optimizer step equals peft + torch AdamW on the adapters alone, and leaves
the base weights bit-identical."""
import pytest
import torch

from rlep_megatron.checkpoint.verify import max_abs_logprob_diff
from tests.torchrun import Cases

pytestmark = pytest.mark.distributed

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SOME = ["q_proj", "v_proj", "down_proj"]  # parts of the fused linears absent
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def make_peft_adapter(hf_dir, directory, targets, rank=4, alpha=8.0, seed=0):
    """A PEFT adapter of random A and B (``init_lora_weights=False``), saved by peft."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True,
                                                 dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                             lora_dropout=0.0, init_lora_weights=False))
    with torch.no_grad():  # B at the scale of the base weights: the adapter moves log-probs
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    model.save_pretrained(str(directory))
    return str(directory)


def peft_logprobs(hf_dir, adapter_dir, input_ids, lengths):
    """``[n, seq]`` log-probs of transformers with the adapter applied by peft (each sequence
    alone, column 0 = 0)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True,
                                                 dtype=torch.float32)
    model = PeftModel.from_pretrained(model, adapter_dir).eval()
    out = torch.zeros(input_ids.shape, dtype=torch.float64)
    with torch.no_grad():
        for row in range(input_ids.shape[0]):
            ids = input_ids[row, : int(lengths[row])].unsqueeze(0)
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
            out[row, 1: int(lengths[row])] = logp.gather(-1, ids[0, 1:, None])[:, 0]
    return out


@pytest.fixture(scope="session")
def peft_adapters(tmp_path_factory, tiny_qwen2_dir, tiny_qwen3_dir,
                  tiny_qwen3_moe_dir) -> dict[str, str]:
    """PEFT adapters made by peft: every target and a few (``SOME``), per model."""
    root = tmp_path_factory.mktemp("peft_adapters")
    made = {}
    for arch, hf_dir in (("qwen2", tiny_qwen2_dir), ("qwen3", tiny_qwen3_dir)):
        made[f"ADAPTER_{arch.upper()}"] = make_peft_adapter(hf_dir, root / f"{arch}_all", ALL)
        made[f"SOME_{arch.upper()}"] = make_peft_adapter(hf_dir, root / f"{arch}_some", SOME,
                                                         seed=1)
    # a mixture of experts: adapters on the attention (the experts get none)
    made["ADAPTER_QWEN3_MOE"] = make_peft_adapter(tiny_qwen3_moe_dir, root / "moe_attention",
                                                  ATTENTION, seed=2)
    return made


def adapters(_root, request) -> dict[str, str]:
    return request.getfixturevalue("peft_adapters")


LOGPROBS = Cases("tests/distributed/actor_logprob_program.py", "lora_logprobs",
                 placeholders=adapters)
LAYOUTS = {"tp1": (1, []), "tp2": (2, ["--tp", "2"]), "pp2": (2, ["--pp", "2"]),
           "tp2-sp": (2, ["--tp", "2", "--sp"])}
LOGPROB_CASES = [
    LOGPROBS.add(f"{arch}-{which}-{layout}" + ("-packed" if packed else ""), nproc, arch,
                 [*args, "--lora", f"{which.upper()}_{arch.upper()}",
                  *(["--pack-max-tokens", "64"] if packed else [])])
    for arch in ("qwen2", "qwen3") for which in ("adapter", "some")
    for layout, (nproc, args) in LAYOUTS.items() for packed in (False, True)
    if which == "adapter" or layout in ("tp1", "tp2")] + [
    LOGPROBS.add(f"qwen3_moe-adapter-{name}", nproc, "qwen3_moe",
                 [*args, "--lora", "ADAPTER_QWEN3_MOE"])
    for name, nproc, args in (("ep1", 1, []), ("ep2-packed", 2, ["--ep", "2", "--pack-max-tokens",
                                                                 "64"]))]


@pytest.mark.parametrize("case_id", LOGPROB_CASES)
def test_actor_with_lora_equals_transformers_with_peft(case_id, peft_adapters, request):
    arch, which = case_id.split("-")[:2]  # (qwen3_moe: the attention adapter)
    hf_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    result = LOGPROBS.result(case_id, request)
    adapter_dir = peft_adapters[f"{which.upper()}_{arch.upper()}"]
    reference = peft_logprobs(hf_dir, adapter_dir, result["input_ids"], result["lengths"])
    diff = max_abs_logprob_diff(result["logp"], reference, result["lengths"])
    assert diff <= 1e-5, f"max |delta logprob| = {diff}"
    # the adapter matters: the base model's log-probs are far from these
    from rlep_megatron.checkpoint.verify import hf_token_logprobs

    base = hf_token_logprobs(hf_dir, result["input_ids"], result["lengths"])
    assert max_abs_logprob_diff(base, reference, result["lengths"]) > 1e-2


TRAIN = Cases("tests/distributed/actor_train_program.py", "lora_train_steps",
              placeholders=adapters)
REALISTIC = ("--adam-eps", "1e-6", "--weight-decay", "1.0")
TRAIN_CASES = {
    "tp1": TRAIN.add("tp1", 1, "qwen2", ["--lora", "ADAPTER_QWEN2", *REALISTIC]),
    "tp2-sp-distopt": TRAIN.add("tp2-sp-distopt", 2, "qwen2",
                                ["--lora", "ADAPTER_QWEN2", "--tp", "2", "--sp",
                                 "--distributed-optimizer", "--reference", *REALISTIC]),
    "pp2-packed": TRAIN.add("pp2-packed", 2, "qwen2",
                            ["--lora", "ADAPTER_QWEN2", "--pp", "2", "--packing", *REALISTIC]),
    "dp2": TRAIN.add("dp2", 2, "qwen2", ["--lora", "ADAPTER_QWEN2", *REALISTIC]),
    # full activation recompute (the frozen embedding's output must carry gradients), and two
    # optimizer steps with the distributed optimizer's parameter gather overlapped over DP2
    "tp1-recompute": TRAIN.add("tp1-recompute", 1, "qwen2", ["--lora", "ADAPTER_QWEN2",
                                                             "--recompute", *REALISTIC]),
    "dp2-two-steps": TRAIN.add("dp2-two-steps", 2, "qwen2", ["--lora", "ADAPTER_QWEN2",
                                                             "--mini-batches", "2"]),
    "dp2-overlap-two-steps": TRAIN.add("dp2-overlap-two-steps", 2, "qwen2", [
        "--lora", "ADAPTER_QWEN2", "--mini-batches", "2", "--distributed-optimizer",
        "--overlap-param-gather"]),
    "tp2-no-step": TRAIN.add("tp2-no-step", 2, "qwen2", ["--lora", "ADAPTER_QWEN2", "--tp", "2",
                                                        "--train-steps", "0",
                                                        "--save-checkpoint"]),
}


def peft_reference_step(hf_dir, adapter_dir, old_logp, eps=1e-6, weight_decay=1.0):
    """The RLEP step against transformers + peft: the token-mean clipped loss over the whole
    batch, grad clip 1.0 and torch AdamW over the adapter's parameters only."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.distributed.test_actor_train_step import reference_update

    model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True,
                                                 dtype=torch.float32)
    model = PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)
    loss = reference_update(model, old_logp, eps, weight_decay)
    return {name.replace(".default", ""): p.detach() for name, p in model.named_parameters()
            if p.requires_grad}, loss


def test_one_lora_step_equals_peft_with_adamw_on_the_adapter_alone(peft_adapters, tiny_qwen2_dir,
                                                                   request):
    from safetensors.torch import load_file

    adapter_dir = peft_adapters["ADAPTER_QWEN2"]
    single = TRAIN.result("tp1", request)
    reference, reference_loss = peft_reference_step(tiny_qwen2_dir, adapter_dir,
                                                    single["old_logp"])
    assert single["metrics"]["pg_loss"] == pytest.approx(reference_loss, abs=1e-5)
    assert sorted(single["adapter"]) == sorted(reference)
    initial = load_file(f"{adapter_dir}/adapter_model.safetensors")
    for name, tensor in single["adapter"].items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=2e-6, msg=name)
        assert (tensor - initial[name]).abs().mean() > 5e-4, f"{name} did not move"
    assert single["base_unchanged"]
    assert all(name.startswith("module.lora.") for name in single["trainable"])
    adapter_numel = sum(t.numel() for t in single["adapter"].values())
    assert single["adam_state_numel"] == adapter_numel  # Adam moments of the adapter only
    # the weight-sync stream carries the merged weights: W + alpha / r x B A
    base = load_file(f"{tiny_qwen2_dir}/model.safetensors")
    scale = 8.0 / 4
    for name, tensor in single["weights"].items():
        hf = name.removesuffix(".weight")
        a = single["adapter"].get(f"base_model.model.{hf}.lora_A.weight")
        expected = base[name] if a is None else base[name] + scale * (
            single["adapter"][f"base_model.model.{hf}.lora_B.weight"] @ a)
        torch.testing.assert_close(tensor, expected, rtol=0, atol=1e-6, msg=name)

    for case in ("tp2-sp-distopt", "pp2-packed", "dp2", "tp1-recompute"):
        other = TRAIN.result(case, request)
        assert other["base_unchanged"], case
        for name, tensor in single["adapter"].items():
            torch.testing.assert_close(other["adapter"][name], tensor, rtol=0, atol=2e-6,
                                       msg=f"{name} at {case}")
        assert other["metrics"]["grad_norm"] == pytest.approx(single["metrics"]["grad_norm"],
                                                              rel=1e-5), case


def test_an_imported_adapter_comes_back_bit_for_bit_when_no_step_is_taken(peft_adapters,
                                                                          request, tmp_path):
    """peft's file -> the actor's TP2 shards -> gathered back, and -> a training checkpoint ->
    ``tools/lora_export.py``: every tensor bit-identical, the same PEFT settings."""
    import json

    from safetensors.torch import load_file

    from tests.torchrun import run_tool_in_process

    result = TRAIN.result("tp2-no-step", request)
    initial = load_file(f"{peft_adapters['ADAPTER_QWEN2']}/adapter_model.safetensors")
    assert sorted(result["adapter"]) == sorted(initial)
    for name, tensor in initial.items():
        assert torch.equal(result["adapter"][name], tensor), name
    exported = tmp_path / "exported"
    done = run_tool_in_process("tools/lora_export.py", ["--checkpoint", result["checkpoint"],
                                                        "--out-dir", str(exported)])
    assert done.returncode == 0, done.stderr
    back = load_file(exported / "adapter_model.safetensors")
    assert sorted(back) == sorted(initial)
    for name, tensor in initial.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    config = {k: v for k, v in json.load(open(exported / "adapter_config.json")).items()
              if k in ("r", "lora_alpha", "target_modules", "peft_type")}
    theirs = json.load(open(f"{peft_adapters['ADAPTER_QWEN2']}/adapter_config.json"))
    assert config == {"r": theirs["r"], "lora_alpha": theirs["lora_alpha"], "peft_type": "LORA",
                      "target_modules": sorted(theirs["target_modules"])}


def test_the_kl_reference_is_the_initial_adapter_on_the_actors_own_base(request):
    """``algo.kl_coef`` > 0 with LoRA: after a step (TP2 + SP, the distributed optimizer's
    parameter buffer), the reference pass gives the log-probs the policy had before the step,
    from the actor's own chunks (no copy of the base), and leaves the trained adapters as they
    were, bit for bit."""
    result = TRAIN.result("tp2-sp-distopt", request)
    torch.testing.assert_close(result["ref_logp"], result["clean_old_logp"], rtol=0, atol=1e-6)
    assert result["restored_after_reference"]
    # the trained policy's, after the reference pass, are those of the step's update
    assert (result["new_logp"] - result["clean_old_logp"]).abs().max() > 1e-4


def test_two_optimizer_steps_with_the_parameter_gather_overlapped(request):
    """Two mini-batches over DP2: the second trains with the first's update on every rank
    with the distributed optimizer, its parameter gather asked to overlap, as with torch's
    optimizer whole on each rank."""
    single = TRAIN.result("dp2-two-steps", request)
    other = TRAIN.result("dp2-overlap-two-steps", request)
    for name, tensor in single["adapter"].items():
        torch.testing.assert_close(other["adapter"][name], tensor, rtol=0, atol=2e-6, msg=name)
