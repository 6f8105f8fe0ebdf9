"""Detached importance weights for the rollout/trainer mismatch: w = pi_old / pi_rollout (TIS / MIS).

`pi_old` is the trainer's probability of the sampled token under the policy that generated it
(recomputed by the actor), `pi_rollout` the engine's. Modes (`algorithm.is_correction`):
- truncate: w = min(w, C), C = `is_threshold` (TIS);
- mask: w where C_min <= w <= C_max (`is_mask_min`, `is_mask_max`), else 0 (MIS, weighting only):
  the token (or the whole sequence at a sequence level) adds nothing to the loss but still counts
  in the aggregation's normaliser (a weight-0 token);
- reject: the tokens (or sequences) outside [C_min, C_max] leave the response mask itself (verl's
  rollout rejection sampling), the others keep their weight w: the rejected are out of the
  normaliser too, so a mean is over the kept tokens only. `kept_mask` gives that mask; the
  whole-batch normaliser must be built from it (see `policy_loss`'s split contract).
Levels (`algorithm.is_level`), named as verl names them:
- token: w_t per token;
- sequence: the product w_i = prod_t w_t = exp(sum_t log w_t) on every token of row i;
- geometric: the geometric mean w_i = exp(mean_t log w_t) on every token of row i.
Token log-weights are clamped to +-`max_log_ratio` before anything else, and a sequence's summed
log-weight again (verl's safety bound), so that exp never overflows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.losses.ratios import sequence_log_ratio
from megatron_rl.losses.spec import IS_LEVELS, IS_MODES, LossSpec


@dataclass
class ImportanceWeights:
    """log_token: clamped per-token log(pi_old / pi_rollout) (0 outside the mask), [B, T].
    raw: pi_old / pi_rollout at `is_level`, before truncation or masking (1 outside the mask), [B, T].
    weight: what multiplies each token's loss, [B, T] (detached; all ones when mode is none).
    truncated: tokens whose weight was capped at C; dropped: tokens outside [C_min, C_max] (modes
    mask and reject; bool [B, T]).
    """

    log_token: torch.Tensor
    raw: torch.Tensor
    weight: torch.Tensor
    truncated: torch.Tensor
    dropped: torch.Tensor


def level_log_weights(log_token: torch.Tensor, mask: torch.Tensor, level: str, max_log_ratio: float) -> torch.Tensor:
    """log w at `level` on every response token, [B, T] (0 outside the bool `mask`), from the clamped
    per-token log-weights `log_token` (0 outside the mask)."""
    if level == "token":
        return log_token
    if level == "sequence":
        per_row = log_token.sum(dim=-1).clamp(-max_log_ratio, max_log_ratio)
    elif level == "geometric":
        per_row = sequence_log_ratio(log_token, mask.sum(dim=-1))
    else:
        raise ValueError(f"algorithm.is_level = {level!r} is not known; allowed: {list(IS_LEVELS)}")
    return torch.where(mask, per_row.unsqueeze(-1), 0.0)


def importance_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str,
    level: str,
    threshold: float,
    mask_min: float,
    mask_max: float,
    max_log_ratio: float,
) -> ImportanceWeights:
    """The detached weights of every token of the bool response `mask` [B, T] (see the module docstring)."""
    if mode not in IS_MODES:
        raise ValueError(f"algorithm.is_correction = {mode!r} is not known; allowed: {list(IS_MODES)}")
    with torch.no_grad():
        log_w = torch.where(mask, old_log_probs - rollout_log_probs, 0.0)
        log_token = log_w.clamp(-max_log_ratio, max_log_ratio)
        raw = level_log_weights(log_token, mask, level, max_log_ratio).exp()
        none = torch.zeros_like(mask)
        if mode == "none":
            weight = raw.new_ones(()).expand_as(raw)
            return ImportanceWeights(log_token=log_token, raw=raw, weight=weight, truncated=none, dropped=none)
        if mode == "truncate":
            return ImportanceWeights(
                log_token=log_token,
                raw=raw,
                weight=raw.clamp(max=threshold),
                truncated=mask & (raw > threshold),
                dropped=none,
            )
        keep = (raw >= mask_min) & (raw <= mask_max)
        # reject: the tokens outside the window have left the mask already (`kept_mask`)
        weight = torch.where(keep, raw, 0.0) if mode == "mask" else raw
        return ImportanceWeights(log_token=log_token, raw=raw, weight=weight, truncated=none, dropped=mask & ~keep)


def kept_mask(
    spec: LossSpec, response_mask: torch.Tensor, old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor | None
) -> torch.Tensor:
    """The bool response mask [B, T] left after rejection: `response_mask` itself unless
    `spec.is_correction` is reject, then without the tokens (or sequences) outside [C_min, C_max].

    Build the whole-batch normaliser from these masks (they depend on the old and rollout
    log-probs, both known before the first micro-batch), so that every split adds up exactly.
    """
    mask = response_mask.bool()
    if spec.is_correction != "reject":
        return mask
    if rollout_log_probs is None:
        raise ValueError("algorithm.is_correction = 'reject' needs rollout_log_probs (got None)")
    iw = importance_weights(
        old_log_probs.detach().to(torch.float64), rollout_log_probs.detach().to(torch.float64), mask,
        mode="reject", level=spec.is_level, threshold=spec.is_threshold, mask_min=spec.is_mask_min,
        mask_max=spec.is_mask_max, max_log_ratio=spec.max_log_ratio,
    )  # fmt: skip
    return mask & ~iw.dropped
