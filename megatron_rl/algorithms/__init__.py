"""Algorithm pieces around the loss: group advantages, dynamic sampling, overlong reward shaping."""

from megatron_rl.algorithms.advantages import broadcast_to_tokens, group_advantages
from megatron_rl.algorithms.dynamic_sampling import (
    DynamicSamplingAccumulator,
    DynamicSamplingResult,
    GroupFilter,
    filter_groups,
)
from megatron_rl.algorithms.overlong import overlong_filter_mask, soft_overlong_penalty

__all__ = [
    "DynamicSamplingAccumulator",
    "DynamicSamplingResult",
    "GroupFilter",
    "broadcast_to_tokens",
    "filter_groups",
    "group_advantages",
    "overlong_filter_mask",
    "soft_overlong_penalty",
]
