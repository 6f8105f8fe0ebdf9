"""Per-token gates g(ratio, A): the surrogate objective whose negative is the per-token loss."""

from __future__ import annotations

import torch


def clip_gate(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float, dual_clip_c: float | None
) -> torch.Tensor:
    """PPO/GSPO clip: min(r*A, clip(r, 1-eps_low, 1+eps_high)*A); with dual clip, max(that, c*A) for A < 0.

    The gradient w.r.t. r is exactly 0 on the clipped side (r > 1+eps_high with A > 0,
    r < 1-eps_low with A < 0, and r > c with A < 0 under dual clip), and A elsewhere.
    """
    gate = torch.minimum(ratio * advantages, ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages)
    if dual_clip_c is not None:
        gate = torch.where(advantages < 0, torch.maximum(gate, dual_clip_c * advantages), gate)
    return gate


def soft_gate_tau(advantages: torch.Tensor, tau_pos: float, tau_neg: float) -> torch.Tensor:
    """SAPO temperature per token: tau_pos where A > 0, tau_neg elsewhere."""
    return torch.full_like(advantages, tau_neg).masked_fill_(advantages > 0, tau_pos)


def soft_gate(ratio: torch.Tensor, advantages: torch.Tensor, tau_pos: float, tau_neg: float) -> torch.Tensor:
    """SAPO: (4/tau) * sigmoid(tau * (r - 1)) * A, tau chosen by the sign of A.

    d gate / d log r = sech^2(tau (r-1) / 2) * r * A: the plain policy gradient r*A at r = 1,
    decaying smoothly as r leaves 1 (no hard clip).
    """
    tau = soft_gate_tau(advantages, tau_pos, tau_neg)
    return (4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * advantages


def soft_gate_weight(ratio: torch.Tensor, advantages: torch.Tensor, tau_pos: float, tau_neg: float) -> torch.Tensor:
    """SAPO's gradient weight sech^2(tau (r-1) / 2) = 4 p (1 - p), p = sigmoid(tau (r-1)); 1 at r = 1."""
    p = torch.sigmoid(soft_gate_tau(advantages, tau_pos, tau_neg) * (ratio - 1.0))
    return 4.0 * p * (1.0 - p)
