"""The entropy bonus (verl's `entropy_coeff`): `-algorithm.entropy_coef` x the entropy aggregated as the
policy loss is (`algorithm.loss_agg_mode`, as verl aggregates it)."""

from __future__ import annotations

import torch

from megatron_rl.losses.aggregation import Normalizer, token_weights


def entropy_bonus(
    entropy: torch.Tensor, mask: torch.Tensor, coef: float, normalizer: Normalizer, loss_agg_mode: str
) -> torch.Tensor:
    """This (micro-)batch's share of `-coef * H`, H the per-token entropy aggregated over the loss tokens
    of the whole global batch with the weights of `loss_agg_mode` (`losses.aggregation`: token-mean is
    the mean entropy per loss token), so the shares of all micro-batches and ranks add up to the batch
    value. Each row holds a whole response. `entropy` [B, T] keeps its gradient (minimising the loss
    raises the entropy); outside the bool `mask` it is ignored."""
    if entropy.shape != mask.shape:
        raise ValueError(f"entropy shape {tuple(entropy.shape)} must equal mask shape {tuple(mask.shape)}")
    weights = token_weights(mask, mask.sum(dim=-1), loss_agg_mode, normalizer, entropy.dtype)
    return (torch.where(mask, entropy, 0.0) * weights).sum() * -float(coef)
