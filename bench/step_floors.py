"""Each phase of an RL step next to its floor, measured in one run on the same batch.

    python bench/step_floors.py --config examples/tiny_cpu_baseline.yaml \\
        model.hf_dir=outputs/tiny/model data.train_files=[outputs/tiny/task/train.parquet]

Per step (the trainer's own objects and phases, one process, TP1):

* rollout: the trainer's rollout phase next to a raw ``LLM.generate`` of the same requests with
  the same sampling parameters on the same engine, with the per-request seeds and without, and
  next to transformers' ``generate`` of the same prompts (left-padded into one batch, the same
  temperature / top-p / top-k, ``n`` samples each, up to the same response budget) on the
  run's model with the actor's current weights;
* old_logprob: the trainer's pass (old log-probs of every mini-batch) next to a plain
  transformers forward of the same sequences in the same dtype, padded micro-batches of the
  same token budget, with the same log-softmax gather;
* train: the trainer's optimizer steps next to transformers forward + backward of the same
  mini-batches with the same loss, plus torch's AdamW step;
* weight_sync: the trainer's sync next to a copy of the same bytes (every parameter into a
  preallocated buffer);
* the padding fraction of the trained token slots (``train/padding_frac``).

Medians over ``--steps`` steps after ``--warmup``; the table prints seconds, floor and ratio,
and a plain transformers step (its generate, forward and train phases) against the trainer's
whole step, with the tokens each side generated. The CPU and torch's thread count are printed
with it. Timings are only comparable within one run on a shared machine.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def raw_generate(trainer, prompts, seed, seeded: bool) -> float:
    """``LLM.generate`` of the rollout's requests, nothing else."""
    from rlep_megatron.rollout.requests import request_seed

    engine, cfg = trainer.engine, trainer.cfg.rollout
    n = cfg.num_samples_per_prompt
    params = [engine.sampling_params(n, cfg.temperature, cfg.top_p, cfg.top_k,
                                     cfg.max_response_tokens,
                                     request_seed(seed, i, n) if seeded else None)
              for i in range(len(prompts))]
    requests = [{"prompt_token_ids": list(p)} for p in prompts]
    _, seconds = _timed(lambda: engine.llm.generate(requests, params, use_tqdm=False))
    return seconds


def plain_generate(model, prompts, cfg, pad_id: int, eos_id: int, seed: int
                   ) -> tuple[float, int]:
    """transformers' ``generate`` of the rollout's prompts in one left-padded batch with the
    rollout's sampling settings (``bench/plain_rl.py``'s sampler); returns (seconds, response
    tokens generated, each through its EOS)."""
    from bench.plain_rl import sample

    start = time.perf_counter()
    groups = sample(model, prompts, cfg.num_samples_per_prompt, cfg.max_response_tokens,
                    cfg.temperature, cfg.top_p, cfg.top_k, pad_id, eos_id, seed)
    return time.perf_counter() - start, sum(len(r) for group in groups for r in group)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


def plain_model(trainer):
    """The run's model as a transformers module with the actor's current weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(trainer.cfg.model.hf_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=trainer.learner.info.params_dtype)
    weights = {name: tensor.clone() for name, tensor in trainer.learner.streamer.iter_tensors()}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise RuntimeError(f"weights do not match the transformers model: {missing} "
                           f"{unexpected}")
    model.tie_weights()
    return model.to(next(trainer.learner.chunks[0].parameters()).device)  # the actor's device


def _padded_groups(lengths, budget):
    from rlep_megatron.actor.train_step import split_by_token_budget

    return split_by_token_budget(lengths, budget)


def plain_logprobs(model, ids, rows, temperature):
    import torch

    x = ids[rows].to(model.device)
    logits = model(x).logits[:, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, x[:, 1:, None])[..., 0]


def plain_old_logprob(model, train_batches, budget, temperature) -> float:
    import torch

    start = time.perf_counter()
    with torch.no_grad():
        for tb in train_batches:
            lengths = tb.lengths()
            for rows in _padded_groups(lengths.tolist(), budget):
                width = int(lengths[rows].max())
                plain_logprobs(model, tb.input_ids[:, :width], rows, temperature)
    return time.perf_counter() - start


def plain_train(model, optimizer, train_batches, budget, algo, temperature) -> float:
    import torch

    from rlep_megatron.algo import policy_loss

    start = time.perf_counter()
    for tb in train_batches:
        lengths = tb.lengths()
        tokens = float(tb.response_mask.sum())
        optimizer.zero_grad(set_to_none=True)
        for rows in _padded_groups(lengths.tolist(), budget):
            width = int(lengths[rows].max())
            logp = plain_logprobs(model, tb.input_ids[:, :width], rows, temperature)
            logp = torch.cat([torch.zeros_like(logp[:, :1]), logp], 1)
            device = logp.device
            loss, _ = policy_loss(logp, tb.old_logp[rows, :width].to(device),
                                  tb.advantages[rows].to(device),
                                  tb.response_mask[rows, :width].to(device), algo.clip_ratio_low,
                                  algo.clip_ratio_high, algo.clip_ratio_c,
                                  global_num_tokens=tokens)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return time.perf_counter() - start


def copy_floor(trainer) -> float:
    import torch

    sources = [p.detach() for chunk in trainer.learner.chunks for p in chunk.parameters()]
    targets = [torch.empty_like(p) for p in sources]
    start = time.perf_counter()
    for src, dst in zip(sources, targets):
        dst.copy_(src)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_intermixed_args()

    import tempfile

    import torch

    from rlep_megatron.config import load_config
    from rlep_megatron.actor.old_logprob import mini_batch_plan
    from rlep_megatron.trainer import Trainer

    out_dir = tempfile.mkdtemp(prefix="step_floors_")
    cfg = load_config(args.config, list(args.overrides) + [
        f"trainer.output_dir={out_dir}", "trainer.validation_interval_steps=0",
        "checkpoint.save_interval_steps=0", "trainer.loggers=[]"])
    trainer = Trainer(cfg)
    learner, side = trainer.learner, trainer.rollout
    trainer.sync_weights()
    plain = plain_model(trainer)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=cfg.optim.lr,
                                        weight_decay=cfg.optim.weight_decay)
    budget, temperature = cfg.trainer.micro_batch_max_tokens, cfg.rollout.temperature
    eos_id = trainer.engine.eos_token_id
    pad_id = eos_id if getattr(plain.config, "pad_token_id", None) is None \
        else plain.config.pad_token_id
    rows: dict[str, list[float]] = {}
    padding: list[float] = []
    for step in range(args.warmup + args.steps):
        seed = side.seed(trainer.step, 0)
        batch, rollout_s = _timed(lambda: side.fresh_batch(trainer.step, 0))
        seeded = raw_generate(trainer, batch.prompts, seed, seeded=True)
        unseeded = raw_generate(trainer, batch.prompts, seed, seeded=False)
        generated = float(batch.generated_tokens)
        plain.load_state_dict({name: tensor for name, tensor in
                               trainer.learner.streamer.iter_tensors()}, strict=False)
        hf_gen, hf_tokens = plain_generate(plain, batch.prompts, cfg.rollout, pad_id, eos_id,
                                             seed)
        side.add_replays(batch, trainer.step)
        side.reward(batch)
        learner.advantage(batch)
        plan = mini_batch_plan(len(batch.sequences), cfg)
        with trainer.engine.released():  # as in a step (GPU: the engine sleeps meanwhile)
            (train_batches, _), old_s = _timed(
                lambda: learner.old_logprob(batch, plan, trainer.step))
            old_floor = plain_old_logprob(plain, train_batches, budget, temperature)
            train_metrics, train_s = _timed(lambda: learner.train(train_batches, trainer.step))
            train_floor = plain_train(plain, plain_optimizer, train_batches, budget, cfg.algo,
                                      temperature)
        _, sync_s = _timed(trainer.sync_weights)
        sync_floor = copy_floor(trainer)
        trainer.step += 1
        if step < args.warmup:
            continue
        step_s = rollout_s + old_s + train_s + sync_s
        for name, value in (("rollout", rollout_s), ("rollout/raw_seeded", seeded),
                            ("rollout/raw_unseeded", unseeded), ("rollout/transformers", hf_gen),
                            ("tokens/ours", generated), ("tokens/transformers", hf_tokens),
                            ("step", step_s),
                            ("step/plain", hf_gen + old_floor + train_floor),
                            ("old_logprob", old_s),
                            ("old_logprob/floor", old_floor), ("train", train_s),
                            ("train/floor", train_floor), ("weight_sync", sync_s),
                            ("weight_sync/floor", sync_floor)):
            rows.setdefault(name, []).append(value)
        padding.append(train_metrics.get("padding_frac", float("nan")))  # older code: none
    trainer.close()

    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"\n{cpu_name()}, {torch.get_num_threads()} torch threads")
    print(f"{args.steps} steps (median), "
          f"packing={getattr(cfg.trainer, 'sequence_packing', 'n/a')}, "
          f"padding fraction of trained slots {statistics.median(padding):.3f}")
    print(f"{'phase':<14}{'seconds':>10}{'floor':>10}{'ratio':>8}  floor is")
    for phase, floor, what in (
            ("rollout", "rollout/raw_seeded", "raw LLM.generate, same seeded requests"),
            ("rollout", "rollout/raw_unseeded", "raw LLM.generate, unseeded"),
            ("rollout", "rollout/transformers", "transformers generate, same sampling"),
            ("old_logprob", "old_logprob/floor", "transformers forward, padded"),
            ("train", "train/floor", "transformers fwd+bwd + AdamW, padded"),
            ("weight_sync", "weight_sync/floor", "copy of the parameters' bytes")):
        print(f"{phase:<14}{med[phase]:>10.3f}{med[floor]:>10.3f}"
              f"{med[phase] / max(med[floor], 1e-9):>8.2f}  {what}")
    print(f"{'step':<14}{med['step']:>10.3f}{med['step/plain']:>10.3f}"
          f"{med['step'] / max(med['step/plain'], 1e-9):>8.2f}  plain transformers step "
          f"(generate + forward + fwd/bwd/AdamW); ours incl. weight sync")
    print(f"response tokens generated per step (median): ours {med['tokens/ours']:.0f}, "
          f"transformers {med['tokens/transformers']:.0f}")
    from rlep_megatron import distributed

    distributed.destroy()


if __name__ == "__main__":
    main()
