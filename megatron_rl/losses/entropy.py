"""The entropy bonus (verl's `entropy_coeff`): `-algorithm.entropy_coef` x the mean entropy per loss token."""

from __future__ import annotations

import torch

from megatron_rl.losses.aggregation import Normalizer


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, coef: float, normalizer: Normalizer) -> torch.Tensor:
    """This (micro-)batch's share of `-coef * H_mean`, H_mean the entropy summed over the loss tokens of
    the whole global batch divided by their count (`normalizer.num_tokens`), as the entropy_mean metric
    is computed; the shares of all micro-batches and ranks add up to the batch value. `entropy` [B, T]
    keeps its gradient (minimising the loss raises the entropy); outside the bool `mask` it is ignored.
    """
    if entropy.shape != mask.shape:
        raise ValueError(f"entropy shape {tuple(entropy.shape)} must equal mask shape {tuple(mask.shape)}")
    total = torch.where(mask, entropy, 0.0).sum()
    return total * (-float(coef) / max(normalizer.num_tokens, 1.0))
