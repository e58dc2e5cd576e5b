"""The learning side: turns scored groups into updates of the actor.

Owns the Megatron actor (model chunks, distributed optimizer, reference policy with a KL term,
routing replay of a mixture-of-experts model), and per training step runs, in order:

    advantage    per group over G' (mean / unbiased std + eps)
    old_logprob  the actor's log-probs of every response before the update (the reference's
                 too); engine/actor gap, rollout-correction weights, replay NLL
    train        one epoch of mini-batch updates

and holds the weight stream (:attr:`LearningSide.streamer`) that the loop delivers into the
rollout engine. It never holds the engine: the loop hands it what it needs (the pad id, whether
the engine gives routing) and runs the update while the engine has released the devices.

With ``optim.offload_during_rollout`` (GPU) gradient buffers and optimizer state live off the
GPU except while the engine sleeps for :meth:`LearningSide.update` or a checkpoint.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Optional

import torch

from rlep_megatron import distributed, platform
from rlep_megatron.actor.old_logprob import (mini_batch_plan, old_logprob_pass, train_batch,
                                             training_rows)

if TYPE_CHECKING:  # the rollout side's batch (rollout imports actor, not the other way)
    from rlep_megatron.data.batch import StepBatch

logger = logging.getLogger(__name__)


def _mean(values) -> float:
    values = list(values)
    return float(sum(values) / len(values)) if values else 0.0


class LearningSide:
    """The actor and its optimizer; built before the rollout engine (whose memory, with
    offload, is sized while the train state is off the GPU), told about it by
    :meth:`connect`."""

    def __init__(self, cfg, hf_config: dict):
        from rlep_megatron.actor.model import build_from_hf
        from rlep_megatron.actor.optimizer import build_optimizer, wrap_ddp
        from rlep_megatron.checkpoint.dist import load_mcore_weights
        from rlep_megatron.models import layout_limits, num_experts
        from rlep_megatron.models.megatron import build_model, resolve_dtype

        self.cfg, hf = cfg, hf_config
        # LoRA: the adapter section checked against the model (and an adapter to start from
        # read) before anything is built
        from rlep_megatron.lora.preflight import check as check_lora

        lora_start = check_lora(cfg.lora, hf)
        if cfg.model.mcore_dir:
            from rlep_megatron.checkpoint.dist import refuse_adapter_checkpoint

            refuse_adapter_checkpoint(cfg.model.mcore_dir, "model.mcore_dir")
        self.ctx = distributed.init_model_parallel(
            cfg.parallel, seed=cfg.trainer.seed, **layout_limits(hf))
        dtype = resolve_dtype(cfg.model.params_dtype)
        moe_options = {"moe_aux_loss_coeff": cfg.algo.moe_aux_loss_coeff,
                      "moe_z_loss_coeff": cfg.algo.moe_z_loss_coeff,
                      "moe_experts": cfg.model.moe_experts}
        spec = cfg.actor_transformer_engine  # (the local spec with LoRA)
        if cfg.model.mcore_dir:
            self.chunks, self.info = build_model(hf, dtype, cfg.model.recompute_activations,
                                                 transformer_engine=spec, **moe_options)
            load_mcore_weights(self.chunks, cfg.model.mcore_dir, hf_config=hf)
        else:
            self.chunks, self.info = build_from_hf(cfg.model.hf_dir, cfg.model.params_dtype,
                                                   cfg.model.recompute_activations, spec,
                                                   **moe_options)
        self.info = dataclasses.replace(self.info,
                                        logprob_chunk_tokens=cfg.model.logprob_chunk_tokens)
        # the KL term's reference: the initial weights, copied before any update or resume
        # (with LoRA the initial adapters alone, the base being frozen)
        self.reference = None
        if cfg.algo.kl_coef > 0 and not cfg.lora.enabled:
            from rlep_megatron.actor.reference import ReferencePolicy

            self.reference = ReferencePolicy(self.chunks, self.info,
                                             offload=cfg.algo.reference_offload)
        optim = self._attach_lora(lora_start) if cfg.lora.enabled else cfg.optim
        self.chunks = wrap_ddp(self.chunks, cfg.optim.use_distributed_optimizer,
                               overlap_grad_reduce=cfg.optim.overlap_grad_reduce,
                               overlap_param_gather=cfg.optim.overlap_param_gather,
                               grad_reduce_in_fp32=cfg.optim.grad_reduce_dtype == "float32")
        self.optimizer = build_optimizer(self.chunks, optim, self.info.params_dtype)
        self.optimizer.total_steps = cfg.trainer.total_steps  # where a decay of length 0 ends
        # a mixture-of-experts actor records its old-log-prob pass's routing (compared with
        # the engine's for rollout/routing_mismatch_frac); algo.routing_replay=actor replays it
        # in the updates, =rollout the engine's
        self.moe = bool(num_experts(self.info.hf_config))
        if cfg.algo.routing_replay != "off" and not self.moe:
            raise ValueError(f"algo.routing_replay={cfg.algo.routing_replay} needs a "
                             "mixture-of-experts model; this one is dense: use off")
        self.routing_replay = None
        # the engine's routing tables reach only the ranks that train them (old_logprob.py)
        self.share_of_rank: Optional[list[int]] = None
        if self.moe:
            from rlep_megatron.actor.routing import RoutingReplay

            self.routing_replay = RoutingReplay(self.chunks)
        # separate placement: no engine shares the actor's GPUs, nothing to make room for
        self.offload_train_state = (cfg.optim.offload_during_rollout
                                    and platform.cuda_available()
                                    and cfg.rollout.placement != "separate")
        if self.offload_train_state and self.info.params_dtype != torch.bfloat16:
            raise ValueError("optim.offload_during_rollout needs model.params_dtype=bfloat16 "
                             "(auto on GPU): with float32 parameters megatron's optimizer "
                             "works on the model's own weights, which must stay on the GPU")
        self._train_state_offloaded = False
        from rlep_megatron.weight_sync import WeightStreamer

        # the weights as the rollout engine takes them (the loop delivers them)
        if cfg.syncs_adapters:
            from rlep_megatron.weight_sync.adapters import AdapterStreamer

            self.streamer = AdapterStreamer(self.chunks)  # the adapter alone
        else:
            self.streamer = WeightStreamer(self.chunks, self.info,
                                           cfg.rollout.weight_sync_bucket_bytes)
        self.pad_id = 0
        self.engine_routing = False
        # with offload the engine is built while the gradient buffers and optimizer state are
        # off the GPU: vLLM refuses to start when less than rollout.gpu_memory_utilization of
        # the GPU is free, so that fraction can then include the memory the update holds only
        # while the engine sleeps (vLLM does not grow its cache by itself: raise the setting)
        self.offload_train_state_now()

    def _attach_lora(self, lora_start):
        """The adapters on the built chunks (``lora_start``: an adapter to start from), the
        KL term's reference on them, and the optimizer settings of the adapters."""
        from rlep_megatron.lora import adapters, peft_io

        cfg = self.cfg
        adapters.attach(self.chunks, self.info, cfg.lora, cfg.trainer.seed)
        if lora_start is not None:
            peft_io.assign(self.chunks, lora_start)
        if cfg.algo.kl_coef > 0:
            from rlep_megatron.actor.reference import InitialAdapters

            self.reference = InitialAdapters(self.chunks, self.info)
        if cfg.lora.lr is None:
            return cfg.optim
        return dataclasses.replace(cfg.optim, lr=cfg.lora.lr,
                                   min_lr=min(cfg.optim.min_lr, cfg.lora.lr))

    def connect(self, pad_id: int, routing_unavailable: Optional[str],
                engine_routing: bool) -> None:
        """What the learner needs of the rollout engine, as values: ``pad_id`` pads training
        rows; ``routing_unavailable``: why the engine cannot give MoE routing (``None``: it
        can); ``engine_routing``: whether it captures it."""
        cfg = self.cfg
        if routing_unavailable is not None:
            if cfg.algo.routing_replay == "rollout":
                raise ValueError("algo.routing_replay=rollout needs the engine's routing, which "
                                 f"this engine cannot give: {routing_unavailable}; "
                                 "use actor (replays the old-log-prob pass's routing) or off")
            logger.warning("rollout/routing_mismatch_frac is not measured: %s",
                           routing_unavailable)
        self.pad_id, self.engine_routing = pad_id, engine_routing

    # ------------------------------------------------------------------ phases

    def advantage(self, batch: StepBatch) -> None:
        from rlep_megatron.algo import estimator_from_config

        rewards = torch.tensor([s.reward for s in batch.sequences], dtype=torch.float64)
        groups = [s.group for s in batch.sequences]
        values = estimator_from_config(self.cfg.algo)(rewards, groups)
        for seq, value in zip(batch.sequences, values.tolist()):
            seq.advantage = value

    def update(self, batch: StepBatch, timer, version: int) -> tuple[dict, dict]:
        """Old log-probs, then one epoch of mini-batch updates; returns the train metrics and
        the old-log-prob metrics. ``version``: the policy version being trained (the step).
        The loop runs it while a colocated engine has released the devices."""
        plan = mini_batch_plan(len(batch.sequences), self.cfg)
        self.restore_train_state()
        with timer.phase("old_logprob"):
            train_batches, old_metrics = self.old_logprob(batch, plan, version)
        with timer.phase("train"):
            train = self.train(train_batches, version)
        self.offload_train_state_now()
        return train, old_metrics

    def response_logprob_sums(self, prompts: list[list[int]], responses: list[list[int]]
                              ) -> list[tuple[float, int]]:
        """Per (prompt, response) pair: the sum of the actor's log-probs of the response's
        tokens (at the rollout temperature, the EOS included) and their count, on every rank:
        what ``replay.policy=unlikely`` ranks pool answers by. A collective: every rank passes
        the same pairs; each data-parallel replica scores every DP-th pair (a replica with
        none runs one row all the same: it takes part in the forward's collectives), then
        every rank holds all the results, so that the replicas choose from the same numbers."""
        from megatron.core import parallel_state as ps

        from rlep_megatron.actor.forward import actor_logprobs

        dp, dp_rank = self.ctx.data_parallel_size, self.ctx.data_parallel_rank
        mine = list(range(dp_rank, len(prompts), dp))
        rows = mine or [0]
        ids, mask = training_rows([prompts[i] for i in rows], [responses[i] for i in rows],
                                  self.pad_id)
        lengths = torch.tensor([len(prompts[i]) + len(responses[i]) for i in rows])
        budget = self.cfg.trainer.micro_batch_max_tokens
        logp = actor_logprobs(self.chunks, self.info, ids, max(1, budget // ids.shape[1]),
                              self.cfg.rollout.temperature, everywhere=True, lengths=lengths,
                              pack_max_tokens=budget if self.cfg.trainer.sequence_packing
                              else None)
        sums = (logp.double() * mask.double()).sum(dim=1).tolist()
        counts = mask.sum(dim=1).tolist()
        local = [(i, float(sums[j]), int(counts[j])) for j, i in enumerate(mine)]
        out: list = [None] * len(prompts)
        for share in (distributed.all_gather_object(local, group=ps.get_data_parallel_group())
                      if dp > 1 else [local]):
            for i, total, count in share:
                out[i] = (total, count)
        return out

    def old_logprob(self, batch: StepBatch, plan: list[list[int]], version: int):
        """Old (and reference) log-probs of every mini-batch, and the step's metrics of the
        engine/actor gap, the rollout correction and how off-policy replays are."""
        from megatron.core import parallel_state as ps

        from rlep_megatron.actor.expert_load import ExpertLoad

        # a mixture-of-experts actor: how evenly the old-log-prob pass routes the step's tokens
        with ExpertLoad(self.chunks) as load:
            parts = [train_batch(self.cfg.algo, seqs, placeholder, tensors,
                                 [len(batch.prompts[s.group]) for s in seqs], version,
                                 self.cfg.replay.correction)
                     for seqs, placeholder, tensors in old_logprob_pass(self, batch, plan, load)]
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
        return [p[0] for p in parts], self._old_metrics(sums, maxima, load)

    def _old_metrics(self, sums: dict, maxima: dict, load) -> dict[str, float]:
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
            **load.metrics(engine_routing=self.engine_routing),
        }
        # the gap by where the behaviour log-prob comes from: the version being trained, an
        # older one (one-step-off rollout), the policy that wrote a replayed answer
        for part in ("current", "carried", "replay"):
            tokens = sums[f"parity_{part}_tokens"]
            metrics[f"rollout/logprob_abs_diff/{part}"] = (
                sums[f"parity_{part}"] / tokens if tokens > 0 else 0.0)
        if self.cfg.algo.rollout_correction != "off":
            metrics.update({
                "rollout/correction_weight_mean": sums["correction_weight"] / rollout_tokens,
                "rollout/correction_weight_max": maxima["correction_weight_max"],
                "rollout/correction_weight_min": -maxima["correction_weight_neg_min"],
                "rollout/correction_token_frac": sums["correction_tokens"] / rollout_tokens,
                "rollout/correction_seq_frac": (sums["correction_seqs"]
                                                / max(sums["rollout_seqs"], 1.0))})
        if "replay_correction_tokens" in sums:
            metrics["replay/correction_token_frac"] = (
                sums["replay_correction_tokens"] / max(sums["parity_replay_tokens"], 1.0))
        if self.reference is not None:
            metrics["train/ref_logp_abs_diff_max"] = maxima["ref_logp_abs_diff"]
        return metrics

    def train(self, train_batches, version: int) -> dict[str, float]:
        from rlep_megatron.actor.train_step import train_mini_batch

        self.optimizer.training_step = version  # the lr schedule counts training steps
        cfg = self.cfg
        results = [train_mini_batch(self.chunks, self.optimizer, self.info, tb, cfg.algo,
                                    cfg.trainer.micro_batch_max_tokens,
                                    temperature=cfg.rollout.temperature,
                                    replay_clip_high=cfg.replay.clip_ratio_high,
                                    sequence_packing=cfg.trainer.sequence_packing,
                                    routing_replay=self.routing_replay,
                                    constant_length_tokens=cfg.rollout.max_response_tokens)
                   for tb in train_batches]
        # the weight sync and checkpoints read the weights outside a forward pass
        self.optimizer.gather_params(self.chunks)
        out = {}
        for key in results[0]:
            out[key] = _mean(r[key] for r in results if key in r)
        out["num_optimizer_steps"] = float(len(results))
        return out

    # ------------------------------------------------------------------ memory

    def offload_train_state_now(self) -> None:
        """``optim.offload_during_rollout``: gradient buffers and optimizer state leave the
        GPU until :meth:`restore_train_state`."""
        if self.offload_train_state and not self._train_state_offloaded:
            from rlep_megatron.models.grouped_experts import release_scratch

            self.optimizer.offload(self.chunks)
            release_scratch()
            self._train_state_offloaded = True

    def restore_train_state(self) -> None:
        if self._train_state_offloaded:
            self.optimizer.restore(self.chunks)
            self._train_state_offloaded = False

    @property
    def train_state_offloaded(self) -> bool:
        return self._train_state_offloaded

    def with_train_state(self, action):
        """``action()`` (a checkpoint save or load) with the train state on the device, offloaded
        again after (the loop runs it while a colocated engine has released the devices)."""
        if not self._train_state_offloaded:
            return action()
        self.restore_train_state()
        result = action()
        self.offload_train_state_now()
        return result
