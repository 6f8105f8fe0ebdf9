"""Loss aggregation with a global normaliser, so that splitting a batch never changes the gradient.

Every mode is a weighted sum of per-token losses, `L = sum_{i,t} W_it * l_it`, with a constant
(non-differentiable) weight per token:

| mode                     | W_it for a response token of sequence i |
|--------------------------|------------------------------------------|
| token-mean               | 1 / N_tok                                |
| seq-mean-token-mean      | 1 / (N_seq * |y_i|)                      |
| seq-mean-token-sum       | 1 / N_seq                                |
| seq-mean-token-sum-norm  | 1 / (N_seq * L_norm)                     |

`N_tok` and `N_seq` are the response-token and sequence counts of the WHOLE global batch (all DP
ranks, all gradient-accumulation micro-batches), `|y_i|` the response length of sequence i, and
`L_norm` a constant token count (Dr. GRPO: the generation budget, i.e. `rollout.max_new_tokens`).
A row without any response token (e.g. masked by overlong filtering) is not a sequence: it has
weight 0 and is not counted in `N_seq`. Because W depends only on the row itself and on these
global constants, the loss of a micro-batch is exactly its share of the whole-batch loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_rl.losses.spec import AGGREGATION_MODES


@dataclass(frozen=True)
class Normalizer:
    """Global constants of the aggregation (see the module docstring).

    num_tokens: response tokens in the whole global batch (N_tok).
    num_sequences: rows with at least one response token in the whole global batch (N_seq).
    token_norm: L_norm of `seq-mean-token-sum-norm`, a constant token count (Dr. GRPO uses the
        generation budget, `rollout.max_new_tokens`).
    """

    num_tokens: float
    num_sequences: float
    token_norm: float

    def __post_init__(self) -> None:
        for name in ("num_tokens", "num_sequences", "token_norm"):
            if not float(getattr(self, name)) >= 0:
                raise ValueError(f"Normalizer.{name} must be >= 0, got {getattr(self, name)}")


def global_normalizer(
    response_mask: torch.Tensor | Sequence[torch.Tensor], *, token_norm: float | None = None
) -> Normalizer:
    """The normaliser of a whole global batch from its response mask(s).

    `response_mask`: the [B, T] mask of the whole batch, or a sequence of [b_k, T_k] masks that
    together form it (micro-batches of different padded widths, or every DP rank's share).
    `token_norm`: L_norm of `seq-mean-token-sum-norm`; pass `rollout.max_new_tokens` (Dr. GRPO's
    constant). When None, the largest padded width T of the given masks is used, which is only a
    constant if the trainer pads every step to the same width.
    """
    masks = [response_mask] if isinstance(response_mask, torch.Tensor) else list(response_mask)
    if not masks:
        raise ValueError("global_normalizer: response_mask is an empty sequence of masks")
    for k, mask in enumerate(masks):
        if mask.dim() != 2:
            raise ValueError(f"global_normalizer: response_mask[{k}] must be [B, T], got shape {tuple(mask.shape)}")
    lengths = torch.cat([mask.bool().sum(dim=-1).cpu() for mask in masks])
    norm = max(mask.shape[-1] for mask in masks) if token_norm is None else token_norm
    return normalizer_from_lengths(lengths, token_norm=norm)


def normalizer_from_lengths(lengths: torch.Tensor, *, token_norm: float) -> Normalizer:
    """The normaliser of a global batch whose rows have `lengths` [B] response tokens."""
    if not float(token_norm) > 0:
        raise ValueError(f"global_normalizer: token_norm must be > 0, got {token_norm}")
    return Normalizer(
        num_tokens=float(lengths.sum()), num_sequences=float((lengths > 0).sum()), token_norm=float(token_norm)
    )


def token_weights(
    mask: torch.Tensor, lengths: torch.Tensor, mode: str, normalizer: Normalizer, dtype: torch.dtype
) -> torch.Tensor:
    """The constant weight W_it of every token, [B, T] of `dtype`, 0 outside the bool `mask` (row sums `lengths`)."""
    if mode == "token-mean":
        scale = torch.tensor(1.0 / max(normalizer.num_tokens, 1.0), dtype=dtype, device=mask.device)
        return torch.where(mask, scale, 0.0)
    num_seq = max(normalizer.num_sequences, 1.0)
    if mode == "seq-mean-token-mean":
        scale = 1.0 / (lengths.clamp_min(1).to(dtype) * num_seq)
        return torch.where(mask, scale.unsqueeze(-1), 0.0)
    if mode == "seq-mean-token-sum":
        scale = torch.tensor(1.0 / num_seq, dtype=dtype, device=mask.device)
        return torch.where(mask, scale, 0.0)
    if mode == "seq-mean-token-sum-norm":
        scale = torch.tensor(1.0 / (num_seq * normalizer.token_norm), dtype=dtype, device=mask.device)
        return torch.where(mask, scale, 0.0)
    raise ValueError(f"algorithm.loss_agg_mode = {mode!r} is not known; allowed: {list(AGGREGATION_MODES)}")
