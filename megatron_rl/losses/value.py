"""The critic's loss, PPO's clipped value loss, and its metrics, as statistics that reduce exactly.

    loss = 0.5 * sum_t max((V_t - R_t)^2, (clip(V_t, V_old_t - c, V_old_t + c) - R_t)^2) / N_tok

over the response tokens t (`response_mask`): V the values being trained, V_old the values of the
rollout batch computed before the update, R the returns, c = `critic.cliprange_value`. As verl's
`compute_value_loss` with `loss_agg_mode = token-mean`, with one difference: `N_tok` is the response-token
count of the WHOLE global batch (the policy loss's `Normalizer.num_tokens`), so the micro-batches' losses
add up exactly to the whole batch's. `vf_clipfrac` is the fraction of tokens where the clipped term is
the larger (verl: strictly larger).

The statistics are detached float64 sums (reduce every key with SUM across micro-batches and DP ranks);
the run's metrics take verl's names: `value_update_metrics` those of one update, `vf_loss`, `vf_clipfrac`
and `vpred_mean` (the mean value being trained, over the update's response tokens), and `value_batch_metrics`
those of the rollout batch's values against its returns (`value_statistics`): `critic/vf_explained_var` =
1 - Var(R - V) / (Var(R) + 1e-5), the unbiased variances over the response tokens, `critic/values_mean` and
`critic/returns_mean`.
"""

from __future__ import annotations

import torch

from megatron_rl.losses.metrics import count, masked_sum

EXPLAINED_VARIANCE_EPS = 1e-5  # verl's, in the denominator


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped value loss of these tokens as their share of a batch of `num_tokens` response tokens
    (default: this call's), and its statistics (`vf_loss`, `vf_clipped_tokens`, `vpred_sum`, `tokens`).

    `values` (differentiable), `old_values`, `returns`: float [B, T]; `response_mask`: bool [B, T]."""
    shapes = {"old_values": old_values.shape, "returns": returns.shape, "response_mask": response_mask.shape}
    for name, shape in shapes.items():
        if shape != values.shape:
            raise ValueError(f"value_loss: {name} has shape {tuple(shape)}, values {tuple(values.shape)}")
    if not cliprange_value > 0:
        raise ValueError(f"value_loss: cliprange_value must be > 0, got {cliprange_value}")
    mask = response_mask.bool()
    tokens = float(mask.sum()) if num_tokens is None else float(num_tokens)
    clipped = torch.minimum(torch.maximum(values, old_values - cliprange_value), old_values + cliprange_value)
    unclipped_loss = (values - returns) ** 2
    clipped_loss = (clipped - returns) ** 2
    per_token = torch.maximum(unclipped_loss, clipped_loss)
    loss = 0.5 * torch.where(mask, per_token, 0.0).sum() / max(tokens, 1.0)
    stats = {
        "vf_loss": loss.detach().to(torch.float64),
        "vf_clipped_tokens": count(mask & (clipped_loss > unclipped_loss)),
        "vpred_sum": masked_sum(values, mask),
        "tokens": count(mask),
    }
    return loss, stats


def value_statistics(
    values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Sums over the response tokens from which `critic_metrics` gets the values' mean and the explained variance."""
    if values.shape != returns.shape or values.shape != response_mask.shape:
        raise ValueError(
            f"value_statistics: values {tuple(values.shape)}, returns {tuple(returns.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must have one shape"
        )
    mask = response_mask.bool()
    values, returns = values.detach().to(torch.float64), returns.detach().to(torch.float64)
    errors = returns - values
    return {
        "values_sum": masked_sum(values, mask),
        "returns_sum": masked_sum(returns, mask),
        "returns_sq_sum": masked_sum(returns**2, mask),
        "errors_sum": masked_sum(errors, mask),
        "errors_sq_sum": masked_sum(errors**2, mask),
        "tokens": count(mask),
    }


def _unbiased_variance(total: float, squares: float, n: float) -> float:
    return (squares - total * total / n) / (n - 1) if n > 1 else float("nan")


def value_update_metrics(loss_stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """One update's metrics from its reduced `value_loss` statistics (NaN without a response token)."""
    tokens = float(loss_stats["tokens"])
    return {
        "vf_loss": float(loss_stats["vf_loss"]),
        "vf_clipfrac": float(loss_stats["vf_clipped_tokens"]) / tokens if tokens else float("nan"),
        "vpred_mean": float(loss_stats["vpred_sum"]) / tokens if tokens else float("nan"),
        "tokens": tokens,
    }


def value_batch_metrics(value_stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """The rollout batch's critic metrics from its reduced `value_statistics` (NaN where there is no response
    token, or one for a variance)."""
    n = float(value_stats["tokens"])
    returns_var = _unbiased_variance(float(value_stats["returns_sum"]), float(value_stats["returns_sq_sum"]), n)
    errors_var = _unbiased_variance(float(value_stats["errors_sum"]), float(value_stats["errors_sq_sum"]), n)
    return {
        "critic/vf_explained_var": 1.0 - errors_var / (returns_var + EXPLAINED_VARIANCE_EPS),
        "critic/values_mean": float(value_stats["values_sum"]) / n if n else float("nan"),
        "critic/returns_mean": float(value_stats["returns_sum"]) / n if n else float("nan"),
    }
