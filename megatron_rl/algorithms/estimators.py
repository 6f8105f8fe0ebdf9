"""verl's advantage estimators (`algorithm.advantage_estimator`), as plain torch functions with verl
0.9.1's names, arguments and semantics (`verl/trainer/ppo/core_algos.py`), so that a user can check them
against verl's own.

Every function takes right-padded [bs, response_length] tensors: `token_level_rewards` (an outcome
reward sits on the last token of its response), `response_mask` (1 = a token the loss sees; 0 = padding,
or a tool/observation token of a multi-turn response), and returns (advantages, returns), each
[bs, response_length]. `index` groups the responses of one prompt (verl's `uid`): any sequence of
hashable group keys, or an integer tensor. The statistics are over the whole batch passed in: the
batch-whitened estimators (GAE, REINFORCE++, REINFORCE++-baseline) must see the whole step.

`masked_whiten` follows verl's `verl_F.masked_whiten` with its defaults: the mean over the mask divides
by (mask count + 1e-8); the variance is the unbiased one (Bessel: x count / (count - 1)); the result is
(x - mean) * rsqrt(var + 1e-8); `shift_mean=True` (zero-mean output; verl's only caller that passes
False is not one of these estimators). Positions outside the mask are whitened too (not zeroed), as in
verl; the estimators that zero them say so.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

_TINY = 1e-8  # verl's masked_mean denominator guard and masked_whiten's variance epsilon


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8), the mean and the unbiased variance taken over `mask`
    (verl's `masked_whiten`, see the module doc); `shift_mean=False` adds the mean back."""
    if values.shape != mask.shape:
        raise ValueError(f"masked_whiten: values {tuple(values.shape)} and mask {tuple(mask.shape)} differ in shape")
    keep = mask.bool()
    count = keep.sum()
    if int(count) < 2:
        raise ValueError(f"masked_whiten: the mask holds {int(count)} token(s); an unbiased variance needs at least 2")
    kept = torch.where(keep, values, 0.0)
    mean = kept.sum() / (count + _TINY)
    centered = torch.where(keep, values - mean, 0.0)
    var = (centered.square().sum() / (count + _TINY)) * (count / (count - 1))
    whitened = (values - mean) * torch.rsqrt(var + _TINY)
    return whitened + mean if not shift_mean else whitened


def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2015), verl's `compute_gae_advantage_return`.

    Backwards over the tokens: delta_t = r_t + gamma * V_next - V_t, A_t = delta_t + gamma * lam * A_next,
    where "next" is the next token inside `response_mask`: a masked token (observation, padding) neither
    takes a value nor a TD error; it carries the running A and V_next through unchanged (so its A is the
    following trained token's). returns = A + values (before whitening); advantages = `masked_whiten(A,
    response_mask)` over the whole batch (masked positions whitened too, not zeroed, as in verl).
    """
    _check_same_shape(
        "compute_gae_advantage_return",
        token_level_rewards=token_level_rewards,
        values=values,
        response_mask=response_mask,
    )
    keep = response_mask.bool()
    rewards, values_f = token_level_rewards.float(), values.float()
    running = torch.zeros(rewards.shape[0], dtype=torch.float32, device=rewards.device)
    next_value = torch.zeros_like(running)
    advantages = torch.zeros_like(rewards)
    for t in range(rewards.shape[-1] - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_value - values_f[:, t]
        running = torch.where(keep[:, t], delta + gamma * lam * running, running)
        next_value = torch.where(keep[:, t], values_f[:, t], next_value)
        advantages[:, t] = running
    returns = advantages + values_f
    return masked_whiten(advantages, response_mask), returns


def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence[Hashable] | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024), verl's `compute_rloo_outcome_advantage`.

    R_i = the response's summed token rewards; in a group of n > 1 responses, A_i = R_i - mean_{j != i} R_j
    = n / (n - 1) * (R_i - mean_g R); a group of one keeps A_i = R_i (verl's choice: its baseline is 0).
    Returns (A_i on every masked token, 0 elsewhere) twice. verl's unused `epsilon` is left out.
    """
    _check_same_shape(
        "compute_rloo_outcome_advantage", token_level_rewards=token_level_rewards, response_mask=response_mask
    )
    scores = token_level_rewards.float().sum(dim=-1)
    mean, count = _group_mean(scores, index, "compute_rloo_outcome_advantage")
    scale = torch.where(count > 1, count / (count - 1).clamp(min=1), 1.0)
    scores = torch.where(count > 1, (scores - mean) * scale, scores)
    advantages = scores.unsqueeze(-1) * response_mask
    return advantages, advantages


def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025), verl's `compute_reinforce_plus_plus_outcome_advantage` (`gamma` is verl's
    `config.gamma`, `algorithm.gamma` here).

    Backwards over the tokens, G_t = r_t + gamma * G_next over the masked tokens only: a masked token
    (observation, padding) gets return 0 and passes the running return through undiscounted (verl 0.9.1;
    0.7 reset it instead). advantages = `masked_whiten(G, response_mask)` over the whole batch, then
    zeroed outside the mask. Returns (advantages, G).
    """
    _check_same_shape(
        "compute_reinforce_plus_plus_outcome_advantage",
        token_level_rewards=token_level_rewards,
        response_mask=response_mask,
    )
    keep = response_mask.bool()
    rewards = token_level_rewards.float()
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=torch.float32, device=rewards.device)
    for t in range(rewards.shape[-1] - 1, -1, -1):
        candidate = rewards[:, t] + gamma * running
        returns[:, t] = torch.where(keep[:, t], candidate, 0.0)
        running = torch.where(keep[:, t], candidate, running)
    return masked_whiten(returns, response_mask) * response_mask, returns


def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence[Hashable] | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with the group-mean baseline, verl's `compute_reinforce_plus_plus_baseline_outcome_advantage`.

    R_i = the response's summed token rewards; a_i = R_i - mean_g R (a group of one: a_i = R_i), put on
    every masked token, then `masked_whiten` over the whole batch's masked tokens (so a response weighs
    by its token count in the batch statistics) and zeroed outside the mask. Returns them twice.
    verl's unused `epsilon` is left out.
    """
    name = "compute_reinforce_plus_plus_baseline_outcome_advantage"
    _check_same_shape(name, token_level_rewards=token_level_rewards, response_mask=response_mask)
    scores = token_level_rewards.float().sum(dim=-1)
    mean, count = _group_mean(scores, index, name)
    centered = torch.where(count > 1, scores - mean, scores)
    spread = centered.unsqueeze(-1) * response_mask
    advantages = masked_whiten(spread, response_mask) * response_mask
    return advantages, advantages


def _group_mean(
    scores: torch.Tensor, index: Sequence[Hashable] | torch.Tensor, caller: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the mean of each response's group, its group's size), each [bs] float32."""
    keys = index.tolist() if isinstance(index, torch.Tensor) else list(index)
    if len(keys) != scores.shape[0]:
        raise ValueError(f"{caller}: index has {len(keys)} entries for {scores.shape[0]} responses")
    ids: dict[Hashable, int] = {}
    group = torch.tensor([ids.setdefault(k, len(ids)) for k in keys], dtype=torch.long, device=scores.device)
    sums = torch.zeros(len(ids), dtype=torch.float32, device=scores.device).index_add_(0, group, scores)
    counts = torch.zeros(len(ids), dtype=torch.float32, device=scores.device).index_add_(
        0, group, torch.ones_like(scores)
    )
    return (sums / counts)[group], counts[group]


def _check_same_shape(caller: str, **tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    first = next(iter(shapes.values()))
    if len(first) != 2 or any(s != first for s in shapes.values()):
        described = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ValueError(f"{caller}: expected [bs, response_length] tensors of one shape, got {described}")
