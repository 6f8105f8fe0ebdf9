"""Detached importance weights for the rollout/trainer mismatch: w = pi_old / pi_rollout (TIS / masked IS).

`pi_old` is the trainer's probability of the sampled token under the policy that generated it
(recomputed by the actor), `pi_rollout` the engine's. Modes (`algorithm.is_correction`):
- truncate: w = min(w, C), C = `is_threshold` (TIS);
- mask: w = w where C_min <= w <= C_max (`is_mask_min`, `is_mask_max`), else 0: the token (or the
  whole sequence at sequence level) is dropped from the loss. Dropped tokens still count in the
  aggregation's normaliser (they are weight-0 tokens), which keeps micro-batch splits exact; a
  trainer that wants them out of the denominator removes `dropped` from the response mask before
  building the normaliser.
Level (`is_level`): token, or sequence with w_i = exp(mean_t log w_t) (geometric mean) for every
token of row i. Log-weights are clamped to +-`max_log_ratio` before exp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.losses.ratios import sequence_log_ratio
from megatron_rl.losses.spec import IS_LEVELS, IS_MODES


@dataclass
class ImportanceWeights:
    """log_token: clamped per-token log(pi_old / pi_rollout) (0 outside the mask), [B, T].
    raw: pi_old / pi_rollout at `is_level`, before truncation or masking (1 outside the mask), [B, T].
    weight: what multiplies each token's loss, [B, T] (detached; all ones when mode is none).
    truncated: tokens whose weight was capped at C; dropped: tokens masked out (bool [B, T]).
    """

    log_token: torch.Tensor
    raw: torch.Tensor
    weight: torch.Tensor
    truncated: torch.Tensor
    dropped: torch.Tensor


def importance_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    lengths: torch.Tensor,
    *,
    mode: str,
    level: str,
    threshold: float,
    mask_min: float,
    mask_max: float,
    max_log_ratio: float,
) -> ImportanceWeights:
    """The detached weights of every token (see the module docstring).

    `mask`: the bool response mask [B, T]; `lengths`: its row sums [B].
    """
    with torch.no_grad():
        log_w = torch.where(mask, old_log_probs - rollout_log_probs, 0.0)
        log_token = log_w.clamp(-max_log_ratio, max_log_ratio)
        if level == "sequence":
            log_w = torch.where(mask, sequence_log_ratio(log_token, lengths).unsqueeze(-1), 0.0)
        elif level == "token":
            log_w = log_token
        else:
            raise ValueError(f"algorithm.is_level = {level!r} is not known; allowed: {list(IS_LEVELS)}")
        raw = log_w.exp()
        none = torch.zeros_like(mask)
        if mode == "none":
            return ImportanceWeights(
                log_token=log_token, raw=raw, weight=raw.new_ones(()).expand_as(raw), truncated=none, dropped=none
            )
        if mode == "truncate":
            return ImportanceWeights(
                log_token=log_token,
                raw=raw,
                weight=raw.clamp(max=threshold),
                truncated=mask & (raw > threshold),
                dropped=none,
            )
        if mode == "mask":
            keep = (raw >= mask_min) & (raw <= mask_max)
            return ImportanceWeights(
                log_token=log_token, raw=raw, weight=torch.where(keep, raw, 0.0), truncated=none, dropped=mask & ~keep
            )
    raise ValueError(f"algorithm.is_correction = {mode!r} is not known; allowed: {list(IS_MODES)}")
