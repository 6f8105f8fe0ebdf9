"""Credit per turn for multi-turn trajectories (`algorithm.turn_credit = per_turn`).

Turn t of trajectory i has the return G_it = sum_{k >= t} gamma^(k - t) r_ik over its turns'
rewards r_ik (the environment's turn rewards, the trajectory's final reward added to its last
turn), gamma = `algorithm.turn_discount`. Its advantage is normalised among the returns of the same
turn in the group: A_it = (G_it - mean_j G_jt) / (std_j G_jt + eps), j over the group's trajectories
that reach turn t (mean-only with `algorithm.adv_norm_std = false`; 0 when only i reaches it). Each
turn is judged against the other trajectories' same turn, not against whole-episode returns: a
turn reward earned earlier does not lower the advantage of every later turn. With no turn rewards,
gamma = 1 and the same number of turns in the group, every A_it is the outcome advantage of GRPO.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def turn_returns(turn_rewards: Sequence[float], final_reward: float, discount: float) -> list[float]:
    """G_t for every turn t: the discounted sum of the turn rewards from t on, the final reward on the last turn."""
    if not turn_rewards:
        raise ValueError("turn_returns: a trajectory has at least one turn")
    rewards = [float(r) for r in turn_rewards]
    rewards[-1] += float(final_reward)
    out, acc = [0.0] * len(rewards), 0.0
    for t in range(len(rewards) - 1, -1, -1):
        acc = rewards[t] + discount * acc
        out[t] = acc
    return out


def per_turn_advantages(
    turn_rewards: Sequence[Sequence[float]],
    final_rewards: torch.Tensor,
    group_size: int,
    *,
    discount: float = 1.0,
    norm_std: bool = True,
    eps: float = 1e-6,
) -> list[torch.Tensor]:
    """The advantage of every turn, float32 [turns_i] per trajectory (the module doc's A_it).

    `final_rewards`: [N], N = len(turn_rewards), the responses of one prompt contiguous."""
    if final_rewards.dim() != 1 or final_rewards.shape[0] != len(turn_rewards):
        raise ValueError(
            f"per_turn_advantages: final_rewards has shape {tuple(final_rewards.shape)}, "
            f"expected ({len(turn_rewards)},) = one per trajectory"
        )
    returns = [turn_returns(r, float(f), discount) for r, f in zip(turn_rewards, final_rewards.tolist(), strict=True)]
    if group_size < 1 or len(returns) % group_size != 0:
        raise ValueError(
            f"per_turn_advantages: {len(returns)} trajectories do not split into groups of group_size={group_size}"
        )
    out = [torch.zeros(len(g), dtype=torch.float32) for g in returns]
    for first in range(0, len(returns), group_size):
        group = range(first, first + group_size)
        for t in range(max(len(returns[i]) for i in group)):
            members = [i for i in group if len(returns[i]) > t]
            values = torch.tensor([returns[i][t] for i in members], dtype=torch.float32)
            scale = values.std() + eps if norm_std and len(members) > 1 else torch.tensor(1.0)
            for i, a in zip(members, (values - values.mean()) / scale, strict=True):
                out[i][t] = a
    return out
