"""The actor's memory and step time with LoRA against full fine-tuning, on CPU, at a mid shape
(Qwen2.5-0.5B's published configuration, random weights, float32): one process per arm, so each
peak resident memory is its own.

    python bench/lora_memory.py                       # full and LoRA rank 16 on all-linear
    python bench/lora_memory.py --rank 64 --steps 5

Each arm builds the actor with the trainer's code (``build_model``, megatron's DDP and
optimizer; LoRA attached as the learner attaches it), then times ``--steps`` optimizer steps
(forward, backward of the next-token log-prob loss over a ``--micro-batch`` x ``--seq-len``
batch, AdamW) after one untimed step. Printed per arm: the tensors counted on the objects
(weights, gradient buffer, Adam state), the process's peak resident memory
(``ru_maxrss``), and the median step time; then LoRA / full.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MID = dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
           num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
           tie_word_embeddings=True, max_position_embeddings=4096, rms_norm_eps=1e-6,
           rope_theta=1000000.0, hidden_act="silu", architectures=["Qwen2ForCausalLM"])


def measure(rank: int, micro_batch: int, seq_len: int, steps: int) -> dict:
    """One arm in this process (``rank`` 0: full fine-tuning)."""
    import torch
    from megatron.core import parallel_state as ps

    from rlep_megatron import distributed
    from rlep_megatron.actor.logprob import next_token_logprobs
    from rlep_megatron.actor.optimizer import build_optimizer, wrap_ddp
    from rlep_megatron.actor.packing import run_model
    from rlep_megatron.config import LoraConfig, OptimConfig, ParallelConfig
    from rlep_megatron.models.megatron import build_model

    distributed.init_model_parallel(ParallelConfig(), seed=0, num_attention_heads=14,
                                    num_query_groups=2, num_layers=24)
    (model,), info = build_model(MID, torch.float32)
    if rank:
        from rlep_megatron.lora.adapters import attach

        attach([model], info, LoraConfig(rank=rank, alpha=2.0 * rank), seed=0)
    (model,) = wrap_ddp([model], use_distributed_optimizer=False)
    optimizer = build_optimizer([model], OptimConfig(lr=1e-5, lr_warmup_steps=0,
                                                     use_distributed_optimizer=False),
                                torch.float32)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, MID["vocab_size"], (micro_batch, seq_len), generator=generator)
    positions = torch.arange(seq_len).unsqueeze(0).expand_as(ids)
    tp_group = ps.get_tensor_model_parallel_group()

    def step():
        optimizer.zero_grad([model])
        output = run_model(model, ids, positions, hidden_states=True)
        logp, _ = next_token_logprobs(model, info, output, ids, 0, tp_group, 1.0,
                                      with_entropy=False)
        (-logp.mean()).backward()
        model.finish_grad_sync()
        optimizer.step()

    step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    state = sum(t.numel() * t.element_size() for o in optimizer.torch_optimizers()
                for s in o.state.values() for t in s.values() if torch.is_tensor(t))
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in model.buffers)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    distributed.destroy()
    return {"rank": rank, "weights": weights, "grads": grads, "adam": state,
            "trainable": trainable, "peak_rss": resource.getrusage(
                resource.RUSAGE_SELF).ru_maxrss * 1024, "step_s": statistics.median(times),
            "steps": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank of the LoRA arm")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--arm", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm is not None:  # one arm, in its own process
        print(json.dumps(measure(args.arm, args.micro_batch, args.seq_len, args.steps)))
        return
    rows = {}
    for rank in (0, args.rank):
        out = subprocess.run([sys.executable, __file__, "--arm", str(rank), "--micro-batch",
                              str(args.micro_batch), "--seq-len", str(args.seq_len),
                              "--steps", str(args.steps)], capture_output=True, text=True)
        if out.returncode:
            sys.exit(out.stderr[-3000:])
        rows[rank] = json.loads(out.stdout.strip().splitlines()[-1])
    gib = 2 ** 30
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "CPU")
    print(f"{cpu}, {os.cpu_count()} cores; Qwen2.5-0.5B shape (494M parameters), float32, "
          f"micro-batch {args.micro_batch} x {args.seq_len} tokens, median of {args.steps} "
          "optimizer steps")
    print("arm | trainable params | weights (GiB) | gradient buffer (GiB) | Adam state (GiB) | "
          "peak RSS (GiB) | step (s)")
    print("--- | --- | --- | --- | --- | --- | ---")
    for rank, r in rows.items():
        name = "full fine-tuning" if rank == 0 else f"LoRA rank {rank}, all-linear"
        print(f"{name} | {r['trainable'] / 1e6:,.1f}M | {r['weights'] / gib:.2f} | "
              f"{r['grads'] / gib:.3f} | {r['adam'] / gib:.3f} | {r['peak_rss'] / gib:.2f} | "
              f"{r['step_s']:.2f}")
    full, lora = rows[0], rows[args.rank]
    print(f"LoRA / full: peak RSS {lora['peak_rss'] / full['peak_rss']:.2f}, step time "
          f"{lora['step_s'] / full['step_s']:.2f}")


if __name__ == "__main__":
    main()
