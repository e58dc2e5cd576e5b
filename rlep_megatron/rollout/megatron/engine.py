"""The megatron rollout backend (``rollout.backend: megatron``): the actor's own megatron-core
``GPTModel`` generates, with megatron-core's static inference context
(``megatron.core.inference.contexts.StaticInferenceContext``) holding the KV cache.

No vLLM, so no second copy of the weights and no weight sync: in ``rlep train`` the engine
generates with the chunks the optimizer updates, and a weight update is a version change only
(``receives_weights`` is false; the lifecycle passes no tensor). ``rlep collect`` / ``rlep
eval`` build the checkpoint's model first (:mod:`rlep_megatron.rollout.loading`).

Layout: each data-parallel replica of the actor (its tensor-parallel group) samples a share of
the prompts (:func:`~rlep_megatron.rollout.requests.split_by_budget`), every rank of the group
running the same forward passes on the same rows; the logits are gathered over the group
(``runtime_gather_output``), so every rank draws the same tokens from the same per-request
seeds, and the replicas' responses are gathered on every rank. Pipeline, context and expert
parallelism and sequence parallelism are refused by the config (decoding one token at a time
through a pipeline schedule, or split over ranks, is not written).

Decoding: the rows of one batch share their prompt length (a prompt's ``n`` samples, and other
prompts of that length); their prompts are prefilled into the KV cache in slices of at most
``prefill_tokens`` tokens (megatron's ``batch_size_offset``), then the batch decodes one token
per step; a row that stops leaves the batch (its KV cache rows are dropped), so the tail decodes
only what is left. Sampling is :mod:`rlep_megatron.rollout.megatron.sampling` (vLLM's semantics,
one generator per request); with tensor parallelism the first rank of the group sends the drawn
tokens to the others at every step, so that the group's ranks always decode the same rows.
The model runs in eval mode for generation and goes back to its mode after, with megatron DDP's
parameter-gather hooks off meanwhile (the weights are complete whenever the engine generates:
loaded whole, or gathered after each update; a hook would start a data-parallel collective
that replicas with other shares never reach)."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from typing import Optional, Sequence

import torch

from rlep_megatron import distributed
from rlep_megatron.rollout.megatron.sampling import generator, sample
from rlep_megatron.rollout.requests import (merge_gathered, replica_share, request_seed,
                                            sampling_settings)
from rlep_megatron.rollout.response import Response, decode_response

logger = logging.getLogger(__name__)


def stop_token_ids(model_dir: str, tokenizer) -> set[int]:
    """The ids that end a response, as vLLM takes them: the tokenizer's EOS and those of the
    checkpoint's ``generation_config.json``."""
    ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids.update(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None
                                    else []))
    if not ids:
        raise ValueError(f"{model_dir}: neither the tokenizer nor generation_config.json names an "
                         "end-of-sequence token; generation could never stop by itself")
    return ids


class MegatronEngine:
    """A rollout engine over this rank's megatron-core model chunk (one chunk: no pipeline).
    Collective over the world: every rank calls :meth:`generate` with the same prompts."""

    capturing_routing = False
    overlaps_training = False
    receives_weights = False
    routing_unavailable: Optional[str] = (
        "rollout.backend=megatron generates with the actor's own model and records no routing")

    def __init__(self, chunks: Sequence[torch.nn.Module], info, tokenizer_dir: str, cfg, *,
                 max_model_len: int, batch_size: int, prefill_tokens: int = 8192):
        from megatron.core import parallel_state as ps
        from transformers import AutoTokenizer

        if len(chunks) != 1:
            raise ValueError("rollout.backend=megatron decodes through one model chunk; this "
                             f"rank has {len(chunks)} (virtual pipeline stages)")
        if (ps.get_pipeline_model_parallel_world_size() > 1
                or ps.get_context_parallel_world_size() > 1
                or ps.get_expert_model_parallel_world_size() > 1):
            raise ValueError("rollout.backend=megatron needs parallel.pipeline_model_parallel_"
                             "size, context_parallel_size and expert_model_parallel_size 1")
        self.model, self.info, self.cfg = chunks[0], info, cfg
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.eos_token_id = int(self.tokenizer.eos_token_id)
        self.stop_ids = stop_token_ids(tokenizer_dir, self.tokenizer)
        self.max_model_len, self.batch_size = max_model_len, batch_size
        self.prefill_tokens = max(1, prefill_tokens)
        self.vocab_size = info.dims.vocab_size
        self.rank = torch.distributed.get_rank()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.tp_size = ps.get_tensor_model_parallel_world_size()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.tp_src = ps.get_tensor_model_parallel_src_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        self.gather_group = distributed.rollout_group(cfg.gather_timeout_minutes)
        self.device = next(self.model.parameters()).device
        self.busy_s = 0.0
        self.tokens_generated = 0
        logger.info("rollout engine: megatron-core (the actor's own model, %d replica(s), "
                    "batches of up to %d sequences)", self.dp_size, batch_size)

    # ------------------------------------------------------------------ generation

    def get_tokenizer(self):
        return self.tokenizer

    def share(self, prompts: list[list[int]], n: int = 1, max_tokens: int = 0) -> range:
        """The prompt indices this rank's replica samples (:func:`replica_share`)."""
        return replica_share(prompts, n, max_tokens, self.dp_size, self.dp_rank)

    def check_ready(self) -> None:
        """The model is the actor's: always current."""

    def generate(self, prompts: list[list[int]], n: Optional[int] = None, *,
                 temperature: Optional[float] = None, top_p: Optional[float] = None,
                 top_k: Optional[int] = None, max_tokens: Optional[int] = None,
                 seed: int = 0, routing: bool = True) -> list[list[Response]]:
        """``n`` responses per prompt, every prompt's on every rank, in prompt order; the
        ``j``-th sample of prompt ``i`` is drawn from seed ``request_seed(seed, i, n) + j``."""
        n, temperature, top_p, top_k, max_tokens = sampling_settings(
            self.cfg, n, temperature, top_p, top_k, max_tokens)
        for prompt in prompts:  # every rank checks every prompt: all raise, none waits
            self._check_prompt(prompt)
        mine = self.share(prompts, n, max_tokens)
        rows = [(i, list(prompts[i]), request_seed(seed, i, n) + j)
                for i in mine for j in range(n)]
        done = self.sample_rows([(p, s) for _, p, s in rows], max_tokens, temperature, top_p,
                                top_k)
        local: dict[int, list[Response]] = {}
        for (index, prompt, _), (tokens, logprobs, reason) in zip(rows, done):
            local.setdefault(index, []).append(self.response(index, prompt, tokens, logprobs,
                                                             reason))
        return self.all_gather([local[i] for i in mine], len(prompts))

    def response(self, index: int, prompt: list[int], tokens: list[int], logprobs: list[float],
                 reason: str) -> Response:
        text = decode_response(self.tokenizer, prompt,
                               tokens[:-1] if reason == "stop" else tokens)
        return Response(index, tokens, logprobs, text, reason)

    def sample_rows(self, rows: list[tuple[list[int], int]], max_tokens: int,
                    temperature: float, top_p: float, top_k: int
                    ) -> list[tuple[list[int], list[float], str]]:
        """``(tokens, log-probs, finish reason)`` of each ``(prompt, seed)`` row, each row
        given at most ``max_tokens`` new tokens (and the engine's ``max_model_len``)."""
        if max_tokens < 1:  # as vLLM's SamplingParams
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        out: list = [None] * len(rows)
        by_length: dict[int, list[int]] = {}
        for r, (prompt, _) in enumerate(rows):
            self._check_prompt(prompt)
            by_length.setdefault(len(prompt), []).append(r)
        started = time.perf_counter()
        with self._eval_mode(), torch.no_grad():
            for length in sorted(by_length):
                members = by_length[length]
                for first in range(0, len(members), self.batch_size):
                    batch = members[first:first + self.batch_size]
                    budget = min(max_tokens, self.max_model_len - length)
                    results = self._decode([rows[r][0] for r in batch],
                                           [rows[r][1] for r in batch], budget, temperature,
                                           top_p, top_k)
                    for r, result in zip(batch, results):
                        out[r] = result
                        self.tokens_generated += len(result[0])
        self.busy_s += time.perf_counter() - started
        return out

    def _check_prompt(self, prompt: list[int]) -> None:
        if not prompt:
            raise ValueError("rollout.backend=megatron got an empty prompt")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"a prompt of {len(prompt)} tokens leaves no room in the engine's "
                             f"{self.max_model_len} tokens (data.max_prompt_tokens + "
                             "rollout.max_response_tokens)")

    @contextlib.contextmanager
    def _eval_mode(self):
        """Eval mode, and megatron DDP's forward pre-hooks off (no parameter-gather collective
        inside generation; removing and adding them back is local)."""
        training = self.model.training
        hooked = bool(getattr(self.model, "use_forward_hook", False))
        if hooked:
            self.model.disable_forward_pre_hook(param_sync=False)
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(training)
            if hooked:
                self.model.enable_forward_pre_hook()

    def _forward(self, ids: torch.Tensor, start: int, context) -> torch.Tensor:
        """The next-token logits ``[rows, vocab]`` after ``ids`` ``[rows, t]`` at positions
        ``start..start+t-1`` (the KV cache holds the positions before)."""
        positions = torch.arange(start, start + ids.shape[1], device=self.device)
        logits = self.model(ids.to(self.device), positions.expand(ids.shape[0], -1), None,
                            inference_context=context, runtime_gather_output=True)
        return logits[:, -1, :self.vocab_size]

    def _decode(self, prompts: list[list[int]], seeds: list[int], max_tokens: int,
                temperature: float, top_p: float, top_k: int):
        from megatron.core.inference.contexts import StaticInferenceContext

        length = len(prompts[0])
        context = StaticInferenceContext(len(prompts), length + max_tokens)
        generators = [generator(s, self.device) for s in seeds]
        tokens: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        reasons: list[Optional[str]] = [None] * len(prompts)
        active = list(range(len(prompts)))
        ids = torch.tensor(prompts, dtype=torch.long)
        rows = max(1, self.prefill_tokens // length)  # the prefill's rows per forward
        parts = []
        for first in range(0, len(prompts), rows):
            context.batch_size_offset = first
            parts.append(self._forward(ids[first:first + rows], 0, context))
        context.batch_size_offset = 0
        logits = torch.cat(parts)
        position = length
        for step in range(max_tokens):
            drawn, logp = sample(logits, [generators[r] for r in active], temperature,
                                 top_p, top_k)
            drawn, logp = self._agree(drawn, logp)
            keep = []
            for k, r in enumerate(active):
                tokens[r].append(drawn[k])
                logprobs[r].append(logp[k])
                if drawn[k] in self.stop_ids:
                    reasons[r] = "stop"
                elif step == max_tokens - 1:
                    reasons[r] = "length"
                else:
                    keep.append(k)
            if not keep:
                break
            context.sequence_len_offset = position
            if len(keep) < len(active):  # finished rows leave the batch and its KV cache
                index = torch.tensor(keep, device=self.device)
                for layer, (keys, values) in context.key_value_memory_dict.items():
                    context.key_value_memory_dict[layer] = (keys.index_select(1, index),
                                                            values.index_select(1, index))
            context.enable_decode_mode()
            last = torch.tensor([[drawn[k]] for k in keep], dtype=torch.long)
            active = [active[k] for k in keep]
            logits = self._forward(last, position, context)
            position += 1
        return [(t, lp, reason) for t, lp, reason in zip(tokens, logprobs, reasons)]

    def _agree(self, drawn: torch.Tensor, logp: torch.Tensor) -> tuple[list[int], list[float]]:
        """The drawn tokens and log-probs as the tensor-parallel group's first rank has them
        (every rank computes them from the same gathered logits; this makes the group's stop
        decisions, and so its batches, the same by construction)."""
        if self.tp_size > 1:
            both = torch.stack([drawn.to(torch.float64), logp.to(torch.float64)])
            distributed.broadcast(both, src=self.tp_src, group=self.tp_group)
            drawn, logp = both[0].to(torch.long), both[1]
        return drawn.tolist(), logp.tolist()

    def requests(self, cfg):
        """A driver of requests across steps
        (:class:`~rlep_megatron.rollout.megatron.requests.MegatronRequests`)."""
        from rlep_megatron.rollout.megatron.requests import MegatronRequests

        return MegatronRequests(self, cfg)

    def all_gather(self, local: list[list[Response]], num_prompts: int
                   ) -> list[list[Response]]:
        """Every replica's responses on every rank (the first rank of each tensor-parallel
        group sends its replica's)."""
        if self.dp_size == 1:
            return local
        sender = self.tp_rank == 0
        return merge_gathered(distributed.all_gather_object(local if sender else None,
                                                            group=self.gather_group),
                              num_prompts)

    def rollout_metrics(self) -> dict[str, float]:
        """Since the last call: this rank's generated tokens per second of generation."""
        busy, tokens = self.busy_s, self.tokens_generated
        self.busy_s, self.tokens_generated = 0.0, 0
        return {"rollout/engine_tokens_per_s": tokens / busy} if busy > 0 else {}

    # ------------------------------------------------------------------ weights

    @property
    def weights_incomplete(self) -> bool:
        return False

    def plan_weights(self, plan: list) -> None:
        """Nothing travels: the engine's weights are the actor's."""

    def start_weight_update(self) -> None:
        """The actor's weights changed in place; nothing to receive."""

    def send_weights(self, weights) -> None:
        for _ in weights:  # the lifecycle sends none (receives_weights is false)
            raise RuntimeError("rollout.backend=megatron takes no weight stream: it generates "
                               "with the actor's own weights")

    def finish_weight_update(self, version: Optional[int] = None) -> None:
        """The version is the loop's to label."""

    def abort_weight_update(self, error: BaseException, tensors_sent: int) -> None:
        """Nothing was received."""

    # ------------------------------------------------------------------ memory

    @contextlib.contextmanager
    def released(self):
        """Nothing to release: each batch's KV cache is freed when its decoding ends."""
        yield

    def abandon(self) -> None:
        """Nothing outlives the process."""

    def shutdown(self, process_ending: bool = False) -> None:
        self.__dict__.pop("model", None)


