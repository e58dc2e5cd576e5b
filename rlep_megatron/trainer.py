"""The RL loop (docs/ALGORITHM.md section 3), ``rlep train``.

One training step, one named and timed call per phase:

    rollout      G fresh responses per prompt from the in-process vLLM engine
    replay       M pool answers appended to each group that has a pool (G' = G + M)
    reward       every response scored (replays too) + overlong shaping
    advantage    per group over G' (mean / unbiased std + eps)
    old_logprob  the actor recomputes log-probs of every response (the reference policy too,
                 with a KL term); engine/actor gap, rollout-correction weights, replay NLL
    train        one epoch of mini-batch updates (on GPU the engine sleeps during these two)
    weight_sync  the new weights streamed into the engine
    validate     every ``trainer.validation_interval_steps``
    checkpoint   every ``checkpoint.save_interval_steps`` and at the end

Every rank holds the same global batch (prompts, responses, rewards); the engine's replicas
split the generation, actor data-parallel ranks split the sequences of each mini-batch, and
reward scoring is split over all ranks. Features are chosen when the trainer is built (replay
on when M > 0 and a pool exists; dynamic sampling from ``algo.dynamic_sampling``); the loop has
no feature flags inside.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from rlep_megatron import distributed, faults, platform
from rlep_megatron.actor.packing import balanced_partition
from rlep_megatron.config import RunConfig, dump_config

logger = logging.getLogger(__name__)

FRESH, REPLAY = "fresh", "replay"


@dataclass
class Sample:
    """One response of a group, fresh or replayed."""

    group: int                   # index of its prompt in the step's batch
    token_ids: list[int]
    text: str
    source: str                  # fresh | replay
    engine_logprobs: Optional[list[float]] = None
    finish_reason: str = "stop"
    pool_index: Optional[int] = None     # a replay: which answer of its question's pool
    age: Optional[int] = None            # an online replay: steps since it was sampled
    score: float = 0.0
    acc: bool = False
    reward: float = 0.0
    advantage: float = 0.0
    routing: Optional[np.ndarray] = None  # a fresh MoE response: the engine's experts


@dataclass
class StepBatch:
    rows: list[int]                          # training-file rows of the groups
    prompts: list[list[int]]                 # prompt token ids per group
    sequences: list[Sample] = field(default_factory=list)
    generation_rounds: int = 1
    generated_tokens: int = 0                # every round's responses, kept or not

    def length(self, seq: Sample) -> int:
        """Tokens of a sequence: its prompt and its response."""
        return len(self.prompts[seq.group]) + len(seq.token_ids)


class Timer:
    """``with timer.phase("rollout"): ...`` records ``timing/rollout_s`` (and is where
    ``RLEP_FAULT_INJECT`` strikes, :mod:`rlep_megatron.faults`)."""

    def __init__(self):
        self.values: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        faults.check(name, distributed.get_rank())
        start = time.perf_counter()
        try:
            yield
        finally:
            self.values[f"timing/{name}_s"] = (self.values.get(f"timing/{name}_s", 0.0)
                                               + time.perf_counter() - start)


def mini_batch_plan(num_sequences: int, cfg: RunConfig) -> list[list[int]]:
    """Sequence indices of each optimizer mini-batch of a step (in order; the last may be
    short). ``trainer.mini_batch_unit=prompts`` counts ``mini_batch_size x G`` sequences per
    mini-batch (G fresh samples, replays not counted: the reference's rule, so an RLEP step
    with G + M sequences per prompt takes more optimizer steps)."""
    trainer = cfg.trainer
    per = (trainer.mini_batch_size * cfg.rollout.num_samples_per_prompt
           if trainer.mini_batch_unit == "prompts" else trainer.mini_batch_size)
    return [list(range(i, min(i + per, num_sequences))) for i in range(0, num_sequences, per)]


def training_rows(prompts: list[list[int]], responses: list[list[int]], pad_id: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, mask)``, both ``[n, longest prompt + response]``: each row is its prompt
    followed by its response, right-padded with ``pad_id``; the mask is 1 on every response
    token (the EOS that ended a response included: stopping is part of what is trained) and 0
    on the prompt and the padding."""
    from rlep_megatron.actor.forward import pad_sequences

    ids, lengths = pad_sequences([p + r for p, r in zip(prompts, responses)], pad_id=pad_id)
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    starts = torch.tensor([len(p) for p in prompts])[:, None]
    return ids, ((positions >= starts) & (positions < lengths[:, None])).float()


def _throughput(batch: StepBatch, timings: dict[str, float]) -> dict[str, float]:
    """``timing/<phase>_tokens_per_s``: generated tokens per second of the rollout phase, and
    tokens (prompt + response) of the trained sequences per second of the old-log-prob and
    train phases (each optimizer step passes every sequence once)."""
    tokens = sum(batch.length(s) for s in batch.sequences)
    out = {}
    for phase, count in (("rollout", batch.generated_tokens), ("old_logprob", tokens),
                         ("train", tokens)):
        seconds = timings.get(f"timing/{phase}_s", 0.0)
        if seconds > 0:
            out[f"timing/{phase}_tokens_per_s"] = count / seconds
    return out


# the replay keys a run with M = 0 still writes (every run's keys, README.md "Metrics")
REPLAY_KEYS_WITHOUT_REPLAY = ("replay/fraction", "replay/num_sequences", "replay/reward_mean")


def _mean(values) -> float:
    values = list(values)
    return float(sum(values) / len(values)) if values else 0.0


class Trainer:
    def __init__(self, cfg: RunConfig):
        from rlep_megatron.checkpoint.hf_io import load_hf_config

        self.cfg = cfg
        faults.target()  # a malformed RLEP_FAULT_INJECT fails here, not mid-run
        from rlep_megatron.metrics import check_loggers

        check_loggers(cfg.trainer.loggers)
        from rlep_megatron.checks import check_run_config

        check_run_config(cfg, "train")  # files, layout against the model, resume target
        self.hf_config = load_hf_config(cfg.model.hf_dir)
        if cfg.model.mcore_dir:
            if not os.path.isdir(cfg.model.mcore_dir):
                raise FileNotFoundError(f"model.mcore_dir={cfg.model.mcore_dir!r} does not exist")
            if os.path.isfile(os.path.join(cfg.model.mcore_dir, "meta.json")):
                from rlep_megatron.checkpoint.dist import check_checkpoint_model

                check_checkpoint_model(cfg.model.mcore_dir, self.hf_config)
        # data, pool and checkpoint checks before any expensive set-up
        self._load_data()
        from rlep_megatron.checkpoint.resume import CheckpointManager

        self.checkpoints = CheckpointManager(cfg, self.hf_config)
        self.checkpoints.check_output_dir()
        self._build_parallel_and_models()
        self._build_step_functions()

    # ------------------------------------------------------------------ set-up

    def _load_data(self) -> None:
        from rlep_megatron.data.schema import read_prompt_files
        from rlep_megatron.replay.pool import ExperiencePool, OnlinePool

        cfg = self.cfg
        self.train_rows = read_prompt_files(cfg.data.train_files)
        self.val_rows = (read_prompt_files(cfg.data.val_files, deduplicate=True)
                         if cfg.data.val_files else None)
        from rlep_megatron.reward import check_rewards

        check_rewards({"data.train_files": self.train_rows,
                       **({"data.val_files": self.val_rows} if self.val_rows else {})},
                      cfg.reward.function)
        self.pool = None
        replay = cfg.replay
        if replay.num_replays_per_prompt > 0:
            offline = ExperiencePool({})
            if replay.mode != "online":
                if replay.pool_files:
                    pool_rows = read_prompt_files(replay.pool_files)
                    source = ", ".join(replay.pool_files)
                else:
                    pool_rows, source = self.train_rows, "the training files"
                offline = ExperiencePool.from_rows(pool_rows)
                if len(offline) == 0:
                    raise ValueError(f"replay.num_replays_per_prompt="
                                     f"{replay.num_replays_per_prompt} but {source} hold no "
                                     "reward_model.candidates; give replay.pool_files (an "
                                     "`rlep collect` output), use replay.mode=online or set "
                                     "replay.num_replays_per_prompt=0")
                offline.check_matches(self.train_rows, source)
            if replay.mode == "offline":
                self.pool = offline
                if replay.pooled_questions_only:
                    kept = self.pool.pooled_rows(self.train_rows)
                    if len(kept) < cfg.data.train_batch_size:
                        raise ValueError(
                            f"replay.pooled_questions_only keeps the {len(kept)} training rows "
                            f"whose question has pool answers, fewer than one batch of "
                            f"data.train_batch_size={cfg.data.train_batch_size}; collect a "
                            "larger pool, lower the batch size or set "
                            "replay.pooled_questions_only=false")
                    if len(kept) < len(self.train_rows):
                        logger.info("replay.pooled_questions_only: training on the %d of %d "
                                    "training rows whose question has pool answers",
                                    len(kept), len(self.train_rows))
                        self.train_rows = self.train_rows.select(kept)
            else:
                self.pool = OnlinePool(offline.answers, replay.online_answers_per_question)

    def _build_parallel_and_models(self) -> None:
        from rlep_megatron.actor.model import build_from_hf
        from rlep_megatron.models import layout_limits
        from rlep_megatron.models.megatron import build_model, resolve_dtype
        from rlep_megatron.checkpoint.dist import load_mcore_weights
        from rlep_megatron.actor.optimizer import (build_optimizer,
                                                   wrap_ddp)
        from rlep_megatron.rollout import RolloutEngine
        from rlep_megatron.weight_sync import WeightStreamer

        cfg, hf = self.cfg, self.hf_config
        self.ctx = distributed.init_model_parallel(
            cfg.parallel, seed=cfg.trainer.seed, **layout_limits(hf))
        dtype = resolve_dtype(cfg.model.params_dtype)
        moe_losses = {"moe_aux_loss_coeff": cfg.algo.moe_aux_loss_coeff,
                      "moe_z_loss_coeff": cfg.algo.moe_z_loss_coeff}
        if cfg.model.mcore_dir:
            self.chunks, self.info = build_model(hf, dtype, cfg.model.recompute_activations,
                                                 transformer_engine=cfg.model.transformer_engine,
                                                 **moe_losses)
            load_mcore_weights(self.chunks, cfg.model.mcore_dir, hf_config=hf)
        else:
            self.chunks, self.info = build_from_hf(cfg.model.hf_dir, cfg.model.params_dtype,
                                                   cfg.model.recompute_activations,
                                                   cfg.model.transformer_engine, **moe_losses)
        self.info = dataclasses.replace(self.info,
                                        logprob_chunk_tokens=cfg.model.logprob_chunk_tokens)
        # the KL term's reference: the initial weights, copied before any update or resume
        self.reference = None
        if cfg.algo.kl_coef > 0:
            from rlep_megatron.actor.reference import ReferencePolicy

            self.reference = ReferencePolicy(self.chunks, self.info,
                                             offload=cfg.algo.reference_offload)
        self.chunks = wrap_ddp(self.chunks, cfg.optim.use_distributed_optimizer,
                               overlap_grad_reduce=cfg.optim.overlap_grad_reduce,
                               overlap_param_gather=cfg.optim.overlap_param_gather,
                               grad_reduce_in_fp32=cfg.optim.grad_reduce_dtype == "float32")
        self.optimizer = build_optimizer(self.chunks, cfg.optim, self.info.params_dtype)
        # a mixture-of-experts actor records its old-log-prob pass's routing (compared with
        # the engine's for rollout/routing_mismatch_frac); algo.routing_replay=actor replays it
        # in the updates, =rollout the engine's
        from rlep_megatron.models import num_experts

        self.moe = bool(num_experts(self.info.hf_config))
        if cfg.algo.routing_replay != "off" and not self.moe:
            raise ValueError(f"algo.routing_replay={cfg.algo.routing_replay} needs a "
                             "mixture-of-experts model; this one is dense: use off")
        self.routing_replay = None
        if self.moe:
            from rlep_megatron.actor.routing import RoutingReplay

            self.routing_replay = RoutingReplay(self.chunks)
        self.offload_train_state = cfg.optim.offload_during_rollout and platform.cuda_available()
        if self.offload_train_state and self.info.params_dtype != torch.bfloat16:
            raise ValueError("optim.offload_during_rollout needs model.params_dtype=bfloat16 "
                             "(auto on GPU): with float32 parameters megatron's optimizer "
                             "works on the model's own weights, which must stay on the GPU")
        self._train_state_offloaded = False
        self.max_model_len = cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens
        # with offload the engine is built while the gradient buffers and optimizer state are
        # off the GPU: vLLM refuses to start when less than rollout.gpu_memory_utilization of
        # the GPU is free, so that fraction can then include the memory the update holds only
        # while the engine sleeps (vLLM does not grow its cache by itself: raise the setting)
        self.offload_train_state_now()
        self.engine = RolloutEngine(
            cfg.model.hf_dir, cfg.rollout, dtype=str(self.info.params_dtype).split(".")[-1],
            seed=cfg.trainer.seed, max_model_len=self.max_model_len, load_weights=False,
            capture_routing=self.moe, eager_for_routing=cfg.algo.routing_replay == "rollout")
        if self.engine.routing_unavailable is not None:
            if cfg.algo.routing_replay == "rollout":
                raise ValueError("algo.routing_replay=rollout needs the engine's routing, which "
                                 f"this engine cannot give: {self.engine.routing_unavailable}; "
                                 "use actor (replays the old-log-prob pass's routing) or off")
            logger.warning("rollout/routing_mismatch_frac is not measured: %s",
                           self.engine.routing_unavailable)
        self.streamer = WeightStreamer(self.chunks, self.info,
                                       cfg.rollout.weight_sync_bucket_bytes)
        self.tokenizer = self.engine.llm.get_tokenizer()
        self.pad_id = (self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None
                       else self.engine.eos_token_id)

    def _build_step_functions(self) -> None:
        from rlep_megatron.data.sampler import PromptSampler
        from rlep_megatron.metrics import MetricsWriter
        from rlep_megatron.replay.pool import OnlinePool, ReplaySampler
        from rlep_megatron.reward import make_scorer_pool

        cfg = self.cfg
        self.sampler = PromptSampler(len(self.train_rows), cfg.data.train_batch_size,
                                     cfg.trainer.seed, cfg.data.shuffle, cfg.data.drop_last)
        self.replay_sampler = (ReplaySampler(self.pool, cfg.replay.num_replays_per_prompt,
                                             cfg.trainer.seed)
                               if self.pool is not None else None)
        self.online_pool = self.pool if isinstance(self.pool, OnlinePool) else None
        self.scorer = make_scorer_pool(cfg.reward.backend, cfg.reward.num_workers,
                                       cfg.reward.timeout_s)
        self._prompt_cache: dict[int, list[int]] = {}
        self.make_batch = (self._dynamic_batch if cfg.algo.dynamic_sampling
                           else self._plain_batch)
        self.add_replays = self._add_replays if self.replay_sampler else (lambda batch: None)
        self._candidates: list = []  # online replay: the step's groups, admitted after it
        self._admitted = 0  # online replay: answers admitted by the current step
        self.metrics = None
        if distributed.is_rank0():
            os.makedirs(cfg.trainer.output_dir, exist_ok=True)
            dump_config(cfg, cfg.trainer.output_dir)
            wandb_run = None
            if "wandb" in cfg.trainer.loggers:
                from rlep_megatron.config import config_to_dict
                from rlep_megatron.metrics import open_wandb_run

                wandb_run = open_wandb_run(cfg.trainer.output_dir, cfg.trainer.wandb_project,
                                           cfg.trainer.wandb_run_name, config_to_dict(cfg))
            self.metrics = MetricsWriter(cfg.trainer.output_dir,
                                         tensorboard="tensorboard" in cfg.trainer.loggers,
                                         wandb_run=wandb_run)
        self.step = 0

    # ------------------------------------------------------------------ phases

    def prompt_ids(self, rows, row: int) -> list[int]:
        from rlep_megatron.data.prompts import tokenize_prompt

        cache = self._prompt_cache if rows is self.train_rows else None
        if cache is not None and row in cache:
            return cache[row]
        ids = tokenize_prompt(self.tokenizer, rows.messages[row],
                              self.cfg.data.max_prompt_tokens).token_ids
        if cache is not None:
            cache[row] = ids
        return ids

    def rollout(self, rows: list[int], seed: int) -> StepBatch:
        batch = StepBatch(rows=rows, prompts=[self.prompt_ids(self.train_rows, r) for r in rows])
        groups = self.engine.generate(batch.prompts, seed=seed)
        for group, responses in enumerate(groups):
            for r in responses:
                batch.generated_tokens += len(r.token_ids)
                batch.sequences.append(Sample(group, r.token_ids, r.text, FRESH, r.logprobs,
                                                r.finish_reason, routing=r.routing))
        return batch

    def _add_replays(self, batch: StepBatch) -> None:
        from rlep_megatron.data.schema import prompt_key
        from rlep_megatron.replay.pool import tokenize_replays

        replays = []
        online, weighted = self.online_pool, self.cfg.replay.online_low_pass_weight
        for group, row in enumerate(batch.rows):
            messages = self.train_rows.messages[row]
            keep = 1.0
            if weighted:  # toward the questions the policy failed at their last rollout
                keep = 1.0 - online.pass_rate.get(prompt_key(messages), 0.0)
            indices = self.replay_sampler.draw_indices(messages, keep_prob=keep)
            answers = self.replay_sampler.pool.get(messages)
            items = tokenize_replays([answers[i] for i in indices], self.tokenizer,
                                     self.cfg.rollout.max_response_tokens,
                                     self.engine.eos_token_id)
            for index, item in zip(indices, items):
                age = online.age(messages, index, self.step) if online is not None else None
                replays.append(Sample(group, item.token_ids, item.text, REPLAY,
                                      pool_index=index, age=age))
        # each group: its G fresh responses, then its replays
        by_group: dict[int, list[Sample]] = {}
        for seq in batch.sequences + replays:
            by_group.setdefault(seq.group, []).append(seq)
        batch.sequences = [s for g in range(len(batch.rows)) for s in by_group.get(g, [])]

    def reward(self, batch: StepBatch) -> None:
        """Score every response (replays too); work split over all ranks."""
        from rlep_megatron.reward import overlong_penalty
        from rlep_megatron.reward.pool import ScoreRequest

        rows = self.train_rows
        requests = [ScoreRequest(rows.data_source[batch.rows[s.group]], s.text,
                                 rows.ground_truth[batch.rows[s.group]])
                    for s in batch.sequences]
        cfg = self.cfg
        for seq, result in zip(batch.sequences,
                               distributed.map_across_ranks(self.scorer.score, requests)):
            seq.score, seq.acc = float(result["score"]), bool(result["acc"])
            seq.reward = seq.score + overlong_penalty(
                len(seq.token_ids), cfg.rollout.max_response_tokens,
                cfg.reward.overlong_buffer_tokens, cfg.reward.overlong_penalty_factor)

    def advantage(self, batch: StepBatch) -> None:
        from rlep_megatron.algo import group_advantages

        rewards = torch.tensor([s.reward for s in batch.sequences], dtype=torch.float64)
        groups = [s.group for s in batch.sequences]
        values = group_advantages(rewards, groups, eps=self.cfg.algo.advantage_eps,
                                  normalize_std=self.cfg.algo.advantage_normalize_std)
        for seq, value in zip(batch.sequences, values.tolist()):
            seq.advantage = value

    def _generate_round(self, timer: Timer, round_index: int) -> StepBatch:
        with timer.phase("rollout"):
            batch = self.rollout(self.sampler.next_global_batch(), seed=self._seed(round_index))
        with timer.phase("replay"):
            self.add_replays(batch)
        with timer.phase("reward"):
            self.reward(batch)
        if self.online_pool is not None:
            # every round's groups, before dynamic sampling keeps some (or drops them all)
            self._candidates += self._fresh_groups(batch)
        return batch

    def _plain_batch(self, timer: Timer) -> StepBatch:
        return self._generate_round(timer, 0)

    def _dynamic_batch(self, timer: Timer) -> StepBatch:
        """Official DAPO dynamic sampling: keep whole groups whose accuracy varies, draw more
        prompts (up to ``algo.max_generation_rounds`` rounds) until a full batch is kept."""
        want = self.cfg.data.train_batch_size
        kept = StepBatch(rows=[], prompts=[])
        rounds = 0
        while len(kept.rows) < want and rounds < self.cfg.algo.max_generation_rounds:
            candidate = self._generate_round(timer, rounds)
            kept.generated_tokens += candidate.generated_tokens
            rounds += 1
            by_group: dict[int, list[Sample]] = {}
            for s in candidate.sequences:
                by_group.setdefault(s.group, []).append(s)
            for group, row in enumerate(candidate.rows):
                members = by_group.get(group, [])
                accs = {s.acc for s in members}
                if len(accs) > 1 and len(kept.rows) < want:
                    new_group = len(kept.rows)
                    kept.rows.append(row)
                    kept.prompts.append(candidate.prompts[group])
                    for s in members:
                        s.group = new_group
                        kept.sequences.append(s)
        partial_ok = bool(kept.rows) and self.cfg.algo.dynamic_sampling_partial_batch
        if len(kept.rows) < want and not partial_ok:
            # the DAPO reference stops here too (its "too many generation batches" error)
            allow = ("" if not kept.rows else
                     ", or algo.dynamic_sampling_partial_batch=true to train on them")
            raise RuntimeError(
                f"dynamic sampling kept {len(kept.rows)} of {want} groups in {rounds} rounds "
                f"(algo.max_generation_rounds); every other group was all-correct or all-wrong. "
                f"Raise algo.max_generation_rounds{allow}")
        kept.generation_rounds = rounds
        return kept

    def _count_replays(self, batch: StepBatch) -> None:
        """Count the replays that made it into the step's batch (dynamic sampling may have
        dropped the groups of others)."""
        if self.replay_sampler is None:
            return
        for seq in batch.sequences:
            if seq.source == REPLAY:
                self.replay_sampler.record(self.train_rows.messages[batch.rows[seq.group]],
                                           seq.pool_index)

    @staticmethod
    def _fresh_groups(batch: StepBatch) -> list[tuple[int, list[str], list[bool], list[bool]]]:
        """Per group of a generation round: its row, and its fresh answers' texts, whether the
        reward verified each and whether each ended by itself (not cut at the budget)."""
        by_group: dict[int, list[Sample]] = {}
        for seq in batch.sequences:
            if seq.source == FRESH:
                by_group.setdefault(seq.group, []).append(seq)
        return [(batch.rows[group], [s.text for s in members], [s.acc for s in members],
                 [s.finish_reason != "length" for s in members])
                for group, members in sorted(by_group.items())]

    def _admit_online(self) -> int:
        """replay.mode online / both: the step's verified-correct fresh answers that ended by
        themselves join their question's pool, after this step's replays were drawn; every
        generation round counts (with dynamic sampling, the groups it dropped too)."""
        if self.online_pool is None:
            return 0
        admitted = 0
        for row, texts, correct, ended in self._candidates:
            admitted += self.online_pool.admit(self.train_rows.messages[row], texts, correct,
                                               self.step, ended=ended)
        self._candidates = []
        return admitted

    def _seed(self, round_index: int) -> int:
        return (self.cfg.trainer.seed * 1_000_003 + self.step) * 101 + round_index

    def mini_batches(self, batch: StepBatch) -> list[list[int]]:
        return mini_batch_plan(len(batch.sequences), self.cfg)

    def _old_logprob_pass(self, batch: StepBatch, plan: list[list[int]], load):
        """One forward pass of the actor (and of the reference, with a KL term) over this DP
        rank's sequences of every mini-batch of the step (micro-batches by the token budget
        across mini-batches, not one pass per mini-batch: fewer, fuller micro-batches); yields
        per mini-batch its sequences, ``(ids, mask, old, ref, routing)`` cut to its rows and
        columns, and whether it is a placeholder. ``load`` counts the MoE routing of the pass
        (:mod:`rlep_megatron.actor.expert_load`), placeholder rows left out."""
        from rlep_megatron.actor.forward import actor_logprobs

        dp, dp_rank = self.ctx.data_parallel_size, self.ctx.data_parallel_rank
        parts, seqs = [], []
        for indices in plan:
            # split across DP ranks by token count, so that no rank waits on the longest
            # sequences
            sizes = [batch.length(batch.sequences[i]) for i in indices]
            mine = [indices[j] for j in balanced_partition(sizes, dp)[dp_rank]]
            # a mini-batch with fewer sequences than DP ranks leaves some ranks none: they
            # still take part in every collective, with one fully masked row (no loss, no
            # gradient)
            chosen = [batch.sequences[i] for i in (mine or indices[:1])]
            parts.append((len(seqs), chosen, not mine))
            seqs += chosen
        ids, mask = training_rows([batch.prompts[s.group] for s in seqs],
                                  [s.token_ids for s in seqs], self.pad_id)
        lengths = torch.tensor([batch.length(s) for s in seqs])
        placeholders = [row for start, chosen, placeholder in parts if placeholder
                        for row in range(start, start + len(chosen))]
        mask[placeholders] = 0.0
        budget = self.cfg.trainer.micro_batch_max_tokens
        micro = max(1, budget // max(1, ids.shape[1]))
        batching = {"lengths": lengths,
                    "pack_max_tokens": budget if self.cfg.trainer.sequence_packing else None}
        temperature = self.cfg.rollout.temperature
        load.skip_rows = torch.tensor(placeholders, dtype=torch.long)  # not routed for real
        engine = (self._engine_routing(seqs, placeholders, ids.shape) if self.routing_replay
                  else None)
        replay = self.cfg.algo.routing_replay
        recording = (self.routing_replay.recording(*ids.shape, engine=engine,
                                                   follow_engine=replay == "rollout",
                                                   share=replay != "off")
                     if engine is not None or replay != "off" else contextlib.nullcontext())
        with recording as routing:  # algo.routing_replay=actor: the experts of this pass
            old = actor_logprobs(self.chunks, self.info, ids, micro, temperature,
                                 everywhere=False, **batching)
        load.skip_rows = None
        ref = (self.reference.logprobs(ids, micro, temperature, **batching)
               if self.reference is not None else None)
        if old is None:
            # not the last pipeline stage: it only feeds activations forward; the loss and the
            # metrics below live on the last stage (old_logprob broadcasts the metrics)
            old = torch.zeros(ids.shape)
            ref = old if self.reference is not None else None
        for start, chosen, placeholder in parts:
            rows = slice(start, start + len(chosen))
            width = int(lengths[rows].max())  # the columns of this mini-batch's longest row
            yield chosen, placeholder, (
                ids[rows, :width], mask[rows, :width], old[rows, :width],
                None if ref is None else ref[rows, :width],
                None if routing is None or self.cfg.algo.routing_replay == "off"
                else {layer: experts[rows, :width] for layer, experts in routing.items()})

    def _engine_routing(self, seqs: list[Sample], placeholders: list[int], shape
                        ) -> Optional[dict[int, torch.Tensor]]:
        """The engine's experts of the pass's sequences in its ``[rows, columns, k]`` frame,
        per MoE layer of this rank (-1: unknown: replayed pool answers, placeholder rows);
        ``None`` when the engine gave none."""
        if not any(s.routing is not None for s in seqs):
            return None
        layers = self.routing_replay.layers
        engine = torch.full((len(layers), *shape, self.routing_replay.topk_size), -1,
                            dtype=torch.int16)
        skip = set(placeholders)
        for row, seq in enumerate(seqs):
            if seq.routing is not None and row not in skip:
                experts = torch.from_numpy(seq.routing[:, layers])  # [positions, layers, k]
                engine[:, row, :len(experts)] = experts.transpose(0, 1)
        return dict(zip(layers, engine))

    def _train_batch(self, seqs: list[Sample], placeholder: bool, tensors, starts: list[int]):
        """A mini-batch's slice on this DP rank as the actor trains it, with the old
        log-probs of :meth:`_old_logprob_pass`, plus this slice's sums and maxima for the
        step's metrics (reduced over DP ranks by :meth:`old_logprob`). ``starts``: each
        sequence's prompt length (where its response begins)."""
        from rlep_megatron.actor.train_step import TrainBatch
        from rlep_megatron.algo import mismatch_kl, rollout_correction_weights, rollout_loss_mask
        from rlep_megatron.rollout.parity import logprob_abs_diff

        algo = self.cfg.algo
        ids, mask, old, ref, routing = tensors
        # the engine's log-probs of fresh tokens, aligned with the actor's columns
        fresh = [row for row, s in enumerate(seqs)
                 if s.source == FRESH and s.engine_logprobs and not placeholder]
        rollout_logp = torch.zeros_like(old)
        rollout_mask = torch.zeros_like(mask)
        for row in fresh:
            values = seqs[row].engine_logprobs
            rollout_logp[row, starts[row]:starts[row] + len(values)] = torch.tensor(values)
            rollout_mask[row, starts[row]:starts[row] + len(values)] = 1.0
        parity = logprob_abs_diff([seqs[r].engine_logprobs for r in fresh], old[fresh],
                                  [starts[r] for r in fresh])
        weights, changed = rollout_correction_weights(
            old, rollout_logp, rollout_mask, algo.rollout_correction,
            algo.rollout_correction_level, algo.rollout_correction_threshold)
        is_replay = torch.tensor([s.source == REPLAY for s in seqs])
        mismatch = mismatch_kl(old, rollout_logp, rollout_mask)
        on = rollout_mask > 0
        nll = -old.to(torch.float64) * mask
        sums = {"parity": parity["mean"] * parity["tokens"], "parity_tokens": parity["tokens"],
                "mismatch_k1": mismatch["k1"], "mismatch_k3": mismatch["k3"],
                "rollout_tokens": mismatch["tokens"], "rollout_seqs": float(len(fresh)),
                "correction_weight": float((weights * rollout_mask).sum()),
                "correction_tokens": float(changed.sum()),
                "correction_seqs": float(changed.any(dim=1).sum())}
        maxima = {"correction_weight_max": float(weights[on].max()) if on.any() else 1.0,
                  "correction_weight_neg_min": -float(weights[on].min()) if on.any() else -1.0,
                  "ref_logp_abs_diff": (float(((old - ref).abs() * mask).max())
                                        if ref is not None else 0.0)}
        for name, rows_of in (("fresh", ~is_replay), ("replay", is_replay)):
            part = mask * rows_of.float().unsqueeze(1)
            sums[f"nll_{name}"] = float((nll * part).sum())
            sums[f"tokens_{name}"] = float(part.sum())
            maxima[f"nll_max_{name}"] = float((nll * part).max()) if part.any() else 0.0
        train = TrainBatch(ids, mask, old, torch.tensor([s.advantage for s in seqs]), is_replay,
                           ref_logp=ref,
                           token_weights=(weights.float() if algo.rollout_correction != "off"
                                          else None),
                           loss_mask=rollout_loss_mask(algo.rollout_correction, changed),
                           routing=routing)
        return train, sums, maxima

    def old_logprob(self, batch: StepBatch, plan: list[list[int]]):
        """Old (and reference) log-probs of every mini-batch, and the step's metrics of the
        engine/actor gap, the rollout correction and how off-policy replays are."""
        from megatron.core import parallel_state as ps

        from rlep_megatron.actor.expert_load import ExpertLoad

        # a mixture-of-experts actor: how evenly the old-log-prob pass routes the step's tokens
        with ExpertLoad(self.chunks) as load:
            parts = [self._train_batch(seqs, placeholder, tensors,
                                       [len(batch.prompts[s.group]) for s in seqs])
                     for seqs, placeholder, tensors in self._old_logprob_pass(batch, plan, load)]
        dp_group = ps.get_data_parallel_group()
        sums = distributed.reduce_values({k: sum(p[1][k] for p in parts) for k in parts[0][1]},
                                         "sum", dp_group)
        maxima = distributed.reduce_values(
            {k: max(p[2][k] for p in parts) for k in parts[0][2]}, "max", dp_group)
        # computed from real log-probs on the last pipeline stage only
        pp_last, pp_group = (ps.get_pipeline_model_parallel_last_rank(),
                             ps.get_pipeline_model_parallel_group())
        sums = distributed.broadcast_values(sums, pp_last, pp_group)
        maxima = distributed.broadcast_values(maxima, pp_last, pp_group)
        rollout_tokens = max(sums["rollout_tokens"], 1.0)
        metrics = {
            "rollout/logprob_abs_diff": (sums["parity"] / sums["parity_tokens"]
                                         if sums["parity_tokens"] > 0 else 0.0),
            "rollout/logprob_compared_tokens": sums["parity_tokens"],
            "rollout/mismatch_kl_k1": sums["mismatch_k1"] / rollout_tokens,
            "rollout/mismatch_kl_k3": sums["mismatch_k3"] / rollout_tokens,
            "train/old_nll_mean/fresh": sums["nll_fresh"] / max(sums["tokens_fresh"], 1.0),
            "train/old_nll_mean/replay": sums["nll_replay"] / max(sums["tokens_replay"], 1.0),
            "train/old_nll_max/fresh": maxima["nll_max_fresh"],
            "train/old_nll_max/replay": maxima["nll_max_replay"],
            **load.metrics(engine_routing=self.engine.capturing_routing),
        }
        if self.cfg.algo.rollout_correction != "off":
            metrics.update({
                "rollout/correction_weight_mean": sums["correction_weight"] / rollout_tokens,
                "rollout/correction_weight_max": maxima["correction_weight_max"],
                "rollout/correction_weight_min": -maxima["correction_weight_neg_min"],
                "rollout/correction_token_frac": sums["correction_tokens"] / rollout_tokens,
                "rollout/correction_seq_frac": (sums["correction_seqs"]
                                                / max(sums["rollout_seqs"], 1.0))})
        if self.reference is not None:
            metrics["train/ref_logp_abs_diff_max"] = maxima["ref_logp_abs_diff"]
        return [p[0] for p in parts], metrics

    def train(self, train_batches) -> dict[str, float]:
        from rlep_megatron.actor.train_step import train_mini_batch

        self.optimizer.training_step = self.step  # the lr warm-up may count training steps
        results = [train_mini_batch(self.chunks, self.optimizer, self.info, tb, self.cfg.algo,
                                    self.cfg.trainer.micro_batch_max_tokens,
                                    temperature=self.cfg.rollout.temperature,
                                    replay_clip_high=self.cfg.replay.clip_ratio_high,
                                    sequence_packing=self.cfg.trainer.sequence_packing,
                                    routing_replay=self.routing_replay)
                   for tb in train_batches]
        # the weight sync and checkpoints read the weights outside a forward pass
        self.optimizer.gather_params(self.chunks)
        out = {}
        for key in results[0]:
            out[key] = _mean(r[key] for r in results if key in r)
        out["num_optimizer_steps"] = float(len(results))
        return out

    def offload_train_state_now(self) -> None:
        """``optim.offload_during_rollout``: gradient buffers and optimizer state leave the
        GPU until :meth:`restore_train_state`."""
        if self.offload_train_state and not self._train_state_offloaded:
            self.optimizer.offload(self.chunks)
            self._train_state_offloaded = True

    def save_checkpoint(self) -> None:
        """With the train state offloaded, the save brings it back while the engine sleeps
        (the memory it was offloaded for), then offloads it again. The engine's sleep
        discarded its weights, so they are synced again from the (unchanged) actor before
        the next rollout."""
        if not self._train_state_offloaded:
            self.checkpoints.save(self)
            return
        with self.engine.released():
            self.restore_train_state()
            self.checkpoints.save(self)
            self.offload_train_state_now()
        if self.engine.stale:
            self.weight_sync()

    def restore_train_state(self) -> None:
        if self._train_state_offloaded:
            self.optimizer.restore(self.chunks)
            self._train_state_offloaded = False

    def weight_sync(self) -> dict[str, float]:
        from rlep_megatron.weight_sync import sync_weights

        return sync_weights(self.engine, self.streamer)

    def validate(self) -> dict[str, float]:
        """``val/<data_source>/mean@k`` (and maj/best/pass) on the validation files."""
        from rlep_megatron.evaluate import evaluate_policy

        ecfg = self.cfg.eval
        report = evaluate_policy(self.engine, self.scorer, self.val_rows,
                                 ecfg.num_samples_per_prompt, ecfg.temperature, ecfg.top_p,
                                 self.cfg.rollout.max_response_tokens,
                                 self.cfg.data.max_prompt_tokens,
                                 seed=self.cfg.trainer.seed + 7_777_777)
        return {f"val/{source}/{name}": float(value) for source, table in report.items()
                for name, value in table.items() if name != "num_questions"}

    # ------------------------------------------------------------------ loop

    def step_metrics(self, batch: StepBatch, train: dict, old: dict) -> dict[str, float]:
        fresh = [s for s in batch.sequences if s.source == FRESH]
        replay = [s for s in batch.sequences if s.source == REPLAY]
        with_pool = {s.group for s in replay}
        in_pool_groups = [s for s in batch.sequences if s.group in with_pool]
        m = {
            "rollout/reward_mean": _mean(s.reward for s in fresh),
            "rollout/score_mean": _mean(s.score for s in fresh),
            "rollout/acc_mean": _mean(s.acc for s in fresh),
            "rollout/response_len_mean": _mean(len(s.token_ids) for s in fresh),
            "rollout/response_len_max": float(max((len(s.token_ids) for s in fresh), default=0)),
            "rollout/truncated_frac": _mean(s.finish_reason == "length" for s in fresh),
            "rollout/generation_rounds": float(batch.generation_rounds),
            "rollout/num_groups": float(len(batch.rows)),
            "replay/fraction": (len(replay) / len(in_pool_groups)) if in_pool_groups else 0.0,
            "replay/num_sequences": float(len(replay)),
            "replay/groups_with_pool": float(len(with_pool)),
            "replay/reward_mean": _mean(s.reward for s in replay),
            "replay/acc_mean": _mean(s.acc for s in replay),
            "replay/response_len_mean": _mean(len(s.token_ids) for s in replay),
            "advantage/mean/fresh": _mean(s.advantage for s in fresh),
            "advantage/mean/replay": _mean(s.advantage for s in replay),
        }
        if self.replay_sampler is not None:
            m.update({f"replay/{k}": v
                      for k, v in self.replay_sampler.replay_counts_summary().items()})
            m["replay/pool_questions"] = float(len(self.pool))
            m["replay/pool_answers"] = float(sum(map(len, self.pool.answers.values())))
        if self.online_pool is not None:
            m["replay/online_admitted"] = float(self._admitted)
            m["replay/online_answers"] = float(self.online_pool.num_online_answers())
            m["replay/online_age_mean"] = _mean(s.age for s in replay if s.age is not None)
        m.update(old)
        for key, value in train.items():
            # the router losses are MoE metrics (moe/aux_loss, moe/z_loss), not under train/
            m[key if key.startswith("moe/") else f"train/{key}"] = value
        if self.replay_sampler is None:
            # no replays configured (M = 0): no means over an empty set; the contract's
            # replay/fraction, replay/num_sequences and replay/reward_mean stay (0 by convention)
            m = {k: v for k, v in m.items()
                 if k in REPLAY_KEYS_WITHOUT_REPLAY or not (k.startswith("replay/")
                                                            or k.endswith("/replay"))}
        return m

    def train_step(self) -> dict[str, float]:
        timer = Timer()
        step_start = time.perf_counter()
        batch = self.make_batch(timer)
        self._count_replays(batch)
        self._admitted = self._admit_online()
        with timer.phase("advantage"):
            self.advantage(batch)
        plan = self.mini_batches(batch)
        # GPU: the engine's weights and KV cache are released while the actor works (vLLM
        # sleep); the weight sync below refills them. No-op on CPU.
        with self.engine.released():
            self.restore_train_state()
            with timer.phase("old_logprob"):
                train_batches, old_metrics = self.old_logprob(batch, plan)
            with timer.phase("train"):
                train = self.train(train_batches)
            self.offload_train_state_now()
        with timer.phase("weight_sync"):
            self.weight_sync()
        self.step += 1
        metrics = self.step_metrics(batch, train, old_metrics)
        metrics.update(timer.values)
        metrics["timing/step_s"] = time.perf_counter() - step_start
        metrics.update(_throughput(batch, timer.values))
        return metrics

    def run(self) -> None:
        from rlep_megatron.metrics import progress

        cfg = self.cfg
        if self._train_state_offloaded:
            # loading a checkpoint needs the train state on the GPU: back while the engine sleeps
            with self.engine.released():
                self.restore_train_state()
                resumed = self.checkpoints.maybe_resume(self)
                self.offload_train_state_now()
        else:
            resumed = self.checkpoints.maybe_resume(self)
        if self.metrics is not None:
            # records after the checkpoint (or all of them on a fresh start) are redone
            self.metrics.truncate_after(self.step if resumed else -1)
        self.weight_sync()  # the engine starts with dummy weights
        interval = cfg.trainer.validation_interval_steps
        if self.val_rows is not None and interval and not resumed:
            timer = Timer()
            with timer.phase("validate"):
                values = self.validate()
            self._log(self.step, {**values, **timer.values})
        for _ in progress(range(self.step, cfg.trainer.total_steps), desc="train",
                          total=cfg.trainer.total_steps - self.step):
            metrics = self.train_step()
            timer = Timer()
            if self.val_rows is not None and interval and self.step % interval == 0:
                with timer.phase("validate"):
                    metrics.update(self.validate())
            save_every = cfg.checkpoint.save_interval_steps
            if (save_every and self.step % save_every == 0) or self.step == cfg.trainer.total_steps:
                with timer.phase("checkpoint"):
                    self.save_checkpoint()
            metrics.update(timer.values)
            self._log(self.step, metrics)

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        if self.metrics is not None:
            self.metrics.log(step, metrics)
            short = {k: round(v, 4) for k, v in metrics.items()
                     if k in ("rollout/acc_mean", "train/pg_loss", "replay/fraction",
                              "timing/step_s") or k.startswith("val/") and "mean@" in k}
            logger.info("step %d: %s", step, short)

    def close(self, failed: bool = False, release_engine: bool = True) -> None:
        """Release the run's resources. After a failure only this process's own (metrics
        file, scorer workers): the other ranks may be anywhere, so no collective is entered
        (the caller then ends the process, see ``cli.main``). ``release_engine=False`` leaves
        the engine to the end of the process (the CLI's, which ends at once: vLLM's shutdown
        walks the whole heap three times, about 3 s on a 2-core machine)."""
        if self.metrics is not None:
            self.metrics.close()
        self.scorer.close()
        if failed:
            return
        distributed.barrier()
        if release_engine:
            self.engine.shutdown()


def run_train(cfg: RunConfig, release: bool = True) -> str:
    """``rlep train``: returns the output directory. Everything the run writes is complete
    when it returns; ``release=False`` (a process that ends right after) leaves the engine and
    the process group to the end of the process."""
    trainer = Trainer(cfg)
    try:
        trainer.run()
    except BaseException:
        trainer.close(failed=True)
        raise
    trainer.close(release_engine=release)
    if release:
        distributed.destroy()
    return cfg.trainer.output_dir
