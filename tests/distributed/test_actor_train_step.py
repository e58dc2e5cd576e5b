"""One actor train step: the same updated weights at TP2xPP2 and with DP=2 as at TP1xPP1, and
TP1xPP1 equal to an independent reference: HF transformers + torch AdamW on the same batch."""
import pytest
import torch
from safetensors.torch import load_file

from rlep_megatron.algo import policy_loss
from tests.distributed.actor_train_program import global_batch
from tests.torchrun import Cases

pytestmark = pytest.mark.distributed

PROGRAM = "tests/distributed/actor_train_program.py"

# Every step the tests below take, (model, ranks, TP, PP, arguments): the steps of one rank
# count run in one launch of the program, each from a freshly built model in its own layout.
STEPS = Cases(PROGRAM, "train_steps")
REALISTIC = ("--adam-eps", "1e-6", "--weight-decay", "1.0")
ROUTER_LOSSES = ("--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001",
                 "--micro-batch-max-tokens", "1000")
AUX_LOSS = ("--moe-aux-loss-coeff", "0.01", "--micro-batch-max-tokens", "1000")
SEQUENTIAL = ("--moe-experts", "sequential")
# (ranks, TP, arguments): EP1, EP2 and TP2 x EP2, padded and packed, routing replay on and off
GROUPED_VS_SEQUENTIAL = (
    (1, 1, ()), (1, 1, ("--dtype", "bfloat16", "--distributed-optimizer")),
    (2, 1, ("--ep", "2")), (2, 1, ("--ep", "2", "--packing", "--distributed-optimizer")),
    (4, 2, ("--ep", "2", "--sp")),
    (4, 2, ("--ep", "2", "--sp", "--packing", "--routing-replay", "--recompute")),
    (2, 1, ("--ep", "2", "--routing-replay")),
    # expert DP 2 with the parameter gather overlapped: the experts' updated shards arrive
    # through megatron's forward pre-hooks, which the grouped GEMM must run (2 training steps
    # of 2 optimizer steps each)
    (4, 1, ("--ep", "2", "--distributed-optimizer", "--overlap-param-gather",
            "--train-steps", "2", "--mini-batches", "2")))
for _key in dict.fromkeys((  # (some steps serve several tests)
        # parity across layouts and against transformers, per dense architecture
        *[(arch, nproc, tp, pp, extra) for arch in ("qwen2", "qwen3", "llama")
          for nproc, tp, pp, extra in ((1, 1, 1, ()), (1, 1, 1, REALISTIC), (4, 2, 2, ()),
                                       (2, 1, 1, ()))],
        # the distributed optimizer
        ("qwen2", 2, 1, 1, ("--distributed-optimizer",)),
        ("qwen2", 4, 2, 1, ("--distributed-optimizer",)),
        # sequence and context parallelism, chunked log-probs
        ("qwen2", 1, 1, 1, ("--logprob-chunk", "0")),
        ("qwen2", 2, 2, 1, ("--sp", "--logprob-chunk", "5")),
        ("qwen2", 4, 2, 2, ("--sp", "--logprob-chunk", "5", "--packing")),
        ("qwen2", 4, 2, 1, ("--sp", "--logprob-chunk", "5", "--cp", "2", "--packing")),
        ("qwen2", 4, 1, 1, ("--logprob-chunk", "5", "--cp", "2", "--distributed-optimizer")),
        # recompute, virtual pipeline stages
        ("qwen2", 1, 1, 1, ("--recompute",)),
        ("qwen2", 2, 1, 2, ("--vpp", "2")),
        # mixture of experts
        ("qwen3_moe", 1, 1, 1, REALISTIC),
        ("qwen3_moe", 1, 1, 1, ()),
        ("qwen3_moe", 2, 1, 1, ("--ep", "2", "--packing", "--distributed-optimizer")),
        ("qwen3_moe", 4, 2, 1, ("--ep", "2", "--sp")),
        ("qwen3_moe", 4, 2, 1, ("--ep", "2", "--sp", "--packing", "--routing-replay",
                                "--recompute")),
        ("qwen3_moe", 4, 1, 2, ("--ep", "2", "--micro-batch-max-tokens", "24",
                                "--routing-replay", "--recompute")),
        # context parallelism with experts: CP2 x EP2 (2 ranks), CP2 x TP2 x EP2 + SP (4)
        ("qwen3_moe", 2, 1, 1, ("--cp", "2", "--ep", "2", "--packing")),
        ("qwen3_moe", 2, 1, 1, ("--cp", "2", "--ep", "2", "--routing-replay", "--recompute")),
        ("qwen3_moe", 4, 2, 1, ("--ep", "2", "--sp", "--routing-replay", "--recompute")),
        ("qwen3_moe", 4, 2, 1, ("--cp", "2", "--ep", "2", "--sp", "--packing")),
        ("qwen3_moe", 4, 2, 1, ("--cp", "2", "--ep", "2", "--sp", "--packing",
                                "--routing-replay", "--recompute")),
        ("qwen3_moe", 1, 1, 1, ROUTER_LOSSES),
        ("qwen3_moe", 1, 1, 1, ROUTER_LOSSES + ("--packing",)),
        ("qwen3_moe", 2, 2, 1, ROUTER_LOSSES + ("--sp", "--packing")),
        ("qwen3_moe", 2, 1, 1, ROUTER_LOSSES + ("--cp", "2", "--ep", "2", "--packing")),
        ("qwen3_moe", 4, 2, 2, ROUTER_LOSSES + ("--sp",)),
        ("qwen3_moe", 1, 1, 1, AUX_LOSS),
        ("qwen3_moe", 2, 1, 1, AUX_LOSS + ("--cp", "2", "--ep", "2", "--packing")),
        ("qwen3_moe", 1, 1, 1, ("--micro-batch-max-tokens", "1000")),
        # torch's grouped-GEMM experts (the default) against megatron's SequentialMLP
        *[("qwen3_moe", nproc, tp, 1, extra + experts) for experts in ((), SEQUENTIAL)
          for nproc, tp, extra in GROUPED_VS_SEQUENTIAL],
        # scalar reads per micro-batch
        ("qwen2", 1, 1, 1, ("--micro-batch-max-tokens", "1000")),
        ("qwen2", 1, 1, 1, ("--micro-batch-max-tokens", "20")))):
    _arch, _nproc, _tp, _pp, _extra = _key
    STEPS.add(_key, _nproc, _arch, ("--tp", _tp, "--pp", _pp, *_extra))


def train(request, arch, nproc, tp, pp, *extra):
    """The output of one declared step (launching its rank count's steps if none has run)."""
    return STEPS.result((arch, nproc, tp, pp, tuple(extra)), request)


def reference_step(hf_dir, old_logp, eps=1e-3, weight_decay=0.1):
    """The RLEP step written directly against transformers: token-mean clipped loss over the
    whole batch, grad clip 1.0, AdamW with weight decay on every parameter (one parameter
    group, as the reference implementation's optimizer does)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True,
                                                 dtype=torch.float32)
    loss = reference_update(model, old_logp, eps, weight_decay)
    return {n: p.detach() for n, p in model.state_dict().items()}, loss


def reference_update(model, old_logp, eps: float, weight_decay: float) -> float:
    """One step of a transformers (or peft) model on the program's global batch: the loss, its
    backward, grad clip 1.0 and torch AdamW (lr 1e-3) over the parameters that require
    gradients; returns the loss."""
    input_ids, response_mask, advantages, _, _ = global_batch()
    logits = model(input_ids).logits[:, :-1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, input_ids[:, 1:, None])[..., 0]
    logp = torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1)
    loss, _ = policy_loss(logp, old_logp, advantages, response_mask, 0.2, 0.28, 10.0)
    loss.backward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    torch.nn.utils.clip_grad_norm_(trainable, 1.0)
    torch.optim.AdamW(trainable, lr=1e-3, betas=(0.9, 0.999), eps=eps,
                      weight_decay=weight_decay).step()
    return loss.item()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_train_step_parity_across_layouts_and_against_transformers(arch, request):
    hf_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    single = train(request, arch, 1, 1, 1)
    initial = load_file(f"{hf_dir}/model.safetensors")
    update = max((single["weights"][k] - initial[k]).abs().max().item() for k in initial)
    assert update > 5e-4  # the step really moved the weights (lr 1e-3)
    assert single["metrics"]["step_applied"] == 1.0 and single["metrics"]["num_micro_batches"] > 1

    # against transformers + torch AdamW with Adam's eps at 1e-6, far below the gradients, so
    # the normalisation shows (each element moves by about lr = 1e-3, not lr x g / eps), and
    # weight decay 1.0 (it moves a 0.02-scale matrix element by lr x 1.0 x 0.02 = 2e-5, ten
    # times the tolerance). The two implementations' gradients differ by float noise of about
    # 1e-10 (summation order); Adam's step amplifies it by lr / eps: 1e-7 here (measured
    # <= 6.3e-7 on Qwen2; on Qwen3 1.6e-6 with the full logits and, with the log-probs from
    # chunked logits and their analytic gradient, one element of the whole model at 2.07e-6),
    # 1e-5 at eps = 1e-8 (measured on a few elements near zero gradient). Qwen2 and Llama:
    # every element within 2e-6 (the criterion these two models had before Qwen3 came);
    # Qwen3: every tensor's max <= 1e-5 and at most 1 in 1000 elements above 2e-6 (the
    # weight decay alone moves an element by 2e-5).
    realistic = train(request, arch, 1, 1, 1, *REALISTIC)
    reference, reference_loss = reference_step(hf_dir, realistic["old_logp"], eps=1e-6,
                                               weight_decay=1.0)
    assert realistic["metrics"]["pg_loss"] == pytest.approx(reference_loss, abs=1e-5)
    for name, tensor in realistic["weights"].items():
        if arch in ("qwen2", "llama"):
            torch.testing.assert_close(tensor, reference[name], rtol=0, atol=2e-6, msg=name)
            continue
        diff = (tensor - reference[name]).abs()
        assert diff.max() <= 1e-5 and (diff > 2e-6).float().mean() <= 1e-3, \
            f"{name}: max {diff.max():.2e}, {(diff > 2e-6).sum()} elements above 2e-6"
    moved = min((realistic["weights"][k] - initial[k]).abs().float().mean().item()
                for k in initial if initial[k].dim() == 2 and ".layers." in k)
    # Adam's normalised step: about lr for most elements of every layer's matrices (the
    # embedding's rows of tokens absent from the batch get gradients near eps)
    assert moved > 5e-4

    for nproc, tp, pp in ((4, 2, 2), (2, 1, 1)):  # TP2xPP2; DP=2 over the same global batch
        other = train(request, arch, nproc, tp, pp)
        assert sorted(other["weights"]) == sorted(single["weights"])
        for name, tensor in single["weights"].items():
            torch.testing.assert_close(other["weights"][name], tensor, rtol=0, atol=1e-6,
                                       msg=f"{name} at TP{tp} PP{pp} x{nproc}")
        assert other["metrics"]["grad_norm"] == pytest.approx(single["metrics"]["grad_norm"],
                                                              rel=1e-5)
        assert other["metrics"]["pg_loss"] == pytest.approx(single["metrics"]["pg_loss"],
                                                            abs=1e-6)


def test_distributed_optimizer_gives_the_same_step(request):
    """megatron's distributed optimizer (gradients reduce-scattered, Adam state and update
    sharded over DP ranks, parameters all-gathered) against the replicated optimizer at DP=1."""
    single = train(request, "qwen2", 1, 1, 1)
    for nproc, tp in ((2, 1), (4, 2)):  # DP=2; TP2 x DP2
        sharded = train(request, "qwen2", nproc, tp, 1, "--distributed-optimizer")
        assert sharded["optimizers"] == ["DistributedOptimizer"]
        # rank 0 holds its share of the Adam state: 1 / DP of the (TP-sharded) parameters
        assert sharded["adam_state_numel"] == pytest.approx(
            single["adam_state_numel"] / (nproc // tp) / tp, rel=0.01)
        assert sharded["metrics"]["grad_norm"] == pytest.approx(single["metrics"]["grad_norm"],
                                                                rel=1e-5)
        for name, tensor in single["weights"].items():
            torch.testing.assert_close(sharded["weights"][name], tensor, rtol=0, atol=1e-6,
                                       msg=f"{name} with the distributed optimizer x{nproc}")


def test_sequence_and_context_parallel_and_chunked_logprobs_give_the_same_step(request):
    """TP2 with sequence parallelism (padded, and packed x PP2), context parallelism (CP2 x TP2
    + SP packed, CP2 x DP2 padded) and the log-probs computed from the hidden states a few
    tokens at a time (logits recomputed in the backward) against TP1 with the full logits: the
    same updated weights."""
    full = train(request, "qwen2", 1, 1, 1, "--logprob-chunk", "0")
    for nproc, tp, pp, extra in ((2, 2, 1, ()), (4, 2, 2, ("--packing",)),
                                 # context parallelism: CP2 x TP2 + SP (packed), and CP2 x DP2
                                 # with the distributed optimizer
                                 (4, 2, 1, ("--cp", "2", "--packing")),
                                 (4, 1, 1, ("--cp", "2", "--distributed-optimizer"))):
        sp = ("--sp",) if tp > 1 else ()
        other = train(request, "qwen2", nproc, tp, pp, *sp, "--logprob-chunk", "5", *extra)
        assert other["metrics"]["grad_norm"] == pytest.approx(full["metrics"]["grad_norm"],
                                                              rel=1e-5)
        for name, tensor in full["weights"].items():
            torch.testing.assert_close(other["weights"][name], tensor, rtol=0, atol=1e-6,
                                       msg=f"{name} at TP{tp} PP{pp} {extra}, chunks of 5")


def test_recompute_and_virtual_pipeline_give_the_same_step(request):
    plain = train(request, "qwen2", 1, 1, 1)
    recompute = train(request, "qwen2", 1, 1, 1, "--recompute")
    for name, tensor in plain["weights"].items():
        torch.testing.assert_close(recompute["weights"][name], tensor, rtol=0, atol=1e-7)
    # PP=2 x 2 virtual stages: megatron's interleaved schedule, micro-batches padded to one
    # shape (masked rows) and cut to a multiple of PP
    interleaved = train(request, "qwen2", 2, 1, 2, "--vpp", "2")
    assert interleaved["metrics"]["num_micro_batches"] % 2 == 0
    for name, tensor in plain["weights"].items():
        torch.testing.assert_close(interleaved["weights"][name], tensor, rtol=0, atol=1e-6)
    assert interleaved["metrics"]["pg_loss"] == pytest.approx(plain["metrics"]["pg_loss"],
                                                              abs=1e-6)


def test_moe_train_step_across_expert_layouts_and_against_transformers(tiny_qwen3_moe_dir,
                                                                       request):
    """Tiny Qwen3-MoE (8 experts, top-2; no auxiliary loss): one step at EP1 equals
    transformers + AdamW, and the same step with the experts split over 2 EP ranks (packed,
    distributed optimizer) and over TP2 x EP2 with sequence parallelism equals EP1 on every
    weight; every expert comes back through the weight-sync stream."""
    hf_dir = tiny_qwen3_moe_dir
    single = train(request, "qwen3_moe", 1, 1, 1, *REALISTIC)
    reference, reference_loss = reference_step(hf_dir, single["old_logp"], eps=1e-6,
                                               weight_decay=1.0)
    reference = per_expert_names(reference)
    assert single["metrics"]["pg_loss"] == pytest.approx(reference_loss, abs=1e-5)
    assert sorted(single["weights"]) == sorted(reference)
    # as in the dense test, Adam (eps 1e-6) amplifies float noise of the gradients by lr / eps;
    # the router's top-k softmax adds a little more: measured, 2 elements of the whole model
    # above 2e-6 (at 2.6e-6 and 4.1e-6). Every tensor: max <= 1e-5 and at most 1 in 1000
    # elements above 2e-6 (an element moved by the weight decay alone shows 2e-5).
    for name, tensor in single["weights"].items():
        diff = (tensor - reference[name]).abs()
        assert diff.max() <= 1e-5 and (diff > 2e-6).float().mean() <= 1e-3, \
            f"{name}: max {diff.max():.2e}, {(diff > 2e-6).sum()} elements above 2e-6"
    initial = load_file(f"{hf_dir}/model.safetensors")
    experts = [k for k in initial if ".experts." in k]
    assert len(experts) == 3 * 8 * 3  # 3 sparse layers x 8 experts x gate/up/down
    # the routed experts learn (each expert that saw tokens moved)
    assert sum((single["weights"][k] - initial[k]).abs().max() > 1e-4 for k in experts) > 30

    # layouts compared at the default Adam eps (1e-3), as in the dense test
    single = train(request, "qwen3_moe", 1, 1, 1)
    # and with every sequence split over 2 context-parallel ranks as well (CP2 x EP2 packed,
    # CP2 x TP2 x EP2 + SP)
    for nproc, tp, extra in ((2, 1, ("--ep", "2", "--packing", "--distributed-optimizer")),
                             (4, 2, ("--ep", "2", "--sp")),
                             (2, 1, ("--cp", "2", "--ep", "2", "--packing")),
                             (4, 2, ("--cp", "2", "--ep", "2", "--sp", "--packing"))):
        other = train(request, "qwen3_moe", nproc, tp, 1, *extra)
        assert sorted(other["weights"]) == sorted(single["weights"])
        for name, tensor in single["weights"].items():
            torch.testing.assert_close(other["weights"][name], tensor, rtol=0, atol=1e-6,
                                       msg=f"{name} with {' '.join(extra)}")
        assert other["metrics"]["grad_norm"] == pytest.approx(single["metrics"]["grad_norm"],
                                                              rel=1e-5)
    # routing replay: the experts recorded in the old-log-prob pass (the policy of this very
    # step, so the same experts the routers would choose) replayed in the step, with full
    # activation recompute (each layer routes twice per micro-batch), packed, at TP2 x EP2:
    # the same update
    # and with PP2 x EP2, where 1F1B recomputes a micro-batch's layers after later micro-batches'
    # forward passes (the replayed experts are queued per layer)
    # and padded at TP2 x EP2 + SP and at CP2 x EP2, where each rank routes only its shard of
    # a micro-batch and the update's micro-batches (a data-parallel share of the rows) are
    # sharded differently from the old-log-prob pass's (all rows)
    # (and CP2 x TP2 x EP2 + SP, packed: the records shared over a TP x CP group of 4)
    for nproc, tp, pp, extra in ((4, 2, 1, ("--ep", "2", "--sp", "--packing")),
                                 (4, 1, 2, ("--ep", "2", "--micro-batch-max-tokens", "24")),
                                 (4, 2, 1, ("--ep", "2", "--sp")),
                                 (2, 1, 1, ("--cp", "2", "--ep", "2")),
                                 (4, 2, 1, ("--cp", "2", "--ep", "2", "--sp", "--packing"))):
        replayed = train(request, "qwen3_moe", nproc, tp, pp, *extra, "--routing-replay",
                         "--recompute")
        for name, tensor in single["weights"].items():
            torch.testing.assert_close(replayed["weights"][name], tensor, rtol=0, atol=1e-6,
                                       msg=f"{name} with routing replay, {nproc} ranks "
                                           f"TP{tp} PP{pp} {' '.join(extra)}")


def test_grouped_experts_equal_sequential_mlp(tiny_qwen3_moe_dir, request):
    """torch's grouped-GEMM experts (model.moe_experts=auto on the local spec) against
    megatron's SequentialMLP, one train step from the same weights in each layout: the
    forward (the old log-probs) and the update (every weight after AdamW, so the backward's
    gradients) equal within float32 rounding; in bfloat16, the two paths' GEMMs round alike."""
    for nproc, tp, extra in GROUPED_VS_SEQUENTIAL:
        grouped = train(request, "qwen3_moe", nproc, tp, 1, *extra)
        sequential = train(request, "qwen3_moe", nproc, tp, 1, *extra, *SEQUENTIAL)
        where = f"{nproc} ranks TP{tp} {' '.join(extra)}"
        assert grouped["experts_modules"] == ["TorchGroupedMLP"], where
        assert sequential["experts_modules"] == ["SequentialMLP"], where
        # the grouped GEMM reads the experts' weights without calling their linears: it runs
        # their forward pre-hooks itself, as often as SequentialMLP's calls do (rank 0's)
        assert grouped["expert_prehook_calls"] == sequential["expert_prehook_calls"] > 0, where
        bf16 = "bfloat16" in extra
        tol = dict(rtol=1e-2, atol=1e-2) if bf16 else dict(rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grouped["clean_old_logp"], sequential["clean_old_logp"],
                                   **tol, msg=f"old log-probs, {where}")
        if isinstance(grouped["metrics"], list):  # several optimizer steps: every metric
            assert len(grouped["metrics"]) == len(sequential["metrics"]) > 1, where
            for step, (got, want) in enumerate(zip(grouped["metrics"], sequential["metrics"])):
                assert sorted(got) == sorted(want), where
                for key, value in want.items():
                    assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-9), \
                        f"{key} at optimizer step {step}, {where}"
        else:
            assert grouped["metrics"]["grad_norm"] == pytest.approx(
                sequential["metrics"]["grad_norm"], rel=1e-2 if bf16 else 1e-6), where
        assert sorted(grouped["weights"]) == sorted(sequential["weights"])
        for name, tensor in grouped["weights"].items():
            torch.testing.assert_close(tensor, sequential["weights"][name], **tol,
                                       msg=f"{name}, {where}")


def per_expert_names(state: dict) -> dict:
    """transformers 5 holds a layer's experts fused (``mlp.experts.gate_up_proj [E, 2f, h]``,
    ``down_proj [E, h, f]``) and saves them one tensor per expert
    (``mlp.experts.{e}.gate_proj.weight`` ...): the saved names, as the weight stream gives."""
    out = {}
    for name, tensor in state.items():
        if name.endswith(".experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            for e, fused in enumerate(tensor):
                gate, up = fused.chunk(2, dim=0)
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = gate, up
        elif name.endswith(".experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e, down in enumerate(tensor):
                out[f"{prefix}{e}.down_proj.weight"] = down
        else:
            out[name] = tensor
    return out


def router_losses_in_float64(hf_dir, input_ids, lengths):
    """The load-balancing loss and z-loss by their definitions, in float64, from transformers'
    router logits over the real tokens of one micro-batch (mean over the sparse layers):
    ``E x sum_e f_e P_e`` with ``f_e`` the fraction of the top-k copies sent to expert e and
    ``P_e`` its mean softmax probability; ``mean(logsumexp(logits)^2)``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True,
                                                 dtype=torch.float32)
    experts, top_k = model.config.num_experts, model.config.num_experts_per_tok
    with torch.no_grad():
        out = model(input_ids, output_router_logits=True)
    real = (torch.arange(input_ids.shape[1])[None, :] < lengths[:, None]).reshape(-1)
    aux, z = [], []
    for logits in out.router_logits:  # the sparse layers only
        x = logits.reshape(-1, experts)[real].double()
        chosen = x.topk(top_k).indices.reshape(-1)
        fraction = torch.bincount(chosen, minlength=experts).double() / chosen.numel()
        aux.append(experts * (fraction * torch.softmax(x, -1).mean(0)).sum())
        z.append((torch.logsumexp(x, -1) ** 2).mean())
    return float(torch.stack(aux).mean()), float(torch.stack(z).mean())


def test_moe_router_losses_match_their_float64_definitions(tiny_qwen3_moe_dir, request):
    """algo.moe_aux_loss_coeff / moe_z_loss_coeff: the reported (unweighted) losses of a step
    whose mini-batch is one micro-batch equal the float64 re-derivation over its real tokens,
    padded or packed, and with the tokens split over TP2 + SP (partial sums; also over two
    pipeline stages) or over CP2 x EP2; the losses reach the gradient: the routers' weights
    move differently than without them; and the load-balancing loss's step at CP2 x EP2 equals
    the single rank's."""
    hf_dir = tiny_qwen3_moe_dir
    runs = {name: train(request, "qwen3_moe", nproc, tp, 1, *ROUTER_LOSSES, *extra)
            for name, nproc, tp, extra in (("padded", 1, 1, ()), ("packed", 1, 1, ("--packing",)),
                                           ("tp2-sp", 2, 2, ("--sp", "--packing")),
                                           ("cp2-ep2", 2, 1, ("--cp", "2", "--ep", "2",
                                                              "--packing")))}
    # with pipeline stages too (a later stage's routers see their sequence-parallel shard of
    # the padding mask)
    runs["tp2-sp-pp2"] = train(request, "qwen3_moe", 4, 2, 2, *ROUTER_LOSSES, "--sp")
    input_ids, _, _, _, _ = global_batch()
    aux, z = router_losses_in_float64(hf_dir, input_ids, runs["padded"]["lengths"])
    assert 1.0 < aux < 8.0 / 2  # 1: perfectly balanced, E / k: every token on the same experts
    for name, run in runs.items():
        assert run["metrics"]["num_micro_batches"] == 1.0
        assert run["metrics"]["moe/aux_loss"] == pytest.approx(aux, rel=1e-5), name
        # each sequence- or context-parallel shard's z-loss is the mean over its own tokens,
        # and the shards hold different numbers of real tokens: their average is near the
        # whole mean
        assert run["metrics"]["moe/z_loss"] == pytest.approx(
            z, rel=0.1 if name in ("tp2-sp", "cp2-ep2", "tp2-sp-pp2") else 1e-5), name
    plain = train(request, "qwen3_moe", 1, 1, 1, "--micro-batch-max-tokens", "1000")
    assert "moe/aux_loss" not in plain["metrics"]
    routers = [k for k in plain["weights"] if k.endswith("mlp.gate.weight")]
    assert len(routers) == 3
    assert max((runs["padded"]["weights"][k] - plain["weights"][k]).abs().max()
               for k in routers) > 1e-5
    # the load-balancing loss's gradient with every sequence split over CP2 (and the experts
    # over EP2) is the single rank's: the same step on every weight
    single, split = (train(request, "qwen3_moe", nproc, 1, 1, *AUX_LOSS, *extra)
                     for nproc, extra in ((1, ()), (2, ("--cp", "2", "--ep", "2", "--packing"))))
    assert split["metrics"]["moe/aux_loss"] == pytest.approx(aux, rel=1e-5)
    # (the load-balancing loss alone moves the routers measurably: the comparison can fail)
    assert max((single["weights"][k] - plain["weights"][k]).abs().max() for k in routers) > 1e-5
    for name, tensor in single["weights"].items():
        torch.testing.assert_close(split["weights"][name], tensor, rtol=0, atol=1e-6,
                                   msg=f"{name}: load-balancing loss at CP2 x EP2")


def test_step_metrics_make_no_scalar_read_per_micro_batch(request):
    """The loss's metrics stay on the device through megatron's schedule (summed there, read
    in one transfer after it): the scalar reads inside the schedule (each a wait for the device
    on a GPU) do not grow with the number of micro-batches. The loss metrics read one by one
    (about 25 per micro-batch) fail this."""
    reads = {}
    for budget in (1000, 20):
        out = train(request, "qwen2", 1, 1, 1, "--micro-batch-max-tokens", str(budget))
        reads[out["metrics"]["num_micro_batches"]] = out["schedule_scalar_reads"]
    assert sorted(reads)[0] == 1 and sorted(reads)[1] >= 4, reads
    assert len(set(reads.values())) == 1, f"scalar reads per micro-batch count: {reads}"
