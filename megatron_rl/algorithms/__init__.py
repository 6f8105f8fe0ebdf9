"""Algorithm pieces around the loss: group advantages, verl's advantage estimators, per-turn credit, dynamic
sampling, overlong reward shaping."""

from megatron_rl.algorithms.advantages import group_advantages, group_baseline
from megatron_rl.algorithms.dynamic_sampling import (
    DynamicSamplingAccumulator,
    DynamicSamplingResult,
    GroupFilter,
    GroupFilterError,
    filter_groups,
    user_filter,
)
from megatron_rl.algorithms.estimators import (
    compute_gae_advantage_return,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
    masked_whiten,
)
from megatron_rl.algorithms.overlong import overlong_filter_mask, soft_overlong_penalty
from megatron_rl.algorithms.turn_credit import per_turn_advantages, turn_returns

__all__ = [
    "DynamicSamplingAccumulator",
    "DynamicSamplingResult",
    "GroupFilter",
    "GroupFilterError",
    "compute_gae_advantage_return",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "filter_groups",
    "group_advantages",
    "group_baseline",
    "masked_whiten",
    "overlong_filter_mask",
    "per_turn_advantages",
    "soft_overlong_penalty",
    "turn_returns",
    "user_filter",
]
