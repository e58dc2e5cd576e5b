"""The RLEP/GRPO math (docs/ALGORITHM.md sections 3-4): group advantages and the clipped policy loss.

Pure tensors: no torch.distributed, no Megatron. Cross-rank reductions (the global token count
used as the loss normaliser) happen in the actor, which passes the result in.
"""
from rlep_megatron.algo.advantages import group_advantages
from rlep_megatron.algo.correction import (CORRECTION_LEVELS, CORRECTION_MODES, mismatch_kl,
                                           rollout_correction_weights, rollout_loss_mask)
from rlep_megatron.algo.loss import (KL_ESTIMATORS, LOSS_AGG_MODES, entropy_bonus, kl_penalty,
                                     policy_loss)

__all__ = ["group_advantages", "policy_loss", "kl_penalty", "entropy_bonus", "LOSS_AGG_MODES",
           "KL_ESTIMATORS", "rollout_correction_weights", "rollout_loss_mask", "mismatch_kl", "CORRECTION_MODES",
           "CORRECTION_LEVELS"]
