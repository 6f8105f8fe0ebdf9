"""Credit per turn for multi-turn trajectories (`algorithm.turn_credit = per_turn`).

Turn t of trajectory i has the return G_it = sum_{k >= t} gamma^(k - t) r_ik over its turns'
rewards r_ik (the environment's turn rewards, the trajectory's final reward added to its last
turn), gamma = `algorithm.turn_discount`. Its advantage is normalised by the statistics of the
group's trajectory returns G_i0: A_it = (G_it - mean_g G_0) / (std_g G_0 + eps) (mean-only with
`algorithm.adv_norm_std = false`). With no turn rewards and gamma = 1 every G_it is the final
reward, so A_it is the outcome advantage of GRPO on every turn.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_rl.algorithms.advantages import group_baseline


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
    mean, scale = group_baseline(
        torch.tensor([g[0] for g in returns], dtype=torch.float32), group_size, norm_std=norm_std, eps=eps
    )
    return [(torch.tensor(g, dtype=torch.float32) - m) / s for g, m, s in zip(returns, mean, scale, strict=True)]
