"""Conversion throughput and peak memory on a synthetic Qwen2-architecture checkpoint of a few
GB: HF -> megatron (tools/convert_hf_to_mcore.py) and back (tools/convert_mcore_to_hf.py).

    python bench/convert.py [--hidden 2048] [--layers 8] [--max-shard-gb 0.5] [--workdir DIR]

Each tool runs as its own process; peak RSS is that process's maximum resident set size. Both
tools stream, so the expected peak is the process's baseline (python, torch, megatron-core)
plus about one layer, plus, megatron -> HF, the safetensors shard being filled
(``--max-shard-gb``).
"""
import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def make_checkpoint(directory: str, hidden: int, layers: int, vocab: int) -> tuple[int, int]:
    """Random fp32 Qwen2 weights in safetensors (no transformers model needed); returns
    (total bytes, largest tensor bytes)."""
    import torch
    from safetensors.torch import save_file

    heads, kv_heads, head_dim, ffn = hidden // 128, max(1, hidden // 512), 128, int(hidden * 2.75)
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "dtype": "float32",
              "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": head_dim, "vocab_size": vocab, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
              "hidden_act": "silu", "use_sliding_window": False}
    os.makedirs(directory, exist_ok=True)
    json.dump(config, open(os.path.join(directory, "config.json"), "w"))
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
              "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.q_proj.bias": (heads * head_dim,),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.k_proj.bias": (kv_heads * head_dim,),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.bias": (kv_heads * head_dim,),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (ffn, hidden), p + "mlp.up_proj.weight": (ffn, hidden),
            p + "mlp.down_proj.weight": (hidden, ffn)})
    tensors = {name: torch.randn(shape, generator=g) * 0.02 for name, shape in shapes.items()}
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    sizes = [t.numel() * 4 for t in tensors.values()]
    return sum(sizes), max(sizes)


def run_tool(args: list[str]) -> tuple[float, float, str]:
    env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, *args, "--no-progress"], cwd=ROOT, env=env,
                                stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS
        elapsed = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode:
            raise RuntimeError(err.read()[-3000:])
        return elapsed, usage.ru_maxrss / 1024, out.read().strip().splitlines()[-1]


_BASELINE = """
from rlep_megatron.checkpoint.convert import _single_process_model_parallel
_single_process_model_parallel()
"""


def baseline_rss_mb() -> float:
    """Peak RSS of a process that only imports the tools' modules and sets up model parallelism
    (what every conversion pays before touching a tensor)."""
    env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.Popen([sys.executable, "-c", _BASELINE], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, _, usage = os.wait4(proc.pid, 0)
    return usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--max-shard-gb", type=float, default=0.5,
                        help="safetensors shard size of the megatron -> HF output")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="rlep-bench-convert-")
    try:
        hf, mcore, back = (os.path.join(work, n) for n in ("hf", "mcore", "back"))
        # in a child process: a forked child's peak RSS counts the parent's resident pages at
        # fork time, so the bench process itself must stay small
        code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})"
                f"; from convert import make_checkpoint; print(*make_checkpoint({hf!r}, "
                f"{args.hidden}, {args.layers}, {args.vocab}))")
        made = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                              text=True)
        total, largest = map(int, made.stdout.split())
        rows = []
        elapsed, peak, line = run_tool(["tools/convert_hf_to_mcore.py", "--hf-dir", hf,
                                        "--out-dir", mcore])
        rows.append(("HF -> megatron", elapsed, peak, line))
        elapsed, peak2, line = run_tool(["tools/convert_mcore_to_hf.py", "--mcore-dir", mcore,
                                         "--out-dir", back, "--max-shard-gb",
                                         str(args.max_shard_gb)])
        rows.append(("megatron -> HF", elapsed, peak2, line))
        layer = (total - 2 * largest) / args.layers
        baseline = baseline_rss_mb()
        print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs; synthetic Qwen2 fp32, "
              f"hidden {args.hidden}, {args.layers} layers: {total / 1e9:.2f} GB, largest "
              f"tensor {largest / 1e9:.3f} GB, one layer {layer / 1e9:.3f} GB; HF shards of "
              f"{args.max_shard_gb} GB; baseline RSS (imports + model-parallel set-up) "
              f"{baseline / 1024:.2f} GB")
        print("direction | wall s (incl. start-up) | GB/s | peak RSS GB | "
              "peak above baseline GB | above baseline / largest tensor | peak / checkpoint | "
              "tool summary")
        print("--- | --- | --- | --- | --- | --- | --- | ---")
        for name, elapsed, peak, line in rows:
            extra = (peak - baseline) * 2**20
            print(f"{name} | {elapsed:.1f} | {total / 1e9 / elapsed:.2f} | {peak / 1024:.2f} | "
                  f"{extra / 1e9:.2f} | {extra / largest:.1f} | {peak * 2**20 / total:.2f} | "
                  f"{line}")
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
