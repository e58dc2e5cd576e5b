"""Torchrun program: a vLLM rollout engine on every rank (rollout TP ``--rollout-tp``) fed by
Megatron actors of several TP x PP layouts in turn, through the weight-sync stream.

For each actor layout: build the actor from the HF checkpoint, take one optimizer step so its
weights differ from what the engine holds, sync, sample, probe parity; take another step, sync,
sample with the same seed and compare. With ``--fail-sync`` the last layout also interrupts a
sync midway and checks the engine refuses to generate until a complete sync. Rank 0 writes a
JSON report to ``--out``; the pytest side asserts on it.
"""
import argparse
import contextlib
import json
import types

import torch

from rlep_megatron import distributed
from rlep_megatron.actor.forward import pad_sequences
from rlep_megatron.actor.model import build_from_hf
from rlep_megatron.actor.optimizer import build_optimizer, wrap_ddp
from rlep_megatron.actor.train_step import TrainBatch, train_mini_batch
from rlep_megatron.checkpoint.hf_io import load_hf_config
from rlep_megatron.config import AlgoConfig, OptimConfig, ParallelConfig, RolloutConfig
from rlep_megatron.models import layout_limits, num_experts
from rlep_megatron.rollout import IncompleteWeightsError, RolloutEngine
from rlep_megatron.actor.forward import actor_logprobs_everywhere
from rlep_megatron.rollout.parity import probe
from rlep_megatron.weight_sync import WeightStreamer, deliver, sync_weights

PAD = 256
PROMPTS = ["What is 12+7?", "Compute 3*(4+5).", "Name a prime above 10.", "2^5 = ?"]


def chat(text: str) -> list[int]:
    return [257] + list(f"user\n{text}".encode()) + [258, 257] + list(b"assistant\n")


def take_step(chunks, optimizer, info, ctx, prompts, responses, seed):
    """One policy-gradient step on the sampled responses with random-sign advantages."""
    flat = [r for group in responses for r in group]
    sequences = [prompts[r.prompt_index] + r.token_ids for r in flat]
    input_ids, lengths = pad_sequences(sequences, pad_id=PAD)
    starts = torch.tensor([len(prompts[r.prompt_index]) for r in flat])
    positions = torch.arange(input_ids.shape[1]).unsqueeze(0)
    mask = ((positions >= starts[:, None]) & (positions < lengths[:, None])).float()
    old = actor_logprobs_everywhere(chunks, info, sequences, PAD)
    advantages = torch.randn(len(flat), generator=torch.Generator().manual_seed(seed)) * 2
    rows = slice(ctx.data_parallel_rank * len(flat) // ctx.data_parallel_size,
                 (ctx.data_parallel_rank + 1) * len(flat) // ctx.data_parallel_size)
    batch = TrainBatch(input_ids[rows], mask[rows], old[rows], advantages[rows],
                       torch.zeros(len(flat), dtype=torch.bool)[rows])
    return train_mini_batch(chunks, optimizer, info, batch, AlgoConfig(), 4096)


def routing_check(chunks, info, prompts, responses):
    """The actor's old-log-prob pass (packed micro-batches) on the engine's samples, its own
    top-k compared with the experts the engine captured, then the same with the engine's
    experts shifted one position later (a misaligned replay): mismatch fractions and counts
    over every rank; and with the engine's routing followed (routing_replay=rollout), whether
    every token the engine routed was routed the same; last, the same with a deliberate bug
    (the replay reads the engine's experts one position early), which that check must see."""
    from rlep_megatron.actor.expert_load import ExpertLoad
    from rlep_megatron.actor.forward import actor_logprobs
    from rlep_megatron.actor.routing import RoutingReplay

    from rlep_megatron import distributed
    from rlep_megatron.models import num_experts
    from rlep_megatron.actor import routing_store

    flat = [r for group in responses for r in group]
    # the tables stayed with the replica that generated them: every rank takes all of them
    # here (every rank is one "share"), as the trainer delivers each to the ranks training it
    world = torch.distributed.get_world_size()
    routing_store.deliver([flat], 0, [0] * world, distributed.rollout_group(),
                          num_experts(info.hf_config))
    input_ids, lengths = pad_sequences([prompts[r.prompt_index] + r.token_ids for r in flat],
                                       pad_id=PAD)
    replay = RoutingReplay(chunks)
    engine = {layer: torch.full((*input_ids.shape, replay.topk_size), -1, dtype=torch.int16)
              for layer in replay.layers}
    for row, r in enumerate(flat):
        for layer in replay.layers:
            engine[layer][row, :len(r.routing)] = torch.from_numpy(r.routing[:, layer])
    shifted = {layer: torch.cat([torch.full_like(e[:, :1], -1), e[:, :-1]], dim=1)
               for layer, e in engine.items()}
    out = {}
    for name, store in (("own", engine), ("shifted", shifted), ("followed", engine),
                        ("misaligned", engine)):
        follow = name in ("followed", "misaligned")
        with ExpertLoad(chunks) as load, _read_one_early(replay, name == "misaligned"), \
                replay.recording(*input_ids.shape, engine=store, follow_engine=follow) as used:
            actor_logprobs(chunks, info, input_ids, micro_batch_size=4, lengths=lengths,
                           pack_max_tokens=160)
        metrics = load.metrics(engine_routing=True)
        out[name] = {"mismatch_frac": metrics["rollout/routing_mismatch_frac"],
                     "compared": metrics["rollout/routing_compared"]}
        if follow:
            differ = torch.tensor([float(any(
                bool((used[layer][both] != store[layer].long()[both]).any())
                for layer in replay.layers
                for both in [(used[layer] >= 0) & (store[layer] >= 0)]))])
            distributed.all_reduce(differ, "max")
            out[name]["engine_experts_used"] = differ.item() == 0
    return out


@contextlib.contextmanager
def _read_one_early(replay, mutate: bool):
    """The mutation of :func:`routing_check`: the replay looks the engine's experts up at the
    previous column of each token."""
    if not mutate:
        yield
        return
    original = type(replay)._host_experts

    def early(self, table, rows, cols, fill):
        if table is self.engine:
            cols = (cols - 1).clamp(min=0)
        return original(self, table, rows, cols, fill)

    replay._host_experts = types.MethodType(early, replay)
    try:
        yield
    finally:
        del replay._host_experts


def common_prefix_diffs(before, after):
    """|after - before| of the engine's log-probs on tokens both samplings share."""
    diffs = []
    for group_a, group_b in zip(before, after):
        for a, b in zip(group_a, group_b):
            for ta, tb, la, lb in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
                if ta != tb:
                    break
                diffs.append(abs(la - lb))
    return diffs


def texts_as_vllm_decodes(engine, cfg, prompts, responses, seed):
    """The engine asks vLLM for no text and decodes each response itself: the same samples
    drawn again with vLLM's own detokenizer on must carry the same texts (this replica's
    prompts; every rank of the replica takes part). ``None`` without any response to check."""
    from vllm import SamplingParams

    from rlep_megatron.rollout.requests import request_seed

    n = cfg.num_samples_per_prompt
    mine = list(engine.share(prompts, n, cfg.max_response_tokens))
    if not mine:
        return None
    params = [SamplingParams(n=n, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                             max_tokens=cfg.max_response_tokens,
                             seed=request_seed(seed, i, n), logprobs=0) for i in mine]
    outputs = engine.llm.generate([{"prompt_token_ids": prompts[i]} for i in mine], params,
                                  use_tqdm=False)
    theirs = [[(list(c.token_ids), c.text) for c in out.outputs] for out in outputs]
    ours = [[(r.token_ids, r.text) for r in responses[i]] for i in mine]
    return {"checked": sum(len(g) for g in ours), "equal": theirs == ours,
            "texts": [t for g in ours for _, t in g][:4],
            "theirs": [t for g in theirs for _, t in g][:4]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--rollout-tp", type=int, default=1)
    parser.add_argument("--layouts", default="1x1",
                        help="comma-separated actor TPxPP, TPxPPxEP or TPxPPxEPxCP")
    parser.add_argument("--bucket-bytes", type=int, default=96 * 1024)
    parser.add_argument("--fail-sync", action="store_true")
    parser.add_argument("--sleep-cycle", action="store_true",
                        help="after the layouts: sleep, wake (weights), sync, generate, probe")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--eager-for-routing", action="store_true",
                        help="on a GPU, build the engine so that its routing can be captured "
                             "(as algo.routing_replay=rollout does)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    hf_config = load_hf_config(args.hf_dir)
    distributed.init_process_group()
    rank = torch.distributed.get_rank()
    cfg = RolloutConfig(num_samples_per_prompt=2, tensor_model_parallel_size=args.rollout_tp,
                        max_response_tokens=20, temperature=1.0)
    engine = RolloutEngine(args.hf_dir, cfg, dtype=args.dtype, seed=0, max_model_len=128,
                           capture_routing=num_experts(hf_config) > 0,
                           eager_for_routing=args.eager_for_routing)
    prompts = [chat(p) for p in PROMPTS]
    report = {"rollout_dp": engine.dp_size, "layouts": {},
              "routing_unavailable": engine.routing_unavailable}

    # reproducibility and per-prompt (so per-replica) sampling
    first = engine.generate(prompts, seed=11)
    again = engine.generate(prompts, seed=11)
    other = engine.generate(prompts, seed=12)
    same_prompt = engine.generate([prompts[0]] * 4, seed=11)
    tokens = lambda rs: [[r.token_ids for r in g] for g in rs]  # noqa: E731
    report["reproducible"] = tokens(first) == tokens(again)
    report["seed_changes_samples"] = tokens(first) != tokens(other)
    report["same_prompt_distinct_groups"] = len({json.dumps(g) for g in tokens(same_prompt)})
    report["finish_reasons"] = sorted({r.finish_reason for g in first for r in g})
    report["texts_as_vllm_decodes"] = texts_as_vllm_decodes(engine, cfg, prompts, first, 11)
    report["eos_token_id"] = engine.eos_token_id

    layouts = [item.split("x") for item in args.layouts.split(",")]
    for number, sizes in enumerate(layouts):
        tp, pp, ep, cp = (int(x) for x in sizes + ["1"] * (4 - len(sizes)))
        moe = num_experts(hf_config) > 0
        ctx = distributed.init_model_parallel(
            ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                           expert_model_parallel_size=ep, sequence_parallel=moe and tp > 1,
                           context_parallel_size=cp),
            seed=number, **layout_limits(hf_config))
        chunks, info = build_from_hf(args.hf_dir, args.dtype)
        optim_cfg = OptimConfig(lr=2e-2, lr_warmup_steps=0, weight_decay=0.0, clip_grad=1.0)
        chunks = wrap_ddp(chunks, optim_cfg.use_distributed_optimizer)
        optimizer = build_optimizer(chunks, optim_cfg, info.params_dtype)
        streamer = WeightStreamer(chunks, info, args.bucket_bytes)
        entry = {"buckets": len(streamer.buckets), "tensors": len(streamer.names),
                 "device": str(next(chunks[0].parameters()).device)}
        if engine.capturing_routing:
            # the checkpoint's routers (Adam's first steps at this lr flatten the tiny model's
            # routing: most tokens then pick the same experts)
            sync_weights(engine, streamer)
            entry["routing"] = routing_check(chunks, info, prompts,
                                             engine.generate(prompts, seed=61 + number))
        # the engine holds the previous layout's (or the checkpoint's) weights: step away first
        take_step(chunks, optimizer, info, ctx, prompts, first, seed=100 + number)
        entry["sync1"] = sync_weights(engine, streamer)
        before = engine.generate(prompts, seed=21 + number)
        entry["parity_before"] = probe(chunks, info, prompts, before, PAD)
        take_step(chunks, optimizer, info, ctx, prompts, before, seed=200 + number)
        entry["sync2"] = sync_weights(engine, streamer)
        after = engine.generate(prompts, seed=21 + number)
        entry["parity_after"] = probe(chunks, info, prompts, after, PAD)
        # temperature != 1 on both sides: vLLM samples at T = 0.7 and reports log-probs of the
        # tempered distribution; the actor divides its logits by the same T (and at T = 1 it
        # would disagree: the control that the temperature is really applied)
        warm = engine.generate(prompts, seed=41 + number, temperature=0.7)
        entry["parity_t07"] = probe(chunks, info, prompts, warm, PAD, temperature=0.7)
        entry["parity_t07_at_t1"] = probe(chunks, info, prompts, warm, PAD, temperature=1.0)
        diffs = common_prefix_diffs(before, after)
        entry["moved_tokens"] = len(diffs)
        entry["moved_mean_abs"] = sum(diffs) / max(len(diffs), 1)

        if args.fail_sync and number == len(layouts) - 1:
            def broken():
                for i, item in enumerate(streamer.iter_tensors()):
                    if i == len(streamer.names) // 2:
                        raise ConnectionError("simulated loss of the weight stream")
                    yield item
            try:
                deliver(engine, broken())
                entry["fail_raised"] = None
            except ConnectionError as err:
                entry["fail_raised"] = str(err)
            try:
                engine.generate(prompts, seed=1)
                entry["incomplete_refused"] = None
            except IncompleteWeightsError as err:
                entry["incomplete_refused"] = str(err)
            sync_weights(engine, streamer)
            recovered = engine.generate(prompts, seed=31)
            entry["parity_recovered"] = probe(chunks, info, prompts, recovered, PAD)
        if args.sleep_cycle and number == len(layouts) - 1:
            # the trainer's cycle around an update: release the engine (GPU sleep mode), wake
            # the weights, sync, then generate (which wakes the KV cache) and compare
            with engine.released():
                take_step(chunks, optimizer, info, ctx, prompts, after, seed=300 + number)
            entry["memory_after_wake"] = engine.memory_state()
            sync_weights(engine, streamer)
            cycled = engine.generate(prompts, seed=51 + number)
            entry["memory_after_generate"] = engine.memory_state()
            entry["parity_after_sleep"] = probe(chunks, info, prompts, cycled, PAD)
        report["layouts"]["x".join(sizes)] = entry
        if rank == 0:
            print(f"layout TP{tp}xPP{pp}xEP{ep}: {json.dumps(entry)}", flush=True)

    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    torch.distributed.barrier()
    engine.shutdown()
    distributed.destroy()


if __name__ == "__main__":
    main()
