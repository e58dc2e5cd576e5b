"""The rollout side: turns prompts into scored groups.

Per training step, one named and timed call per phase:

    rollout   G fresh responses per prompt from the rollout engine, each token tagged with
              the policy version that sampled it
    replay    M pool answers appended to each group that has a pool and that the replay
              policy picks (G' = G + M; ``replay.policy``, rlep_megatron/replay/policy.py)
    reward    every response scored (replays too) + overlong shaping (``rescue``: the fresh
              responses first, since the policy reads them, then the replays)

with DAPO's dynamic sampling (more generation rounds until a full batch of groups with signal)
and online replay (the step's verified answers admitted to the pool after its replays were
drawn) chosen when the side is built. How prompts reach the engine is the scheduler's
(:mod:`rlep_megatron.rollout.scheduler`): all of a step's at once (``trainer.max_staleness:
0``) or ahead of the weights that will train on them.

Every rank holds the same global batch; reward scoring is split over all ranks.
"""
from __future__ import annotations

import logging
from typing import Optional

import numpy as np

from rlep_megatron import distributed
from rlep_megatron.data.batch import FRESH, REPLAY, Sample, StepBatch
from rlep_megatron.replay.policy import likelihood_metrics

logger = logging.getLogger(__name__)

# the replay keys a run with M = 0 still writes (every run's keys, docs/metrics.md)
REPLAY_KEYS_WITHOUT_REPLAY = ("replay/fraction", "replay/num_sequences", "replay/reward_mean")


def _mean(values) -> float:
    values = list(values)
    return float(sum(values) / len(values)) if values else 0.0


def fresh_correct_by_group(batch: StepBatch) -> list[list[bool]]:
    """Per group of the batch, its fresh responses' correctness (scored already)."""
    correct: list[list[bool]] = [[] for _ in batch.rows]
    for seq in batch.sequences:
        if seq.source == FRESH:
            correct[seq.group].append(bool(seq.acc))
    return correct


def fresh_groups(batch: StepBatch, behaviour: bool = False) -> list[tuple]:
    """Per group of a generation round: its row, and its fresh answers' texts, whether the
    reward verified each, whether each ended by itself (not cut at the budget) and, with
    ``behaviour`` (``replay.correction`` uses it), each one's tokens, log-probs and the
    version that began it (int32 / float32 arrays: they are kept in the online pool)."""
    by_group: dict[int, list[Sample]] = {}
    for seq in batch.sequences:
        if seq.source == FRESH:
            by_group.setdefault(seq.group, []).append(seq)
    return [(batch.rows[group], [s.text for s in members], [s.acc for s in members],
             [s.finish_reason != "length" for s in members],
             [{"token_ids": np.asarray(s.token_ids, np.int32),
               "logprobs": np.asarray(s.engine_logprobs, np.float32),
               "version": s.versions[0][0] if s.versions else None}
              if behaviour and s.engine_logprobs else None for s in members])
            for group, members in sorted(by_group.items())]


def load_training_data(cfg):
    """``(train_rows, val_rows, pool)`` with every check of the files done: the training rows
    (only those with a pool under ``replay.pooled_questions_only``), the deduplicated
    validation rows or ``None``, and the experience pool (``None`` without replays)."""
    from rlep_megatron.data.schema import read_prompt_files
    from rlep_megatron.replay.pool import ExperiencePool, OnlinePool
    from rlep_megatron.reward import check_rewards

    # the pool's behaviour log-probs are read only when replay.correction uses them
    behaviour = cfg.replay.correction != "none"
    train_rows = read_prompt_files(cfg.data.train_files, behaviour=behaviour)
    val_rows = (read_prompt_files(cfg.data.val_files, deduplicate=True)
                if cfg.data.val_files else None)
    check_rewards({"data.train_files": train_rows,
                   **({"data.val_files": val_rows} if val_rows else {})}, cfg.reward.function)
    replay = cfg.replay
    if replay.num_replays_per_prompt == 0:
        return train_rows, val_rows, None
    offline = ExperiencePool({})
    if replay.mode != "online":
        if replay.pool_files:
            pool_rows = read_prompt_files(replay.pool_files, behaviour=behaviour)
            source = ", ".join(replay.pool_files)
        else:
            pool_rows, source = train_rows, "the training files"
        offline = ExperiencePool.from_rows(pool_rows)
        if len(offline) == 0:
            raise ValueError(f"replay.num_replays_per_prompt={replay.num_replays_per_prompt} "
                             f"but {source} hold no reward_model.candidates; give "
                             "replay.pool_files (an `rlep collect` output), use "
                             "replay.mode=online or set replay.num_replays_per_prompt=0")
        offline.check_matches(train_rows, source)
    if replay.mode != "offline":
        return train_rows, val_rows, OnlinePool(offline.answers,
                                                replay.online_answers_per_question,
                                                behaviour=offline.behaviour)
    if replay.pooled_questions_only:
        kept = offline.pooled_rows(train_rows)
        if len(kept) < cfg.data.train_batch_size:
            raise ValueError(
                f"replay.pooled_questions_only keeps the {len(kept)} training rows whose "
                f"question has pool answers, fewer than one batch of data.train_batch_size="
                f"{cfg.data.train_batch_size}; collect a larger pool, lower the batch size or "
                "set replay.pooled_questions_only=false")
        if len(kept) < len(train_rows):
            logger.info("replay.pooled_questions_only: training on the %d of %d training rows "
                        "whose question has pool answers", len(kept), len(train_rows))
            train_rows = train_rows.select(kept)
    return train_rows, val_rows, offline


class RolloutSide:
    """Prompts in, scored groups out; see the module docstring."""

    def __init__(self, cfg, scheduler, tokenizer, eos_token_id: int, train_rows, pool):
        from rlep_megatron.data.sampler import make_prompt_sampler
        from rlep_megatron.replay.policy import (PassRateTracker, ReplayRecord,
                                                 make_replay_policy)
        from rlep_megatron.replay.pool import OnlinePool, ReplaySampler
        from rlep_megatron.reward import make_scorer_pool

        self.cfg = cfg
        self.scheduler = scheduler
        self.tokenizer, self.eos_token_id = tokenizer, eos_token_id
        self.train_rows, self.pool = train_rows, pool
        self.sampler = make_prompt_sampler(cfg, train_rows)
        self.replay_sampler = (ReplaySampler(pool, cfg.replay.num_replays_per_prompt,
                                             cfg.trainer.seed) if pool is not None else None)
        self.online_pool = pool if isinstance(pool, OnlinePool) else None
        self.replay_policy = make_replay_policy(cfg.replay.policy)
        # per question, its fresh responses' pass rate (replay.policy=low_pass; the metrics)
        self.pass_rates = (PassRateTracker(cfg.replay.pass_rate_ema)
                           if self.replay_sampler else None)
        self.record = ReplayRecord(self.pass_rates) if self.pass_rates is not None else None
        self.scorer = make_scorer_pool(cfg.reward.backend, cfg.reward.num_workers,
                                       cfg.reward.timeout_s)
        self._prompt_cache: dict[int, list[int]] = {}
        self._make_batch = (self._dynamic_batch if cfg.algo.dynamic_sampling
                            else self._plain_batch)
        self.add_replays = self._replays if self.replay_sampler else (lambda batch, step: None)
        self._candidates: list = []  # online replay: the step's groups, admitted after it
        self.admitted = 0  # online replay: answers admitted by the latest step
        # replay.policy=unlikely: (prompts, responses) -> per pair, the current policy's sum of
        # log-probs over the response's tokens and their count (the trainer sets it; a
        # collective); and the step's (sum, tokens) of every scored and every chosen candidate
        self.likelihood = None
        self._scored: tuple[list, list] = ([], [])

    # ------------------------------------------------------------------ the step

    def next_batch(self, step: int, timer) -> StepBatch:
        """The scored groups that training step ``step`` (the policy version being trained)
        learns from."""
        if self.record is not None:
            self.record.start_step()
        self._scored = ([], [])
        batch = self._make_batch(timer, step)
        self._count_replays(batch)
        self.admitted = self._admit_online(step)
        if self.record is not None:  # after the step: its replays saw earlier steps only
            self.record.end_step()
        return batch

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

    def seed(self, step: int, round_index: int) -> int:
        """The engine seed of a step's generation round (the same in every mode)."""
        return (self.cfg.trainer.seed * 1_000_003 + step) * 101 + round_index

    def _generate_round(self, timer, step: int, round_index: int) -> StepBatch:
        with timer.phase("rollout"):
            rows, groups = self.scheduler.next_round(self, step, round_index)
            batch = StepBatch(rows=rows,
                              prompts=[self.prompt_ids(self.train_rows, r) for r in rows])
            for group, responses in enumerate(groups):
                for r in responses:
                    batch.generated_tokens += len(r.token_ids)
                    batch.sequences.append(Sample(group, r.token_ids, r.text, FRESH,
                                                  r.logprobs, r.finish_reason,
                                                  routing=r.routing, versions=r.versions,
                                                  routing_key=r.routing_key))
        if self.replay_policy.needs_fresh_rewards:
            # the policy reads the fresh rewards: they are scored first, then the replays
            with timer.phase("reward"):
                self.reward(batch)
            with timer.phase("replay"):
                self.add_replays(batch, step)
            with timer.phase("reward"):
                self.reward(batch, [s for s in batch.sequences if s.source == REPLAY])
        else:
            with timer.phase("replay"):
                self.add_replays(batch, step)
            with timer.phase("reward"):
                self.reward(batch)
        if self.record is not None:
            self.record.observe(
                [(self.train_rows.prompt_key(row), correct)
                 for row, correct in zip(batch.rows, fresh_correct_by_group(batch))])
        if self.online_pool is not None:
            # every round's groups, before dynamic sampling keeps some (or drops them all)
            self._candidates += fresh_groups(
                batch, behaviour=self.cfg.replay.correction != "none")
        return batch

    def _plain_batch(self, timer, step: int) -> StepBatch:
        return self._generate_round(timer, step, 0)

    def _dynamic_batch(self, timer, step: int) -> StepBatch:
        """Official DAPO dynamic sampling: keep whole groups whose accuracy varies, draw more
        prompts (up to ``algo.max_generation_rounds`` rounds) until a full batch is kept."""
        want = self.cfg.data.train_batch_size
        kept = StepBatch(rows=[], prompts=[])
        rounds = 0
        while len(kept.rows) < want and rounds < self.cfg.algo.max_generation_rounds:
            candidate = self._generate_round(timer, step, rounds)
            kept.generated_tokens += candidate.generated_tokens
            rounds += 1
            by_group = candidate.groups()
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

    def _replays(self, batch: StepBatch, step: int) -> None:
        from rlep_megatron.replay.pool import tokenize_replays

        replays = []
        online, weighted = self.online_pool, self.cfg.replay.online_low_pass_weight
        policy, pass_rates = self.replay_policy, self.pass_rates
        fresh = fresh_correct_by_group(batch) if policy.needs_fresh_rewards else None
        chosen = self._least_likely(batch) if policy.scores_candidates else None
        for group, row in enumerate(batch.rows):
            messages = self.train_rows.messages[row]
            key = self.train_rows.prompt_key(row)
            rate = pass_rates.get(key)
            keep = policy.keep_prob(rate, fresh[group] if fresh else ())
            if weighted:  # toward the questions the policy failed at their last rollout
                keep = 1.0 - online.pass_rate.get(key, 0.0)
            # keep 0 draws no random number, except in the online weighting, which always
            # did (it goes with uniform only: the config refuses it with another policy)
            if chosen is not None:
                indices = chosen[group]
            else:
                indices = (self.replay_sampler.draw_indices(messages, keep_prob=keep)
                           if keep > 0.0 or weighted else [])
            answers = self.replay_sampler.pool.get(messages)
            if answers:
                self.record.decided(rate, bool(indices))
            items = tokenize_replays([answers[i] for i in indices], self.tokenizer,
                                     self.cfg.rollout.max_response_tokens, self.eos_token_id)
            for index, item in zip(indices, items):
                age = online.age(messages, index, step) if online is not None else None
                replays.append(Sample(group, item.token_ids, item.text, REPLAY,
                                      engine_logprobs=self._behaviour(messages, index, item),
                                      pool_index=index, age=age))
        # each group: its G fresh responses, then its replays
        by_group: dict[int, list[Sample]] = {}
        for seq in batch.sequences + replays:
            by_group.setdefault(seq.group, []).append(seq)
        batch.sequences = [s for g in range(len(batch.rows)) for s in by_group.get(g, [])]

    def _least_likely(self, batch: StepBatch) -> list[list[int]]:
        """``replay.policy=unlikely``: per group, the pool answers it replays (``pick``: one
        forward pass of the actor, a collective; every rank holds the batch)."""
        from rlep_megatron.replay.pool import tokenize_replays

        if self.likelihood is None:
            raise RuntimeError("replay.policy=unlikely scores pool answers with the actor, but "
                               "the rollout side was given no likelihood function")
        cfg = self.cfg
        chosen, scored, picked = self.replay_policy.pick(
            self.replay_sampler, [(self.train_rows.messages[row], batch.prompts[group])
                                  for group, row in enumerate(batch.rows)],
            lambda texts: [item.token_ids for item in tokenize_replays(
                texts, self.tokenizer, cfg.rollout.max_response_tokens, self.eos_token_id)],
            self.likelihood, cfg.replay.unlikely_candidates)
        self._scored[0].extend(scored)
        self._scored[1].extend(picked)
        return chosen

    def _behaviour(self, messages, index: int, item) -> Optional[list[float]]:
        """The pool's behaviour log-probs of a replayed answer, where the pool has them for
        exactly the tokens replayed (the answer's text re-tokenised, EOS appended, may split
        otherwise than the policy sampled it: then ``None``, the paper's weight 1)."""
        entry = self.replay_sampler.pool.behaviour_of(messages, index)
        if entry is None or entry.get("logprobs") is None or entry.get("token_ids") is None:
            return None
        if [int(t) for t in entry["token_ids"]] != list(item.token_ids):
            return None
        return [float(v) for v in entry["logprobs"]]

    def reward(self, batch: StepBatch, sequences: Optional[list[Sample]] = None) -> None:
        """Score every response (replays too), or those of ``sequences``; work split over all
        ranks."""
        from rlep_megatron.reward import overlong_penalty
        from rlep_megatron.reward.pool import ScoreRequest

        rows, cfg = self.train_rows, self.cfg
        sequences = batch.sequences if sequences is None else sequences
        requests = [ScoreRequest(rows.data_source[batch.rows[s.group]], s.text,
                                 rows.ground_truth[batch.rows[s.group]])
                    for s in sequences]
        for seq, result in zip(sequences,
                               distributed.map_across_ranks(self.scorer.score, requests)):
            seq.score, seq.acc = float(result["score"]), bool(result["acc"])
            seq.reward = seq.score + overlong_penalty(
                len(seq.token_ids), cfg.rollout.max_response_tokens,
                cfg.reward.overlong_buffer_tokens, cfg.reward.overlong_penalty_factor)

    # ------------------------------------------------------------------ replay bookkeeping

    def _count_replays(self, batch: StepBatch) -> None:
        """Count the replays that made it into the step's batch (dynamic sampling may have
        dropped the groups of others)."""
        if self.replay_sampler is None:
            return
        for seq in batch.sequences:
            if seq.source == REPLAY:
                self.replay_sampler.record(self.train_rows.messages[batch.rows[seq.group]],
                                           seq.pool_index)

    def _admit_online(self, step: int) -> int:
        """replay.mode online / both: the step's verified-correct fresh answers that ended by
        themselves join their question's pool, after this step's replays were drawn; every
        generation round counts (with dynamic sampling, the groups it dropped too)."""
        if self.online_pool is None:
            return 0
        admitted = 0
        for row, texts, correct, ended, behaviour in self._candidates:
            admitted += self.online_pool.admit(self.train_rows.messages[row], texts, correct,
                                               step, ended=ended, behaviour=behaviour)
        self._candidates = []
        return admitted

    # ------------------------------------------------------------------ metrics

    def metrics(self, batch: StepBatch, step: int) -> dict[str, float]:
        """The step's rollout and replay metrics (every rank holds the whole batch)."""
        m = batch_metrics(batch)
        fresh = [s for s in batch.sequences if s.source == FRESH]
        replay = [s for s in batch.sequences if s.source == REPLAY]
        m.update(staleness_metrics(fresh, step, self.cfg.trainer.max_staleness))
        if self.replay_sampler is not None:
            m.update({f"replay/{k}": v
                      for k, v in self.replay_sampler.replay_counts_summary().items()})
            m["replay/pool_questions"] = float(len(self.pool))
            m["replay/pool_answers"] = float(sum(map(len, self.pool.answers.values())))
        if self.replay_policy.scores_candidates:
            m.update(likelihood_metrics(*self._scored))
        if self.pass_rates is not None:
            m.update(self.record.metrics(fresh_correct_by_group(batch),
                                         {s.group for s in replay}))
        if self.online_pool is not None:
            m["replay/online_admitted"] = float(self.admitted)
            m["replay/online_answers"] = float(self.online_pool.num_online_answers())
            m["replay/online_age_mean"] = _mean(s.age for s in replay if s.age is not None)
            m["replay/age_mean"] = m["replay/online_age_mean"]
        return m

    # ------------------------------------------------------------------ checkpoint state

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict(),
                "replay_sampler": (self.replay_sampler.state_dict()
                                   if self.replay_sampler else None),
                "pass_rates": self.pass_rates.state_dict() if self.pass_rates else None}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        if self.replay_sampler is not None and state["replay_sampler"] is not None:
            self.replay_sampler.load_state_dict(state["replay_sampler"])
        if self.pass_rates is not None and state.get("pass_rates") is not None:
            low_pass = self.replay_policy.name == "low_pass"
            if not self.pass_rates.load_state_dict(state["pass_rates"], strict=low_pass):
                logger.warning("the checkpoint's pass rates were tracked with another "
                               "replay.pass_rate_ema: the replay/pass_rate metrics start "
                               "afresh")
        elif self.pass_rates is not None and self.replay_policy.name == "low_pass":
            logger.warning("the checkpoint has no tracked pass rates (saved before "
                           "replay.policy existed): replay.policy=low_pass starts from none")

    def close(self) -> None:
        self.scorer.close()


def batch_metrics(batch: StepBatch) -> dict[str, float]:
    """The step's fresh responses' and replays' statistics (``rollout/``, ``replay/``,
    ``advantage/``)."""
    fresh = [s for s in batch.sequences if s.source == FRESH]
    replay = [s for s in batch.sequences if s.source == REPLAY]
    with_pool = {s.group for s in replay}
    in_pool_groups = [s for s in batch.sequences if s.group in with_pool]
    return {
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
        "replay/behaviour_frac": _mean(s.engine_logprobs is not None for s in replay),
    }


def staleness_metrics(fresh: list[Sample], step: int, max_staleness: int
                      ) -> dict[str, float]:
    """Over the step's fresh tokens, how many versions behind the policy being trained each
    is: ``rollout/staleness_mean`` / ``_max``, the histogram ``rollout/staleness_frac/<v>``
    for v = 0 .. ``max_staleness``, and ``rollout/carried_over_frac``, the share of fresh
    responses with tokens of an older version."""
    stale = [step - v for s in fresh for v in s.token_versions()]
    out = {"rollout/staleness_mean": _mean(stale),
           "rollout/staleness_max": float(max(stale, default=0)),
           "rollout/carried_over_frac": _mean(any(v < step for v, _ in s.versions)
                                              for s in fresh)}
    for value in range(max_staleness + 1):
        out[f"rollout/staleness_frac/{value}"] = _mean(v == value for v in stale)
    return out
