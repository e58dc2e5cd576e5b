"""The colocated backend (``rollout.placement: colocated``): vLLM in this process on every rank
(:class:`~rlep_megatron.rollout.colocated.engine.RolloutEngine`), driven request by request by
:class:`~rlep_megatron.rollout.colocated.requests.EngineRequests`, its weights reloaded in place
by the worker extension (:mod:`~rlep_megatron.rollout.colocated.worker_ext`)."""
