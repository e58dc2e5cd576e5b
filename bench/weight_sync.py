"""Megatron -> vLLM weight sync on a synthetic Qwen2-architecture model of a few GB.

    python bench/weight_sync.py [--hidden 2048] [--layers 16] [--bucket-mb 64 256 1024]
    torchrun --nproc-per-node 2 bench/weight_sync.py --actor-tp 2 --rollout-tp 2 ...

For each bucket size it reports, on rank 0:

* ``stream``: the gather/pack side alone (TP all-gather, HF re-layout, PP broadcast) drained
  without a consumer;
* ``sync``: the whole sync into the in-process vLLM engine (``RolloutEngine.load_weights``);
* the ratio of each to a plain memory copy of the same bytes (one ``copy_`` per parameter into
  a preallocated buffer), and the peak extra resident memory (RSS sampled every 2 ms, minus the
  RSS before the call) against the bucket size.

The actor is randomly initialised and the engine starts with dummy weights, so nothing is read
from disk. Large frees are returned to the OS (``MALLOC_MMAP_THRESHOLD_``) so RSS follows the
live buffers. Works on CPU (gloo) and GPU (NCCL; memory columns then report host RSS only).
"""
import argparse
import json
import os
import platform as py_platform
import shutil
import sys
import tempfile
import threading
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.execv(sys.executable, [sys.executable] + sys.argv)

import psutil  # noqa: E402
import torch  # noqa: E402


class PeakRss:
    """Peak RSS above the starting RSS while the block runs."""

    def __init__(self, interval_s: float = 0.002):
        self.interval_s = interval_s
        self.process = psutil.Process()

    def __enter__(self):
        self.base = self.process.memory_info().rss
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(self.interval_s)

    def __exit__(self, *_exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def extra_bytes(self) -> int:
        return self.peak - self.base


def write_model_dir(directory: str, hidden: int, layers: int, vocab: int) -> dict:
    """The tiny model's tokenizer files plus a config.json of the synthetic size (no weights:
    the engine starts with dummy weights and the actor with random ones)."""
    from rlep_megatron.tiny_model import make_tiny_model

    make_tiny_model(directory, seed=0, arch="qwen2")
    os.remove(os.path.join(directory, "model.safetensors"))
    config = json.load(open(os.path.join(directory, "config.json")))
    heads, kv_heads, head_dim = hidden // 128, max(1, hidden // 512), 128
    config.update(hidden_size=hidden, intermediate_size=int(hidden * 2.75),
                  num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
                  layer_types=["full_attention"] * layers, tie_word_embeddings=False,
                  dtype="float32")
    json.dump(config, open(os.path.join(directory, "config.json"), "w"), indent=1)
    return config


def memcpy_seconds(chunks, repeats: int) -> float:
    """One copy of every parameter into a preallocated buffer (best of ``repeats``)."""
    params = [p for c in chunks for p in c.parameters()]
    buffer = torch.empty(max(p.numel() for p in params), dtype=params[0].dtype,
                         device=params[0].device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for p in params:
            buffer[:p.numel()].view(p.shape).copy_(p.detach())
        if buffer.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def timed(fn, repeats: int):
    """Best wall time and the largest peak extra RSS over ``repeats`` runs (barrier-aligned)."""
    best, extra = float("inf"), 0
    for _ in range(repeats):
        torch.distributed.barrier()
        with PeakRss() as rss:
            start = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            torch.distributed.barrier()
            elapsed = time.perf_counter() - start
        best, extra = min(best, elapsed), max(extra, rss.extra_bytes)
    return best, extra


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--bucket-mb", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--actor-tp", type=int, default=1)
    parser.add_argument("--actor-pp", type=int, default=1)
    parser.add_argument("--rollout-tp", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-engine", action="store_true",
                        help="measure the gather/pack side only (no vLLM)")
    args = parser.parse_args()

    from rlep_megatron import distributed
    from rlep_megatron.models.megatron import build_model
    from rlep_megatron.config import ParallelConfig, RolloutConfig
    from rlep_megatron.weight_sync import WeightStreamer, sync_weights

    distributed.init_process_group()
    rank = torch.distributed.get_rank()
    work = tempfile.mkdtemp(prefix="rlep-bench-sync-") if rank == 0 else None
    holder = [work]
    torch.distributed.broadcast_object_list(holder, src=0)
    work = holder[0]
    model_dir = os.path.join(work, "model")
    if rank == 0:
        write_model_dir(model_dir, args.hidden, args.layers, args.vocab)
    torch.distributed.barrier()
    hf_config = json.load(open(os.path.join(model_dir, "config.json")))
    try:
        distributed.init_model_parallel(
            ParallelConfig(tensor_model_parallel_size=args.actor_tp,
                           pipeline_model_parallel_size=args.actor_pp), seed=0,
            num_attention_heads=hf_config["num_attention_heads"],
            num_query_groups=hf_config["num_key_value_heads"],
            num_layers=hf_config["num_hidden_layers"])
        dtype = getattr(torch, args.dtype)
        chunks, info = build_model(hf_config, dtype)
        engine = None
        if not args.no_engine:
            from rlep_megatron.rollout import RolloutEngine

            engine = RolloutEngine(model_dir, RolloutConfig(
                tensor_model_parallel_size=args.rollout_tp, enable_sleep_mode=False),
                dtype=args.dtype, max_model_len=256, load_weights=False)
        copy_s = memcpy_seconds(chunks, args.repeats)
        rows = []
        for bucket_mb in args.bucket_mb:
            streamer = WeightStreamer(chunks, info, bucket_mb * 2**20)
            total = streamer.total_bytes

            def drain():
                for _ in streamer.iter_tensors():
                    pass

            stream_s, stream_extra = timed(drain, args.repeats)
            sync_s = sync_extra = None
            if engine is not None:
                sync_s, sync_extra = timed(lambda: sync_weights(engine, streamer), args.repeats)
            rows.append((bucket_mb, len(streamer.buckets), total, stream_s, stream_extra,
                         sync_s, sync_extra))
        if rank == 0:
            local = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
            print(f"machine: {py_platform.machine()}, {os.cpu_count()} CPUs, "
                  f"{'CUDA' if torch.cuda.is_available() else 'CPU'}; world "
                  f"{torch.distributed.get_world_size()}, actor TP{args.actor_tp} x "
                  f"PP{args.actor_pp}, rollout TP{args.rollout_tp}; synthetic Qwen2 "
                  f"{args.dtype}, hidden {args.hidden}, {args.layers} layers: HF tensors "
                  f"{total / 1e9:.2f} GB, rank 0 shard {local / 1e9:.2f} GB")
            print(f"memcpy of rank 0's shard: {copy_s:.2f} s = {local / 1e9 / copy_s:.2f} GB/s")
            print("bucket MB | buckets | stream s | stream GB/s | stream / memcpy | "
                  "stream peak extra MB | sync s | sync GB/s | sync / memcpy | "
                  "sync peak extra MB | sync peak / bucket")
            print("--- | --- | --- | --- | --- | --- | --- | --- | --- | --- | ---")
            memcpy_rate = local / copy_s
            for bucket_mb, buckets, total, s_s, s_x, y_s, y_x in rows:
                sync_cols = ("n/a | n/a | n/a | n/a | n/a" if y_s is None else
                             f"{y_s:.2f} | {total / 1e9 / y_s:.2f} | "
                             f"{total / y_s / memcpy_rate:.2f} | {y_x / 2**20:.0f} | "
                             f"{y_x / (bucket_mb * 2**20):.2f}")
                print(f"{bucket_mb} | {buckets} | {s_s:.2f} | {total / 1e9 / s_s:.2f} | "
                      f"{total / s_s / memcpy_rate:.2f} | {s_x / 2**20:.0f} | {sync_cols}")
        if engine is not None:
            torch.distributed.barrier()
            engine.shutdown()
    finally:
        if rank == 0:
            shutil.rmtree(work, ignore_errors=True)
        distributed.destroy()


if __name__ == "__main__":
    main()
