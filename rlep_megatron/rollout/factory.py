"""The one place rollout engines are built, for every job (``rlep train``, ``rlep collect``,
``rlep eval``): the backend ``rollout.placement`` names behind the engine contract
(:mod:`rlep_megatron.rollout.contract`).

* ``colocated``: :class:`~rlep_megatron.rollout.colocated.engine.RolloutEngine`, vLLM in this
  process on every rank;
* ``separate``: :class:`~rlep_megatron.rollout.servers.engine.ServerEngine`, the vLLM servers of the
  job's rollout ranks (``rollout.num_ranks``, started by ``rlep`` itself:
  :func:`~rlep_megatron.rollout.servers.launch.serve_rollout_rank`) or at ``rollout.server_urls``.

Both take the prompt + response budget (``max_model_len``) and the dtype from the run config
the same way. Adding a backend: a subpackage implementing the contract, a ``placement`` value
in config.py, and its branch here.
"""
from __future__ import annotations

from typing import Optional

from rlep_megatron import distributed


def max_model_len(cfg) -> int:
    """The longest sequence an engine must hold: the prompt and response budgets."""
    return cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens


def dtype_name(cfg) -> str:
    """``model.params_dtype`` resolved (``auto``: the device's), as vLLM spells it."""
    from rlep_megatron.models.megatron import resolve_dtype

    return str(resolve_dtype(cfg.model.params_dtype)).split(".")[-1]


def build_engine(cfg, *, model_dir: Optional[str] = None, load_weights: bool = False,
                 seed: Optional[int] = None, dtype: Optional[str] = None,
                 capture_routing: bool = False, eager_for_routing: bool = False,
                 lora=None, actor=None):
    """The rollout engine of ``cfg.rollout.placement`` (collective).

    ``model_dir`` (default ``model.hf_dir``) and ``load_weights``: a colocated engine loads
    that checkpoint's weights itself; otherwise an engine starts with dummy weights and the
    first weight update fills them (the servers start so, but with ``lora``).
    ``capture_routing`` / ``eager_for_routing``: MoE routing capture (colocated only; the
    servers report ``routing_unavailable``). ``lora``: the run's LoRA section, for an engine
    that serves the policy as the base plus an adapter (``rollout.lora_sync=adapter``, training
    only). ``actor``: ``(chunks, info)`` of this rank's megatron-core model, which generates
    with ``rollout.backend=megatron`` (required there, ignored otherwise)."""
    rollout = cfg.rollout
    if rollout.backend == "megatron":
        from rlep_megatron.rollout.megatron.engine import MegatronEngine

        if actor is None:
            raise ValueError("rollout.backend=megatron generates with a megatron-core model: "
                             "build_engine needs actor=(chunks, info)")
        return MegatronEngine(actor[0], actor[1], model_dir or cfg.model.hf_dir, rollout,
                              max_model_len=max_model_len(cfg),
                              batch_size=rollout.megatron_batch_size,
                              prefill_tokens=cfg.trainer.micro_batch_max_tokens)
    seed = cfg.trainer.seed if seed is None else seed
    if rollout.placement == "separate":
        from rlep_megatron.rollout.servers.engine import ServerEngine

        urls = (list(rollout.server_urls) if rollout.server_urls
                else distributed.rollout_urls(rollout.num_ranks))
        return ServerEngine(urls, cfg.model.hf_dir, rollout, timeout_s=rollout.server_timeout_s,
                            owns_rollout_ranks=bool(rollout.num_ranks), lora=lora)
    from rlep_megatron.rollout.colocated.engine import RolloutEngine

    return RolloutEngine(model_dir or cfg.model.hf_dir, rollout,
                         dtype=dtype or dtype_name(cfg), seed=seed,
                         max_model_len=max_model_len(cfg),
                         # the adapter mode's engine keeps the base it loads itself
                         load_weights=load_weights or lora is not None,
                         capture_routing=capture_routing, eager_for_routing=eager_for_routing,
                         lora=lora)
