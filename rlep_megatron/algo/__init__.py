"""The RLEP/GRPO math (docs/ALGORITHM.md sections 3-4): advantage estimators and policy losses,
each a plug-in chosen by name (``algo.advantage``, ``algo.loss``).

Pure tensors: no torch.distributed, no Megatron. Cross-rank reductions (the global token count
used as the loss normaliser) happen in the actor, which passes the result in.
"""
from rlep_megatron.algo.advantages import (ADVANTAGE_ESTIMATORS, AdvantageEstimator,
                                           estimator_from_config, group_advantages,
                                           register_advantage)
from rlep_megatron.algo.correction import (CORRECTION_LEVELS, CORRECTION_MODES, mismatch_kl,
                                           rollout_correction_weights, rollout_loss_mask)
from rlep_megatron.algo.loss import (KL_ESTIMATORS, KL_PENALTIES, LOSS_AGG_MODES, LOSSES,
                                     LossBatch, Normaliser, Penalties, PolicyLoss, aggregate,
                                     build_loss, entropy_bonus, kl_penalty, loss_from_config,
                                     policy_loss, register_loss)
from rlep_megatron.algo import surrogates  # registers the losses  # noqa: E402,F401

__all__ = ["group_advantages", "policy_loss", "kl_penalty", "entropy_bonus", "LOSS_AGG_MODES",
           "KL_ESTIMATORS", "KL_PENALTIES", "rollout_correction_weights", "rollout_loss_mask",
           "mismatch_kl", "CORRECTION_MODES", "CORRECTION_LEVELS", "LOSSES", "LossBatch",
           "Normaliser", "Penalties", "PolicyLoss", "aggregate", "build_loss",
           "loss_from_config", "register_loss", "ADVANTAGE_ESTIMATORS", "AdvantageEstimator",
           "estimator_from_config", "register_advantage"]
