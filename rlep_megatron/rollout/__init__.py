"""vLLM rollout engine (in-process on every rank) and the train/rollout parity probe."""
from rlep_megatron.rollout.engine import Response, RolloutEngine, StaleWeightsError, request_seed

__all__ = ["Response", "RolloutEngine", "StaleWeightsError", "request_seed"]
