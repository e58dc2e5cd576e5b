"""Program: a Megatron actor (this process, one rank) and a stock ``vllm serve`` process (vLLM's
CPU build, started here with dummy weights), connected as ``rollout.placement: separate``
connects them: generation over the token-in/out route, weights through vLLM's weight-transfer
lifecycle with the ``rlep_gloo`` backend.

Checks, written to ``--out`` as JSON for the pytest side:

1. parity: after a sync, the server's log-probs of its own samples against the actor's
   recomputation (every token), twice with an optimizer step between the syncs (the second
   sync must move the server's log-probs); the server samples what an in-process engine with
   the same weights samples, given the same seeds;
2. pause / resume with ``rollout.carry_over`` keep, resume and restart: long requests paused
   midway around an optimizer step and weight update; their version spans and tokens, and
   each span's log-probs against the actor's before and after the step;
3. two servers driven as one: a weight sync reaches both (one transfer group), each prompt is
   sampled by its own server, and the log-probs of both equal the actor's;
4. failure: the server killed (SIGKILL) while requests are in flight, and while none are: how
   long until the trainer side raises, and the error.
"""
from tests import pause_gc_in_program

pause_gc_in_program(__name__)
import argparse
import json
import os
import signal
import time

import torch

from rlep_megatron import distributed
from rlep_megatron.actor.forward import actor_logprobs_everywhere
from rlep_megatron.actor.model import build_from_hf
from rlep_megatron.actor.optimizer import build_optimizer, wrap_ddp
from rlep_megatron.checkpoint.hf_io import load_hf_config
from rlep_megatron.config import OptimConfig, ParallelConfig, RolloutConfig
from rlep_megatron.models import layout_limits
from rlep_megatron.rollout.parity import probe
from rlep_megatron.rollout.servers.client import RolloutServerError
from rlep_megatron.rollout.servers.engine import ServerEngine
from rlep_megatron.rollout.servers.launch import LocalServer
from rlep_megatron.rollout.servers.weights import plan_source, stream_source
from rlep_megatron.weight_sync import WeightStreamer, sync_weights
from tests.torchrun import store_port
from tests.vllm.rollout_sync_program import PAD, PROMPTS, chat, common_prefix_diffs, take_step

SERVER_TIMEOUT_S = 120.0  # rollout.server_timeout_s of the checks before the kill (10 s there)


def generated_tokens(url: str, timeout_s: float = 60.0) -> float:
    """The server's count of tokens generated so far (its Prometheus ``/metrics``). A read the
    server's API process does not answer within 5 s (busy on a loaded machine: a CI run with
    a core kept busy timed out here) is tried again, up to ``timeout_s`` in all."""
    import urllib.request
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
                text = response.read().decode()
            break
        except (TimeoutError, OSError):  # urllib's URLError and socket timeouts are OSErrors
            if time.monotonic() > deadline:
                raise
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total"))


def wait_for_tokens(url: str, start: float, count: int, timeout_s: float = 60.0) -> None:
    """Until the server at ``url`` has generated ``count`` tokens since its counter read
    ``start``; an error after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while generated_tokens(url) - start < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} generated {generated_tokens(url) - start:g} of the "
                               f"{count} tokens waited for within {timeout_s:g} s")
        time.sleep(0.25)  # a slow poll: each read is work for the server's API process


def _span_logprobs(chunks, info, prompts, requests):
    """Per request, the actor's log-prob of each response token with its current weights."""
    keys = sorted(requests.pending)
    sequences = [list(prompts[key[1]]) + list(requests.pending[key].token_ids) for key in keys]
    logp = actor_logprobs_everywhere(chunks, info, sequences, PAD)
    return {key: logp[row, len(prompts[key[1]]):len(sequences[row])].tolist()
            for row, key in enumerate(keys)}


def _worst(pairs):
    """max |a - b| over ``(engine, actor)`` log-prob pairs, and how many."""
    return {"max": max((abs(a - b) for a, b in pairs), default=0.0), "tokens": len(pairs)}


def spans_check(engine, cfg, streamer, prompts, carry_over, version, actor):
    """Four long requests, paused once the server has generated a few tokens of each, an
    optimizer step taken, the weights updated to ``version``, then resumed: per request its
    version spans, length, tokens before the pause kept, and whether it had finished before
    the pause (a fast CPU may finish one; it has nothing to carry over). Each span's
    log-probs are compared with the actor's at that span's version (``actor``: the chunks,
    their info and a ``step()`` that changes the weights): the old span with the weights
    before the step, the new with those after (``keep`` goes on with the old weights' KV cache,
    so its new span matches neither exactly and is not compared)."""
    chunks, info, step = actor
    requests = engine.requests(cfg)
    requests.version = version - 1
    start = generated_tokens(engine.urls[0])
    for i in range(4):
        requests.submit((0, i, 0), prompts[i], 1000 + i)
    # pause on progress, not after a fixed time: the server's speed differs between CPUs
    wait_for_tokens(engine.urls[0], start, 4 * 16)
    requests.pause(carry_over)
    done = {k for k, item in requests.pending.items() if item.finish_reason is not None}
    before = {k: list(item.token_ids) for k, item in requests.pending.items()}
    params = [p for chunk in chunks for p in chunk.parameters()]
    old_weights = [p.detach().clone() for p in params]
    step()
    sync_weights(engine, streamer, version)
    requests.resume(version)
    requests.run_until(lambda: requests.finished(0))
    new_logp = _span_logprobs(chunks, info, prompts, requests)
    new_weights = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, w in zip(params, old_weights):
            p.copy_(w)
        old_logp = _span_logprobs(chunks, info, prompts, requests)
        for p, w in zip(params, new_weights):
            p.copy_(w)
    out, old_pairs, new_pairs, moved = [], [], [], []
    for key in sorted(requests.pending):
        item = requests.pending[key]
        cut = 0
        for span_version, count in item.versions:
            span = range(cut, cut + count)
            actor_logp = old_logp[key] if span_version == version - 1 else new_logp[key]
            pairs = [(item.logprobs[t], actor_logp[t]) for t in span]
            if span_version == version - 1:
                old_pairs += pairs
            elif carry_over != "keep":
                new_pairs += pairs
                moved += [abs(old_logp[key][t] - new_logp[key][t]) for t in span]
            cut += count
        out.append({"versions": item.versions, "length": len(item.token_ids),
                    "kept_prefix": item.token_ids[:len(before[key])] == before[key],
                    "tokens_before": len(before[key]), "done_before": key in done,
                    "logprobs": len(item.logprobs), "finish": item.finish_reason})
    return {"requests": out, "old_span": _worst(old_pairs), "new_span": _worst(new_pairs),
            # the step moved the actor's log-probs of the new spans' tokens: a span compared
            # with the wrong version would not match
            "moved_max": max(moved, default=0.0)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--log", required=True)
    args = parser.parse_args()
    hf_config = load_hf_config(args.hf_dir)
    distributed.init_process_group()
    cfg = RolloutConfig(num_samples_per_prompt=2, max_response_tokens=20, temperature=1.0,
                        weight_sync_bucket_bytes=96 * 1024)
    # ports below the ephemeral range: a server binds its port after its imports, and a port
    # found free by bind(0) may be another process's outgoing connection's by then
    server = LocalServer(args.hf_dir, cfg, dtype="float32", seed=0, max_model_len=2048,
                         log_path=args.log, port=store_port())
    # a second server for the two-server check, starting meanwhile
    second = LocalServer(args.hf_dir, cfg, dtype="float32", seed=0, max_model_len=2048,
                         log_path=args.log + ".second", port=store_port())
    report = {}
    try:
        url = server.wait_ready(600)
        engine = ServerEngine([url], args.hf_dir, cfg, timeout_s=SERVER_TIMEOUT_S,
                              watchdog=False)
        ctx = distributed.init_model_parallel(ParallelConfig(), seed=0,
                                              **layout_limits(hf_config))
        chunks, info = build_from_hf(args.hf_dir, "float32")
        optim_cfg = OptimConfig(lr=2e-2, lr_warmup_steps=0, weight_decay=0.0, clip_grad=1.0)
        chunks = wrap_ddp(chunks, optim_cfg.use_distributed_optimizer)
        optimizer = build_optimizer(chunks, optim_cfg, info.params_dtype)
        streamer = WeightStreamer(chunks, info, cfg.weight_sync_bucket_bytes)
        prompts = [chat(p) for p in PROMPTS]
        # the source vLLM's NCCL engine (GPU) would read: its declared metadata is the stream
        source = stream_source()
        plan_source(source, streamer.plan())
        declared = [(m.name, str(m.dtype), list(m.shape)) for m in source.metadata()]
        streamed = [(n, str(t.dtype), list(t.shape)) for n, t in streamer.iter_tensors()]
        report["nccl_source_metadata"] = {"equal": declared == streamed,
                                          "tensors": len(declared)}

        try:
            engine.generate(prompts, seed=1)
            report["dummy_refused"] = None
        except RuntimeError as err:
            report["dummy_refused"] = str(err)
        report["sync0"] = sync_weights(engine, streamer, 0)
        first = engine.generate(prompts, seed=11)
        report["buckets"] = len(streamer.buckets)
        report["parity_checkpoint"] = probe(chunks, info, prompts, first, PAD)
        again = engine.generate(prompts, seed=11)
        tokens = lambda rs: [[r.token_ids for r in g] for g in rs]  # noqa: E731
        report["reproducible"] = tokens(first) == tokens(again)
        report["first_tokens"] = tokens(first)
        report["first_logprobs"] = [[r.logprobs for r in g] for g in first]
        take_step(chunks, optimizer, info, ctx, prompts, first, seed=100)
        report["sync1"] = sync_weights(engine, streamer, 1)
        before = engine.generate(prompts, seed=21)
        report["parity_before"] = probe(chunks, info, prompts, before, PAD)
        take_step(chunks, optimizer, info, ctx, prompts, before, seed=200)
        report["sync2"] = sync_weights(engine, streamer, 2)
        after = engine.generate(prompts, seed=21)
        report["parity_after"] = probe(chunks, info, prompts, after, PAD)
        warm = engine.generate(prompts, seed=41, temperature=0.7)
        report["parity_t07"] = probe(chunks, info, prompts, warm, PAD, temperature=0.7)
        diffs = common_prefix_diffs(before, after)
        report["moved_tokens"] = len(diffs)
        report["moved_mean_abs"] = sum(diffs) / max(len(diffs), 1)

        # long responses: every one is still generating at the pause, which comes once the
        # four have 64 tokens between them (polled every 0.25 s: even a server at 400 tokens
        # a second per request is at about 120 each by then, far from 512)
        long_cfg = RolloutConfig(num_samples_per_prompt=1, max_response_tokens=512,
                                 temperature=1.0)
        engine.cfg = long_cfg
        engine.extra_sampling = {"ignore_eos": True}
        report["spans"] = {}
        for number, carry_over in enumerate(("keep", "resume", "restart")):
            sync_weights(engine, streamer, 9 + 2 * number)
            step = lambda: take_step(chunks, optimizer, info, ctx, prompts,  # noqa: E731
                                     after, seed=300 + number)
            report["spans"][carry_over] = spans_check(engine, long_cfg, streamer, prompts,
                                                      carry_over, 10 + 2 * number,
                                                      (chunks, info, step))
        engine.cfg, engine.extra_sampling = cfg, {}

        # two servers driven as one: the second's worker joins the transfer group after the
        # first's; each prompt's samples come from its own server, both with the new weights
        engine.shutdown()  # the first server drops its transfer group, and joins the new one
        url2 = second.wait_ready(600)
        pair = ServerEngine([url, url2], args.hf_dir, cfg, timeout_s=SERVER_TIMEOUT_S,
                            watchdog=False)
        sync_weights(pair, streamer, 20)
        counts = [generated_tokens(u) for u in (url, url2)]
        shared = pair.generate(prompts, seed=51, version=20)
        report["two_servers"] = {
            "workers": pair.clients.workers,
            "parity": probe(chunks, info, prompts, shared, PAD),
            "generated": [generated_tokens(u) - c for u, c in zip((url, url2), counts)],
            "versions": sorted({v for g in shared for r in g for v, _ in r.versions}),
            "tokens": sum(len(r.token_ids) for g in shared for r in g)}
        pair.shutdown()
        second.stop()
        engine = ServerEngine([url], args.hf_dir, cfg, timeout_s=SERVER_TIMEOUT_S,
                              watchdog=False)
        sync_weights(engine, streamer, 21)

        # failure: killed with requests in flight (up to 1984 tokens each: none can finish
        # before the kill, on any CPU). From here the health check's timeout is 10 s; the
        # checks above had a longer one, which a busy host's slow /health answers do not reach
        engine.health.timeout_s = 10.0
        engine.extra_sampling = {"ignore_eos": True}
        requests = engine.requests(RolloutConfig(num_samples_per_prompt=1,
                                                 max_response_tokens=1984, temperature=1.0))
        start = generated_tokens(url)
        for i in range(2):
            requests.submit((0, i, 0), prompts[i], 2000 + i)
        wait_for_tokens(url, start, 2 * 8)  # generating, far from done
        os.killpg(server.process.pid, signal.SIGKILL)
        killed = time.monotonic()
        try:
            requests.run_until(lambda: requests.finished(0))
            report["killed_in_flight"] = None
        except RolloutServerError as err:
            report["killed_in_flight"] = {"error": str(err),
                                          "seconds": time.monotonic() - killed}
        # and with nothing in flight: the health check's timeout
        engine.health.failure = None
        try:
            while True:
                engine.check_alive()
                time.sleep(0.5)
        except RolloutServerError as err:
            report["killed_idle"] = {"error": str(err), "seconds": time.monotonic() - killed}
        report["url"] = url
        engine.shutdown()
    finally:
        server.stop()
        second.stop()
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    distributed.destroy()


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
