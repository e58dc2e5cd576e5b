"""An independent learning reference: the RL loop of a recipe written plainly on transformers
(``generate``, forward, backward, ``torch.optim.AdamW``), none of the trainer's code.

    python bench/plain_rl.py --config examples/tiny_cpu_baseline.yaml --out outputs/plain/seed_1 \\
        model.hf_dir=outputs/tiny/model data.train_files=[outputs/tiny/task/train.parquet] \\
        data.val_files=[outputs/tiny/task/val.parquet] trainer.seed=1

What it shares with ``rlep train`` is the task's definition only: the parquet reader, the chat
template rendering of the prompts and the reward rule (``compute_score`` plus the overlong
shaping). The rest is written here from the paper's equations: prompts drawn without
replacement per epoch (its own seeded order), ``G`` samples per prompt at the rollout's
temperature / top-p / top-k up to the response budget, group advantages (reward minus the
group's mean over the unbiased std + eps), the old log-probs of every mini-batch from the
policy before the step's updates, and per mini-batch of ``trainer.mini_batch_size`` prompts
(x G sequences) the clipped token-mean loss (clip-higher, dual clip) over its response tokens
(the EOS included), grad-norm clipping and one AdamW step (no warm-up). M = 0 only (the
baseline).

``--sampler vllm`` replaces transformers' ``generate`` (training rollouts and validation) by
the trainer's rollout engine (``RolloutEngine``, vLLM, the model's weights loaded into it before
every sampling): the loop then differs from ``rlep train`` in its update code and prompt order
(and vLLM stops on every EOS id of the model's generation config, ``generate`` here on the
tokenizer's only), which tells a difference of sampler from a difference of training.
``--check-sampler`` prints, for the sampler chosen (and transformers' ``generate`` always), how
far the log-probs of the tokens it sampled are from a forward of the same sequences, and exits.

Validation every ``trainer.validation_interval_steps`` steps and at the end: ``eval``'s number
of samples per validation question at its temperature / top-p, the mean accuracy (mean@k).
Writes ``metrics.jsonl`` (one line per step: ``step``, ``train/acc_mean``, ``val/acc_mean``
where validated, ``timing/step_s``) and the final weights as an HF checkpoint (``model/``, for
``rlep eval``).
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def prompt_ids(tokenizer, messages, max_prompt_tokens):
    from rlep_megatron.data.prompts import tokenize_prompt

    return tokenize_prompt(tokenizer, messages, max_prompt_tokens).token_ids


def left_padded_generate(model, prompts, pad_id, eos_id, seed, **sampling):
    """transformers' ``generate`` on the prompts left-padded into one batch, sampling from
    ``seed``; returns its output and the padded prompt width."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):] = torch.tensor(prompt)
        attention[i, width - len(prompt):] = 1
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(input_ids=ids.to(model.device),
                             attention_mask=attention.to(model.device), do_sample=True,
                             pad_token_id=pad_id, eos_token_id=eos_id, **sampling)
    return out, width


def through_eos(row, eos_id):
    """A generated row up to and including its first EOS (all of it without one)."""
    return row[:row.index(eos_id) + 1] if eos_id in row else row


def sample(model, prompts, n, max_new_tokens, temperature, top_p, top_k, pad_id, eos_id,
           generator_seed):
    """``n`` sampled responses per prompt (token lists through their EOS, if any)."""
    out, width = left_padded_generate(
        model, prompts, pad_id, eos_id, generator_seed, temperature=temperature, top_p=top_p,
        top_k=top_k if top_k > 0 else 0, num_return_sequences=n, max_new_tokens=max_new_tokens)
    responses = [through_eos(row, eos_id) for row in out[:, width:].tolist()]
    return [responses[i * n:(i + 1) * n] for i in range(len(prompts))]


def engine_sampler(engine):
    """``sample``'s signature over the trainer's rollout engine (``--sampler vllm``): the
    model's weights are loaded into the engine before each call. vLLM stops on every EOS id of
    the model's generation config, ``sample`` on the tokenizer's EOS only."""
    from rlep_megatron.weight_sync import deliver

    def draw(model, prompts, n, max_new_tokens, temperature, top_p, top_k, pad_id, eos_id,
             generator_seed):
        deliver(engine, ((name, p.detach()) for name, p in model.named_parameters()))
        groups = engine.generate(prompts, n, temperature=temperature, top_p=top_p,
                                 top_k=top_k if top_k > 0 else -1, max_tokens=max_new_tokens,
                                 seed=generator_seed)
        return [[r.token_ids for r in group] for group in groups]

    return draw


def check_samplers(model, prompts, cfg, pad_id, eos_id, engine=None):
    """Whether each sampler draws from the model itself: the log-prob of every sampled token
    under the sampler (transformers' ``generate`` logits on a left-padded batch; the engine's
    own log-probs) against a forward of the whole sequence. Prints mean and max difference."""
    import torch

    out, width = left_padded_generate(
        model, prompts, pad_id, eos_id, 0, temperature=1.0, top_p=1.0, top_k=0,
        max_new_tokens=cfg.rollout.max_response_tokens, output_logits=True,
        return_dict_in_generate=True)
    step_logits = torch.stack(out.logits, 1).float()
    drawn = {"transformers generate": []}
    for i, prompt in enumerate(prompts):
        response = through_eos(out.sequences[i, width:].tolist(), eos_id)
        at = torch.tensor(response)[:, None]
        own = torch.log_softmax(step_logits[i, :len(response)], -1).gather(-1, at)[:, 0]
        drawn["transformers generate"].append((prompt, response, own))
    if engine is not None:
        from rlep_megatron.weight_sync import deliver

        deliver(engine, ((name, p.detach()) for name, p in model.named_parameters()))
        groups = engine.generate(prompts, 1, temperature=1.0, top_p=1.0, top_k=-1,
                                 max_tokens=cfg.rollout.max_response_tokens, seed=0)
        drawn["the rollout engine"] = [(prompt, g[0].token_ids, torch.tensor(g[0].logprobs))
                                       for prompt, g in zip(prompts, groups)]
    for name, samples in drawn.items():
        diffs = []
        for prompt, response, own in samples:
            with torch.no_grad():
                forward, _ = token_logprobs(model, [prompt + response], [len(prompt)], pad_id,
                                            1.0)
            diffs.append((forward[0, len(prompt) - 1:] - own.double()).abs())
        diffs = torch.cat(diffs)
        print(f"{name}: sampled-token log-probs vs a forward of the sequence over "
              f"{diffs.numel()} tokens: mean {diffs.mean():.2e}, max {diffs.max():.2e}")


def score(tokenizer, rows, row, response, cfg):
    from rlep_megatron.reward import compute_score, overlong_penalty

    text = tokenizer.decode(response, skip_special_tokens=True)
    result = compute_score(rows.data_source[row], text, rows.ground_truth[row])
    reward = float(result["score"]) + overlong_penalty(
        len(response), cfg.rollout.max_response_tokens, cfg.reward.overlong_buffer_tokens,
        cfg.reward.overlong_penalty_factor)
    return reward, bool(result["acc"])


def token_logprobs(model, sequences, prompt_lengths, pad_id, temperature):
    """``(logp, mask)``, ``[n, longest - 1]``: each next token's log-prob under ``model`` and 1
    on the response tokens."""
    import torch

    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(sequences), width - 1)
    for i, (seq, start) in enumerate(zip(sequences, prompt_lengths)):
        ids[i, :len(seq)] = torch.tensor(seq)
        mask[i, start - 1:len(seq) - 1] = 1.0
    attention = (torch.arange(width)[None, :] < torch.tensor([len(s) for s in sequences])[:, None])
    logits = model(input_ids=ids, attention_mask=attention.long()).logits[:, :-1].float()
    logp = torch.log_softmax(logits / temperature, -1).gather(-1, ids[:, 1:, None])[..., 0]
    return logp, mask


def validate(model, tokenizer, rows, cfg, pad_id, eos_id, seed, draw=None):
    prompts = [prompt_ids(tokenizer, rows.messages[r], cfg.data.max_prompt_tokens)
               for r in range(len(rows))]
    groups = (draw or sample)(model, prompts, cfg.eval.num_samples_per_prompt,
                              cfg.rollout.max_response_tokens, cfg.eval.temperature,
                              cfg.eval.top_p, -1, pad_id, eos_id, seed)
    hits = [score(tokenizer, rows, r, response, cfg)[1]
            for r, group in enumerate(groups) for response in group]
    return sum(hits) / len(hits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--sampler", choices=["transformers", "vllm"], default="transformers",
                        help="vllm: sample with the trainer's rollout engine instead of "
                             "transformers' generate")
    parser.add_argument("--check-sampler", action="store_true",
                        help="print how far each sampler's log-probs of its sampled tokens are "
                             "from a forward of the sequences (the first batch's prompts), then "
                             "exit")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_intermixed_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlep_megatron.config import load_config

    cfg = load_config(args.config, list(args.overrides))
    if cfg.replay.num_replays_per_prompt:
        raise SystemExit("bench/plain_rl.py is the baseline (replay.num_replays_per_prompt=0)")
    if cfg.trainer.mini_batch_unit != "prompts":
        raise SystemExit("bench/plain_rl.py counts mini-batches in prompts")
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(cfg.trainer.seed)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.hf_dir, local_files_only=True,
                                                 dtype=torch.float32)
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    engine, draw = None, sample
    if args.sampler == "vllm":
        from rlep_megatron import distributed
        from rlep_megatron.rollout.colocated.engine import RolloutEngine

        distributed.init_process_group()
        engine = RolloutEngine(cfg.model.hf_dir, cfg.rollout, dtype="float32",
                               seed=cfg.trainer.seed,
                               max_model_len=cfg.data.max_prompt_tokens
                               + cfg.rollout.max_response_tokens)
        draw = engine_sampler(engine)
    try:
        train_loop(args, cfg, model, tokenizer, pad_id, eos_id, draw, engine)
    finally:
        if engine is not None:
            from rlep_megatron import distributed

            engine.shutdown()
            distributed.destroy()


def train_loop(args, cfg, model, tokenizer, pad_id, eos_id, draw, engine) -> None:
    """The RL loop (or, with ``--check-sampler``, the samplers' check) with ``draw`` as the
    sampler."""
    import torch

    from rlep_megatron.data.schema import read_prompt_files

    optim = cfg.optim
    optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr,
                                  betas=(optim.adam_beta1, optim.adam_beta2), eps=optim.adam_eps,
                                  weight_decay=optim.weight_decay)
    train = read_prompt_files(cfg.data.train_files)
    val = read_prompt_files(cfg.data.val_files)
    algo, rollout, g = cfg.algo, cfg.rollout, cfg.rollout.num_samples_per_prompt
    order = torch.Generator().manual_seed(cfg.trainer.seed)
    queue: list[int] = []
    if args.check_sampler:
        rows = torch.randperm(len(train), generator=order)[:cfg.data.train_batch_size].tolist()
        prompts = [prompt_ids(tokenizer, train.messages[r], cfg.data.max_prompt_tokens)
                   for r in rows]
        check_samplers(model, prompts, cfg, pad_id, eos_id, engine)
        return
    metrics_path = os.path.join(args.out, "metrics.jsonl")
    with open(metrics_path, "w") as log:
        val_every = cfg.trainer.validation_interval_steps
        if val_every:
            model.eval()
            accuracy = validate(model, tokenizer, val, cfg, pad_id, eos_id, 10_000, draw)
            log.write(json.dumps({"step": 0, "val/acc_mean": accuracy}) + "\n")
            print(f"step 0: val {accuracy:.3f}", flush=True)
        for step in range(1, cfg.trainer.total_steps + 1):
            started = time.perf_counter()
            while len(queue) < cfg.data.train_batch_size:
                queue += torch.randperm(len(train), generator=order).tolist()
            rows, queue = queue[:cfg.data.train_batch_size], queue[cfg.data.train_batch_size:]
            prompts = [prompt_ids(tokenizer, train.messages[r], cfg.data.max_prompt_tokens)
                       for r in rows]
            model.eval()
            groups = draw(model, prompts, g, rollout.max_response_tokens, rollout.temperature,
                          rollout.top_p, rollout.top_k, pad_id, eos_id,
                          cfg.trainer.seed * 100_003 + step)
            sequences, starts, advantages, accs = [], [], [], []
            for row, prompt, group in zip(rows, prompts, groups):
                scored = [score(tokenizer, train, row, response, cfg) for response in group]
                rewards = torch.tensor([s[0] for s in scored], dtype=torch.float64)
                std = rewards.std() if algo.advantage_normalize_std else torch.tensor(1.0)
                adv = (rewards - rewards.mean()) / (std + algo.advantage_eps)
                for response, value, (_, acc) in zip(group, adv.tolist(), scored):
                    sequences.append(prompt + response)
                    starts.append(len(prompt))
                    advantages.append(value)
                    accs.append(acc)
            per = cfg.trainer.mini_batch_size * g
            batches = [list(range(i, min(i + per, len(sequences))))
                       for i in range(0, len(sequences), per)]
            with torch.no_grad():
                old = [token_logprobs(model, [sequences[i] for i in b], [starts[i] for i in b],
                                      pad_id, rollout.temperature)[0] for b in batches]
            model.train()
            for b, old_logp in zip(batches, old):
                logp, mask = token_logprobs(model, [sequences[i] for i in b],
                                            [starts[i] for i in b], pad_id, rollout.temperature)
                adv = torch.tensor([advantages[i] for i in b], dtype=torch.float32)[:, None]
                ratio = torch.exp(logp - old_logp)
                clipped = torch.clamp(ratio, 1 - algo.clip_ratio_low, 1 + algo.clip_ratio_high)
                loss = torch.maximum(-adv * ratio, -adv * clipped)
                loss = torch.where(adv < 0, torch.minimum(loss, -adv * algo.clip_ratio_c), loss)
                loss = (loss * mask).sum() / mask.sum().clamp(min=1)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if optim.clip_grad > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), optim.clip_grad)
                optimizer.step()
            entry = {"step": step, "train/acc_mean": sum(accs) / len(accs),
                     "timing/step_s": time.perf_counter() - started}
            if val_every and (step % val_every == 0 or step == cfg.trainer.total_steps):
                model.eval()
                entry["val/acc_mean"] = validate(model, tokenizer, val, cfg, pad_id, eos_id,
                                                 10_000 + step, draw)
            log.write(json.dumps(entry) + "\n")
            log.flush()
            print(json.dumps(entry), flush=True)
    model.save_pretrained(os.path.join(args.out, "model"))
    tokenizer.save_pretrained(os.path.join(args.out, "model"))


if __name__ == "__main__":
    main()
