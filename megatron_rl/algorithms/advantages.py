"""Group-relative advantages (GRPO): each response's reward against its prompt group's statistics."""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, *, norm_std: bool = True, eps: float = 1e-6):
    """A_i = (R_i - mean_g R) / (std_g R + eps), or R_i - mean_g R when `norm_std` is False (Dr. GRPO).

    `rewards`: [N] float, N = num_groups * group_size, the responses of one prompt contiguous.
    std is the unbiased (Bessel-corrected) group standard deviation, as in verl and TRL; a group
    of one response has advantage 0. Config: `algorithm.adv_norm_std`, `algorithm.adv_eps`,
    `rollout.n_samples_per_prompt`. Returns [N] float32.
    """
    mean, scale = group_baseline(rewards, group_size, norm_std=norm_std, eps=eps)
    return (rewards.float() - mean) / scale


def group_baseline(
    rewards: torch.Tensor, group_size: int, *, norm_std: bool = True, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, scale), each [N]: the group mean of every response's group, and its std + eps (or 1
    when `norm_std` is False or the group has one response), so that A = (R - mean) / scale."""
    if rewards.dim() != 1:
        raise ValueError(f"group_advantages: rewards must be [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"group_advantages: {rewards.numel()} rewards do not split into groups of group_size={group_size}"
        )
    grouped = rewards.float().view(-1, group_size)
    mean = grouped.mean(dim=-1, keepdim=True).expand_as(grouped)
    if norm_std and group_size > 1:
        scale = (grouped.std(dim=-1, keepdim=True) + eps).expand_as(grouped)
    else:
        scale = torch.ones_like(grouped)
    return mean.reshape(-1), scale.reshape(-1)
