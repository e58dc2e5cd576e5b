"""What both backends' request drivers share: the seed of each request and of each resumed
request, a response on its way (:class:`Pending`), the finished responses of a batch, how one
call's prompts are cut between replicas and how their groups are gathered back."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Optional

from rlep_megatron.rollout.response import Response, decode_response


@dataclass
class Pending:
    """One fresh response on its way: where it belongs and what it has so far."""

    key: tuple[int, int, int]        # (step of its batch, prompt index, sample index)
    prompt: list[int]
    seed: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[tuple[int, int]] = field(default_factory=list)
    finish_reason: Optional[str] = None
    request_id: Optional[str] = None  # set while the request is in the engine

    def add_tokens(self, token_ids, logprobs, version: int) -> None:
        self.token_ids += token_ids
        self.logprobs += logprobs
        if self.versions and self.versions[-1][0] == version:
            self.versions[-1] = (version, self.versions[-1][1] + len(token_ids))
        elif token_ids:
            self.versions.append((version, len(token_ids)))


def continuation_seed(seed: int, num_tokens: int) -> int:
    """The seed of a request resumed after ``num_tokens`` tokens (deterministic, unrelated to
    the seeds of other requests)."""
    digest = hashlib.blake2b(f"{seed}:{num_tokens}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2 ** 31


_SEED_SPAN = 2 ** 30


def request_seed(seed: int, prompt_index: int, n: int) -> int:
    """Seed of one request. vLLM seeds the ``n`` samples of a request with ``seed + j``, so the
    requests of one call get consecutive blocks of ``n`` seeds from a base hashed from
    ``seed``: ``base + prompt_index x n``. No two requests of a call share a seed (by
    construction, for up to 2^30 / n prompts), the same seed reproduces a batch, and
    different calls (steps) start from unrelated bases."""
    if (prompt_index + 1) * n > _SEED_SPAN:
        raise ValueError(f"request {prompt_index} with n={n} samples leaves the seed range; "
                         f"at most {_SEED_SPAN // n} prompts per generate call")
    digest = hashlib.blake2b(str(seed).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % _SEED_SPAN + prompt_index * n


def sampling_settings(cfg, n: Optional[int], temperature: Optional[float],
                      top_p: Optional[float], top_k: Optional[int],
                      max_tokens: Optional[int]) -> tuple[int, float, float, int, int]:
    """``(n, temperature, top_p, top_k, max_tokens)`` of a generate call: each one given, or the
    rollout config's (``cfg``: ``RolloutConfig``)."""
    return (cfg.num_samples_per_prompt if n is None else n,
            cfg.temperature if temperature is None else temperature,
            cfg.top_p if top_p is None else top_p,
            cfg.top_k if top_k is None else top_k,
            cfg.max_response_tokens if max_tokens is None else max_tokens)


def replica_share(prompts: list[list[int]], n: int, max_tokens: int, dp_size: int,
                  dp_rank: int) -> range:
    """The prompt indices one of ``dp_size`` rollout replicas samples: a contiguous range,
    balanced over the replicas by token budget, ``prompt length + n x max_tokens`` per prompt
    (the prompt is prefilled once for its ``n`` samples; each sample may decode up to
    ``max_tokens``)."""
    return split_by_budget([len(p) + n * max_tokens for p in prompts], dp_size)[dp_rank]


def split_by_budget(costs: list[int], parts: int) -> list[range]:
    """Cut ``len(costs)`` items, in order, into ``parts`` contiguous ranges whose cost sums are
    as even as a contiguous cut allows: range ``r`` ends where the running cost first reaches
    ``(r + 1) / parts`` of the total (the item straddling a boundary goes to the side that
    leaves the smaller excess). Fewer items than parts leaves some ranges empty."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    total = float(sum(costs))
    bounds = [0]
    running, index = 0.0, 0
    for r in range(1, parts):
        target = total * r / parts
        while index < len(costs) and running + costs[index] <= target:
            running += costs[index]
            index += 1
        # take the straddling item when that overshoots less than leaving it undershoots
        if index < len(costs) and running + costs[index] - target < target - running:
            running += costs[index]
            index += 1
        bounds.append(max(index, bounds[-1]))
    bounds.append(len(costs))
    return [range(bounds[r], bounds[r + 1]) for r in range(parts)]



def merge_gathered(gathered: list, num_prompts: int) -> list[list[Response]]:
    """Every sender's groups of responses, in rank order (``None``: a rank that sent none),
    checked to be the ``num_prompts`` groups asked for."""
    merged = [group for part in gathered if part is not None for group in part]
    if len(merged) != num_prompts:
        raise RuntimeError(f"rollout gathered {len(merged)} prompt groups, "
                           f"expected {num_prompts}")
    return merged


def take_finished(pending: dict, step: int, tokenizer) -> list[list[Response]]:
    """The finished responses of batch ``step`` in ``pending`` (keyed ``(step, prompt,
    sample)``), per prompt in order, removed from it."""
    keys = sorted(key for key in pending if key[0] == step)
    groups: dict[int, list[Response]] = {}
    for key in keys:
        item = pending.pop(key)
        stop = item.finish_reason == "stop"
        text = decode_response(tokenizer, item.prompt,
                                item.token_ids[:-1] if stop else item.token_ids)
        groups.setdefault(key[1], []).append(
            Response(key[1], item.token_ids, item.logprobs, text,
                     item.finish_reason, versions=list(item.versions)))
    return [groups[index] for index in sorted(groups)]
