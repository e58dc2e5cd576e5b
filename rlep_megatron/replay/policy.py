"""Replay policies (``replay.policy``): per group, whether pool answers join it.

- ``uniform`` (the paper, the default): every group whose question has pool answers gets
  ``replay.num_replays_per_prompt`` of them.
- ``low_pass``: a group gets them with probability 1 - p, p its question's tracked pass rate
  (:class:`PassRateTracker`; a question not rolled out before always gets them), so replay goes
  to the questions the policy still fails.
- ``rescue``: only a group whose fresh responses all failed gets them: the one group that
  carries no signal without them. With ``algo.dynamic_sampling`` such a group is then kept (its
  replays vary its rewards) instead of dropped.
- ``unlikely``: every group with a pool gets them, as with ``uniform``, but which of its pool
  answers is the policy's choice: up to ``replay.unlikely_candidates`` of them (drawn
  uniformly) are scored by the current policy, and the M it finds least likely (the lowest
  mean log-prob per token) are replayed: the verified answers it has learned least.

The decision of one group (:meth:`ReplayPolicy.keep_prob`) is a probability: 1 draws as the
paper does, 0 draws nothing (and takes no random number), in between the replay sampler draws
one uniform number against it first.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

POLICIES = ("uniform", "low_pass", "rescue", "unlikely")

# the pass-rate bins of the replay metrics (docs/metrics.md): [0, .25), [.25, .5), [.5, .75),
# [.75, 1], and the questions not rolled out yet
PASS_RATE_BINS = ("lt25", "25to50", "50to75", "ge75")
UNSEEN = "unseen"


def pass_rate_bin(rate: Optional[float]) -> str:
    if rate is None:
        return UNSEEN
    return PASS_RATE_BINS[min(3, int(rate * 4))]


class PassRateTracker:
    """Per question (prompt key), its fresh responses' share verified correct, as an
    exponential moving average over the steps that rolled it out: ``p <- (1 - a) p + a x``
    with ``a`` = ``replay.pass_rate_ema`` (1: the latest rollout only); its first rollout sets
    it. Updated after each step from every generation round of the step (with dynamic sampling
    the groups it dropped too), so a step's replay decisions see the earlier steps only. Kept in
    checkpoints."""

    def __init__(self, ema: float):
        if not 0.0 < ema <= 1.0:
            raise ValueError(f"replay.pass_rate_ema must be in (0, 1], got {ema}")
        self.ema = ema
        self.rates: dict[str, float] = {}

    def get(self, key: str) -> Optional[float]:
        return self.rates.get(key)

    def update(self, observed: Sequence[tuple[str, Sequence[bool]]]) -> None:
        """One step's ``(question key, its fresh responses' correctness)`` per group; a
        question rolled out in several groups of the step counts them as one observation."""
        merged: dict[str, list[bool]] = {}
        for key, correct in observed:
            merged.setdefault(key, []).extend(bool(c) for c in correct)
        for key, correct in merged.items():
            if not correct:
                continue
            x = sum(correct) / len(correct)
            old = self.rates.get(key)
            self.rates[key] = x if old is None else (1.0 - self.ema) * old + self.ema * x

    def histogram(self) -> dict[str, float]:
        """The share of the tracked questions in each pass-rate bin."""
        counts = dict.fromkeys(PASS_RATE_BINS, 0)
        for rate in self.rates.values():
            counts[pass_rate_bin(rate)] += 1
        total = max(1, len(self.rates))
        return {name: counts[name] / total for name in PASS_RATE_BINS}

    def state_dict(self) -> dict:
        return {"ema": self.ema, "rates": dict(self.rates)}

    def load_state_dict(self, state: dict, strict: bool = True) -> bool:
        """Restore the saved rates; with another ``replay.pass_rate_ema`` an error when
        ``strict`` (the rates decide replays), else nothing is restored (they only feed
        metrics) and False is returned."""
        if state["ema"] != self.ema:
            if not strict:
                return False
            raise ValueError(f"the checkpoint's pass rates were tracked with replay."
                             f"pass_rate_ema={state['ema']}, this run has {self.ema}: resume "
                             "with the same value")
        self.rates = dict(state["rates"])
        return True


class ReplayPolicy:
    """``uniform``: every group with a pool gets its replays (``keep_prob`` 1)."""

    name = "uniform"
    needs_fresh_rewards = False
    """True: the decision reads the group's fresh rewards, so they are scored first."""
    scores_candidates = False
    """True: the policy picks among a group's pool answers by the current policy's log-probs
    of them (:meth:`choose`); otherwise the replay sampler draws them uniformly."""

    def keep_prob(self, pass_rate: Optional[float], fresh_correct: Sequence[bool]) -> float:
        return 1.0


class LowPassPolicy(ReplayPolicy):
    """``low_pass``: probability 1 - p, p the question's tracked pass rate (1 unseen)."""

    name = "low_pass"

    def keep_prob(self, pass_rate: Optional[float], fresh_correct: Sequence[bool]) -> float:
        return 1.0 if pass_rate is None else 1.0 - pass_rate


class RescuePolicy(ReplayPolicy):
    """``rescue``: only groups whose fresh responses all failed."""

    name = "rescue"
    needs_fresh_rewards = True

    def keep_prob(self, pass_rate: Optional[float], fresh_correct: Sequence[bool]) -> float:
        return 1.0 if fresh_correct and not any(fresh_correct) else 0.0


class UnlikelyPolicy(ReplayPolicy):
    """``unlikely``: every group with a pool, its M candidates of lowest likelihood."""

    name = "unlikely"
    scores_candidates = True

    @staticmethod
    def choose(logprob_means: Sequence[float], m: int) -> list[int]:
        """Positions of the ``m`` lowest of ``logprob_means`` (each candidate's mean log-prob
        per token under the current policy), lowest first; equal values keep the candidates'
        order (the sampler's draw)."""
        order = sorted(range(len(logprob_means)), key=lambda i: (logprob_means[i], i))
        return order[:m]

    def pick(self, sampler, groups: Sequence[tuple], tokenize: Callable, likelihood: Callable,
             num_candidates: int) -> tuple[list[list[int]], list, list]:
        """Per group (``(messages, prompt token ids)``), the indices into its question's pool
        answers to replay: up to ``num_candidates`` drawn by ``sampler``
        (:meth:`~rlep_megatron.replay.pool.ReplaySampler.draw_candidates`), tokenised by
        ``tokenize`` (texts -> token id lists), scored in one call of ``likelihood``
        (prompts, responses -> per pair ``(sum of log-probs, tokens)``), its M lowest
        (:meth:`choose`). Also returns the ``(sum, tokens)`` of every scored candidate and of
        the chosen ones."""
        candidates, prompts, responses = [], [], []
        for messages, prompt in groups:
            indices = sampler.draw_candidates(messages, num_candidates)
            answers = sampler.pool.get(messages)
            tokens = tokenize([answers[i] for i in indices]) if indices else []
            candidates.append(indices)
            prompts += [prompt] * len(tokens)
            responses += tokens
        sums = likelihood(prompts, responses) if responses else []
        chosen, scored, picked, at = [], [], [], 0
        for indices in candidates:
            scores = sums[at:at + len(indices)]
            at += len(indices)
            best = self.choose([total / max(count, 1) for total, count in scores],
                               sampler.num_replays_per_prompt)
            chosen.append([indices[p] for p in best])
            scored += scores
            picked += [scores[p] for p in best]
        return chosen, scored, picked


def likelihood_metrics(scored: Sequence[tuple], picked: Sequence[tuple]) -> dict[str, float]:
    """``replay/candidate_logprob_mean`` and ``replay/chosen_logprob_mean``: per token, over
    the ``(sum of log-probs, tokens)`` of the step's scored candidates and of those chosen."""
    out = {}
    for name, scores in (("candidate", scored), ("chosen", picked)):
        tokens = sum(count for _, count in scores)
        out[f"replay/{name}_logprob_mean"] = (sum(total for total, _ in scores) / tokens
                                              if tokens else 0.0)
    return out


def make_replay_policy(name: str) -> ReplayPolicy:
    policies = {cls.name: cls
                for cls in (ReplayPolicy, LowPassPolicy, RescuePolicy, UnlikelyPolicy)}
    if name not in policies:
        raise ValueError(f"replay.policy must be one of {', '.join(POLICIES)}, got {name!r}")
    return policies[name]()


class ReplayRecord:
    """One step's replay bookkeeping beside the tracker: the decision for each group whose
    question has pool answers (its pass-rate bin before the step, replayed or not), and the
    fresh responses' correctness of every generation round, which update the tracker once the
    step's replays are drawn. Its metrics say where the step's replays went
    (docs/metrics.md)."""

    def __init__(self, tracker: PassRateTracker):
        self.tracker = tracker
        self.decisions: list[tuple[str, bool]] = []
        self.observed: list[tuple[str, list[bool]]] = []

    def start_step(self) -> None:
        self.decisions = []

    def decided(self, pass_rate: Optional[float], replayed: bool) -> None:
        self.decisions.append((pass_rate_bin(pass_rate), bool(replayed)))

    def observe(self, observed: Sequence[tuple[str, list[bool]]]) -> None:
        """A generation round's ``(question key, its fresh responses' correctness)``."""
        self.observed += observed

    def end_step(self) -> None:
        """After the step's replays: the tracker learns the step's rounds."""
        self.tracker.update(self.observed)
        self.observed = []

    def metrics(self, group_correct: Sequence[Sequence[bool]],
                replayed_groups: set[int]) -> dict[str, float]:
        """Per pass-rate bin of the question (tracked before the step): the groups with a pool
        and the share of them that got replays; the groups rescued (every fresh response of the
        step's batch failed, replays joined); the tracked questions' pass-rate histogram after
        the step. ``group_correct``: per group of the batch, its fresh responses' correctness;
        ``replayed_groups``: the groups with replays."""
        m: dict[str, float] = {}
        for name in (*PASS_RATE_BINS, UNSEEN):
            got = [replayed for bin_name, replayed in self.decisions if bin_name == name]
            m[f"replay/groups_by_pass_rate/{name}"] = float(len(got))
            m[f"replay/share_by_pass_rate/{name}"] = (float(sum(got) / len(got)) if got
                                                       else 0.0)
        failed = [group for group, correct in enumerate(group_correct)
                  if correct and not any(correct)]
        m["replay/rescued_groups"] = float(sum(group in replayed_groups for group in failed))
        m.update({f"replay/pass_rate_hist/{name}": value
                  for name, value in self.tracker.histogram().items()})
        m["replay/pass_rate_questions"] = float(len(self.tracker.rates))
        return m
