"""Rule rewards (DAPO rule, math-verify), overlong shaping and the scorer pool.

``compute_score(data_source, solution_str, ground_truth) -> {"score", "acc", "pred"}`` is the
verl-compatible entry point; ``ScorerPool`` scores batches in worker processes with a hard
per-answer timeout.
"""
from rlep_megatron.reward.pool import (RayScorerPool, ScoreRequest, ScorerPool,
                                       make_scorer_pool)
from rlep_megatron.reward.rules import (check_rewards, compute_score, known_data_sources,
                                        register_rule, rule_for, use_reward_function)
from rlep_megatron.reward.shaping import overlong_penalty

__all__ = ["compute_score", "register_rule", "known_data_sources", "rule_for",
           "use_reward_function", "check_rewards",
           "overlong_penalty", "ScorerPool", "RayScorerPool", "ScoreRequest", "make_scorer_pool"]
