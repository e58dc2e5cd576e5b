"""The experience pool (docs/ALGORITHM.md sections 1, 3.4 and 8): per question, the verified correct
response texts; replay draws; tokenisation of replayed answers.

A pool is read from ``reward_model.candidates`` of DAPO-schema rows (RLEP's released training
file, or our ``collect`` output) and keyed by the prompt (chat messages), so a separate pool file
matches the training rows whatever their order or repetition.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from rlep_megatron.data.schema import PromptRows, prompt_key

logger = logging.getLogger(__name__)

REPLAY = "replay"
FRESH = "fresh"


class ExperiencePool:
    """Question (prompt key) -> list of correct response texts, in stored order, and where the
    pool has them, each answer's behaviour: the tokens the policy that wrote it sampled, its
    log-prob of each, and its version (``{"token_ids", "logprobs", "version"}`` or ``None``)."""

    def __init__(self, answers: dict[str, list[str]],
                 behaviour: Optional[dict[str, list[Optional[dict]]]] = None):
        self.answers = answers
        self.behaviour = behaviour or {}

    def behaviour_of(self, messages: Sequence[dict], index: int) -> Optional[dict]:
        entries = self.behaviour.get(prompt_key(messages))
        return entries[index] if entries is not None and index < len(entries) else None

    @classmethod
    def from_rows(cls, rows: PromptRows) -> "ExperiencePool":
        """Collect ``candidates`` per question. Empty or whitespace-only texts are dropped: a
        replayed empty answer would become a lone EOS scored -1 (docs/ALGORITHM.md section 8)."""
        answers: dict[str, list[str]] = {}
        behaviour: dict[str, list[Optional[dict]]] = {}
        dropped = 0
        for messages, candidates, entries in zip(rows.messages, rows.candidates,
                                                 rows.behaviour or [None] * len(rows)):
            if not candidates:
                continue
            key = prompt_key(messages)
            if key in answers:
                continue  # repeated rows of one question carry the same pool
            entries = entries or [None] * len(candidates)
            kept = [(text, entry) for text, entry in zip(candidates, entries)
                    if text and text.strip()]
            dropped += len(candidates) - len(kept)
            if kept:
                answers[key] = [text for text, _ in kept]
                if any(entry is not None for _, entry in kept):
                    behaviour[key] = [entry for _, entry in kept]
        if dropped:
            logger.warning("experience pool: dropped %d empty candidate texts", dropped)
        return cls(answers, behaviour)

    def __len__(self) -> int:
        return len(self.answers)

    def get(self, messages: Sequence[dict]) -> list[str]:
        return self.answers.get(prompt_key(messages), [])

    def coverage(self, rows: PromptRows) -> float:
        """Fraction of distinct questions of ``rows`` that have a pool."""
        keys = {prompt_key(m) for m in rows.messages}
        return sum(k in self.answers for k in keys) / max(1, len(keys))

    def num_offline(self, key: str) -> int:
        """How many of the question's answers came from the pool files (all of them here)."""
        return len(self.answers.get(key, ()))

    def pooled_rows(self, rows: PromptRows) -> list[int]:
        """Indices of the rows of ``rows`` whose question has pool answers, in order."""
        return [r for r, messages in enumerate(rows.messages) if prompt_key(messages) in
                self.answers]

    def check_matches(self, rows: PromptRows, source: str) -> None:
        """Fail early when a pool shares no question with the training data."""
        if len(self) and self.coverage(rows) == 0.0:
            raise ValueError(
                f"the experience pool from {source} has {len(self)} questions but none of them "
                "is a question of the training files; was it collected on another dataset or "
                "with a different prompt format?")


class OnlinePool(ExperiencePool):
    """An experience pool that grows during the run (``replay.mode: online | both``): the
    verified-correct fresh answers of each step join their question's pool, after the
    question's offline answers (``both``; none with ``online``), keeping the most recent
    ``answers_per_question`` of them. Each online answer remembers the step that sampled it
    (for its age when replayed), and each question its latest pass rate (for the optional
    weighting toward questions the policy still fails). The whole state is checkpointed."""

    def __init__(self, offline: dict[str, list[str]], answers_per_question: int,
                 behaviour: Optional[dict[str, list[Optional[dict]]]] = None):
        if answers_per_question < 1:
            raise ValueError(f"online answers per question must be >= 1, got "
                             f"{answers_per_question}")
        behaviour = behaviour or {}
        super().__init__({key: list(texts) for key, texts in offline.items()},
                         {key: list(behaviour.get(key) or [None] * len(texts))
                          for key, texts in offline.items()})
        self.offline_counts = {key: len(texts) for key, texts in offline.items()}
        self.answers_per_question = answers_per_question
        self.born: dict[str, list[int]] = {}
        """per question: the step of each online answer, in the order of its online answers"""
        self.pass_rate: dict[str, float] = {}

    def num_offline(self, key: str) -> int:
        return self.offline_counts.get(key, 0)

    def admit(self, messages: Sequence[dict], texts: Sequence[str], correct: Sequence[bool],
              step: int, ended: Optional[Sequence[bool]] = None,
              behaviour: Optional[Sequence[Optional[dict]]] = None) -> int:
        """Record one group's fresh answers (sampled at ``step``): its pass rate (the share
        verified correct), and its correct non-empty texts that ended by themselves
        (``ended``, default all) as the newest online answers (the oldest beyond the cap
        leave), with their ``behaviour`` (tokens, log-probs, version) where given. Returns
        the number admitted."""
        ended = [True] * len(texts) if ended is None else list(ended)
        behaviour = [None] * len(texts) if behaviour is None else list(behaviour)
        if not len(texts) == len(correct) == len(ended) == len(behaviour):
            raise ValueError("admit needs one correctness flag, one end flag and one "
                             "behaviour entry per text")
        if not texts:
            return 0
        key = prompt_key(messages)
        self.pass_rate[key] = sum(map(bool, correct)) / len(correct)
        new = [(text, entry) for text, ok, end, entry in zip(texts, correct, ended, behaviour)
               if ok and end and text and text.strip()]
        if not new:
            return 0
        offline = self.num_offline(key)
        texts_now = self.answers.get(key, [])
        entries_now = self.behaviour.get(key, [None] * len(texts_now))
        cap = self.answers_per_question
        online = (texts_now[offline:] + [text for text, _ in new])[-cap:]
        entries = (entries_now[offline:] + [entry for _, entry in new])[-cap:]
        born = (self.born.get(key, []) + [step] * len(new))[-cap:]
        self.answers[key] = texts_now[:offline] + online
        self.behaviour[key] = entries_now[:offline] + entries
        self.born[key] = born
        return len(new)

    def age(self, messages: Sequence[dict], index: int, step: int) -> Optional[int]:
        """Steps since answer ``index`` of the question was sampled (None: an offline one)."""
        key = prompt_key(messages)
        offline = self.num_offline(key)
        return None if index < offline else step - self.born[key][index - offline]

    def num_online_answers(self) -> int:
        return sum(len(b) for b in self.born.values())

    def state_dict(self) -> dict:
        return {"online": {key: [self.answers[key][self.num_offline(key):], list(born)]
                           for key, born in self.born.items()},
                "online_behaviour": {key: self.behaviour[key][self.num_offline(key):]
                                     for key in self.born},
                "pass_rate": dict(self.pass_rate),
                "answers_per_question": self.answers_per_question}

    def load_state_dict(self, state: dict) -> None:
        if state["answers_per_question"] != self.answers_per_question:
            raise ValueError(f"the checkpoint's online pool keeps "
                             f"{state['answers_per_question']} answers per question, this run "
                             f"{self.answers_per_question}: resume with the same "
                             "replay.online_answers_per_question")
        for key in list(self.born):  # back to the offline pool, then the saved online part
            offline = self.num_offline(key)
            self.answers[key] = self.answers[key][:offline]
            self.behaviour[key] = self.behaviour.get(key, [])[:offline]
            if not self.answers[key]:
                del self.answers[key]
                self.behaviour.pop(key, None)
        self.born = {}
        saved_behaviour = state.get("online_behaviour", {})  # older checkpoints: none
        for key, (texts, born) in state["online"].items():
            offline = self.num_offline(key)
            self.answers[key] = self.answers.get(key, [])[:offline] + list(texts)
            self.behaviour[key] = (self.behaviour.get(key, [None] * offline)[:offline]
                                   + list(saved_behaviour.get(key) or [None] * len(texts)))
            self.born[key] = list(born)
        self.pass_rate = dict(state["pass_rate"])


class ReplaySampler:
    """Draws M pool answers per prompt occurrence, uniformly without replacement (all of them,
    in stored order, when the pool has <= M); a fresh draw every time a row is used.

    It also counts how many times each pool answer from the pool files has been replayed
    (:meth:`record`, called for the replays that made it into a training batch; answers of an
    :class:`OnlinePool` come and go, and are not counted). The RNG state, the counts and an
    online pool's state are saved in checkpoints, so a resumed run draws the same replays and
    keeps counting."""

    def __init__(self, pool: ExperiencePool, num_replays_per_prompt: int, seed: int):
        if num_replays_per_prompt < 0:
            raise ValueError(f"num_replays_per_prompt must be >= 0, got {num_replays_per_prompt}")
        self.pool = pool
        self.num_replays_per_prompt = num_replays_per_prompt
        self._rng = np.random.default_rng([seed, 0x5E1A7])
        self._counts: dict[str, list[int]] = {}
        self._num_answers = sum(pool.num_offline(key) for key in pool.answers)

    def draw_indices(self, messages: Sequence[dict], keep_prob: float = 1.0) -> list[int]:
        """Indices into the question's pool answers (``pool.get(messages)``). With
        ``keep_prob`` < 1 the group gets its replays only with that probability."""
        n = len(self.pool.get(messages))
        m = self.num_replays_per_prompt
        if m == 0 or n == 0:
            return []
        if keep_prob < 1.0 and self._rng.random() >= keep_prob:
            return []
        if n <= m:
            return list(range(n))
        return [int(i) for i in self._rng.choice(n, size=m, replace=False)]

    def draw_candidates(self, messages: Sequence[dict], k: int) -> list[int]:
        """Up to ``k`` indices into the question's pool answers for a policy to choose among
        (``replay.policy=unlikely``): all of them, in stored order, when the pool has <= ``k``
        (or ``k`` is 0), else ``k`` drawn uniformly without replacement."""
        n = len(self.pool.get(messages))
        if self.num_replays_per_prompt == 0 or n == 0:
            return []
        if k == 0 or n <= k:
            return list(range(n))
        return [int(i) for i in self._rng.choice(n, size=k, replace=False)]

    def draw(self, messages: Sequence[dict]) -> list[str]:
        answers = self.pool.get(messages)
        return [answers[i] for i in self.draw_indices(messages)]

    def record(self, messages: Sequence[dict], index: int) -> None:
        """Count one replay of answer ``index`` of the question ``messages``."""
        key = prompt_key(messages)
        offline = self.pool.num_offline(key)
        if index >= offline:
            return  # an online answer
        counts = self._counts.setdefault(key, [0] * offline)
        counts[index] += 1

    def replay_counts_summary(self) -> dict[str, float]:
        """How often pool answers have been replayed so far: ``times_replayed_mean`` (over every
        answer of the pool), ``times_replayed_max`` and ``answers_replayed_frac`` (answers
        replayed at least once)."""
        flat = [c for counts in self._counts.values() for c in counts]
        total = max(1, self._num_answers)
        return {"times_replayed_mean": sum(flat) / total,
                "times_replayed_max": float(max(flat, default=0)),
                "answers_replayed_frac": sum(c > 0 for c in flat) / total}

    def state_dict(self) -> dict:
        state = {"bit_generator": self._rng.bit_generator.state,
                 "counts": {key: list(c) for key, c in self._counts.items()}}
        if isinstance(self.pool, OnlinePool):
            state["online_pool"] = self.pool.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self._rng.bit_generator.state = state["bit_generator"]
        self._counts = {key: list(c) for key, c in state.get("counts", {}).items()}
        if isinstance(self.pool, OnlinePool):
            if "online_pool" not in state:
                raise ValueError("the checkpoint was saved without an online pool; resume "
                                 "with the replay.mode it was saved with")
            self.pool.load_state_dict(state["online_pool"])


@dataclass(frozen=True)
class ReplayResponse:
    text: str
    token_ids: list[int]
    """``[num_tokens]``: the text tokenised without special tokens, then EOS, truncated to the
    response budget."""
    source: str = REPLAY


def tokenize_replays(texts: Sequence[str], tokenizer, max_response_tokens: int,
                     eos_token_id: Optional[int] = None) -> list[ReplayResponse]:
    eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id; pass eos_token_id explicitly")
    responses = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
        if len(ids) > max_response_tokens:
            # the reward scores what is trained: the text of the kept tokens (no EOS left)
            ids = ids[:max_response_tokens]
            text = tokenizer.decode(ids, skip_special_tokens=False)
        responses.append(ReplayResponse(text=text, token_ids=ids))
    return responses
