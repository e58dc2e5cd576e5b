"""The rollout side: the engine contract (:mod:`.contract`) and its backends, vLLM in this
process (:mod:`.colocated`) and vLLM servers (:mod:`.servers`), built by :mod:`.factory`; the
schedulers, replays mixed into groups, and the train/rollout parity probe."""
from rlep_megatron.rollout.colocated.engine import RolloutEngine
from rlep_megatron.rollout.contract import IncompleteWeightsError
from rlep_megatron.rollout.requests import request_seed
from rlep_megatron.rollout.response import Response

__all__ = ["IncompleteWeightsError", "Response", "RolloutEngine", "request_seed"]
