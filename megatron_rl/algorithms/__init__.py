"""Algorithm pieces around the loss: group advantages, per-turn credit, dynamic sampling, overlong reward shaping."""

from megatron_rl.algorithms.advantages import group_advantages, group_baseline
from megatron_rl.algorithms.dynamic_sampling import (
    DynamicSamplingAccumulator,
    DynamicSamplingResult,
    GroupFilter,
    filter_groups,
)
from megatron_rl.algorithms.overlong import overlong_filter_mask, soft_overlong_penalty
from megatron_rl.algorithms.turn_credit import per_turn_advantages, turn_returns

__all__ = [
    "DynamicSamplingAccumulator",
    "DynamicSamplingResult",
    "GroupFilter",
    "filter_groups",
    "group_advantages",
    "group_baseline",
    "overlong_filter_mask",
    "per_turn_advantages",
    "soft_overlong_penalty",
    "turn_returns",
]
