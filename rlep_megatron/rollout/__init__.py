"""vLLM rollout engine (in-process on every rank) and the train/rollout parity probe."""
from rlep_megatron.rollout.engine import (IncompleteWeightsError, Response, RolloutEngine,
                                          request_seed)

__all__ = ["IncompleteWeightsError", "Response", "RolloutEngine", "request_seed"]
