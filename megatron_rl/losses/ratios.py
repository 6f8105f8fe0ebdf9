"""Importance ratios pi_theta / pi_old at token, sequence (GSPO) and sequence-token (GSPO-token) level.

Numerical safety: every per-token log-ratio is first zeroed outside the response mask (so that
padding holding -inf or NaN log-probs never reaches exp or the gradient) and then clamped to
[-M, M], M = `algorithm.max_log_ratio`. A token clamped this way gets zero gradient through its
ratio; at the default M = 20 the ratio is already e^20 ~ 4.9e8, far outside any clip range.
"""

from __future__ import annotations

import torch

from megatron_rl.losses.spec import RATIO_LEVELS


def token_log_ratio(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, mask: torch.Tensor, max_log_ratio: float
) -> torch.Tensor:
    """Clamped log r_t = log pi_theta - log pi_old per token, 0 outside the mask; [B, T]."""
    delta = torch.where(mask, log_probs - old_log_probs.detach(), 0.0)
    return delta.clamp(-max_log_ratio, max_log_ratio)


def sequence_log_ratio(log_ratio: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """log s_i = mean of log r_t over the `lengths[i]` response tokens of row i (0 for an empty row); [B].

    `log_ratio` must be 0 outside the response mask (as `token_log_ratio` returns it).
    """
    return log_ratio.sum(dim=-1) / lengths.clamp_min(1).to(log_ratio.dtype)


def ratio(log_ratio: torch.Tensor, lengths: torch.Tensor, level: str) -> torch.Tensor:
    """The ratio each token's gate sees, [B, T], from the clamped token log-ratios and the response lengths [B].

    token: r_t = exp(log r_t).
    sequence: s_i = exp(mean_t log r_t) broadcast to the row (GSPO; the gradient reaches every
        token of the row through the mean).
    sequence_token: s_it = sg[s_i] * pi_t / sg[pi_t] (GSPO-token): the value of s_i with the
        gradient of one token, d s_it / d log pi_t = s_i.
    """
    if level == "token":
        return log_ratio.exp()
    log_s = sequence_log_ratio(log_ratio, lengths).unsqueeze(-1)
    if level == "sequence":
        return log_s.exp().expand_as(log_ratio)
    if level == "sequence_token":
        return (log_s.detach() + log_ratio - log_ratio.detach()).exp()
    raise ValueError(f"algorithm.ratio_level = {level!r} is not known; allowed: {list(RATIO_LEVELS)}")
