"""The SFT loss: mean negative log-likelihood of the response tokens of the whole global batch."""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_rl.losses import Normalizer
from megatron_rl.losses.metrics import count


def cross_entropy_loss(
    logprobs: Tensor, fields: dict[str, Tensor], mask: Tensor, normalizer: Normalizer
) -> tuple[Tensor, dict[str, Tensor]]:
    """A `TokenLoss` (see `megatron_rl.actor.train_step`): sum of -log p over the masked tokens of
    this micro-batch divided by the response tokens of the whole global batch (token-mean), so the
    micro-batch and rank shares add up to the batch mean. Metrics: `loss` (sums to that mean), `tokens`.
    """
    nll = torch.where(mask, -logprobs, 0.0).sum() / max(normalizer.num_tokens, 1.0)
    return nll, {"loss": nll.detach().to(torch.float64), "tokens": count(mask)}
