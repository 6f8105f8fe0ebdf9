"""Per-token gates g(ratio, A): the surrogate objective whose negative is the per-token loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.losses.metrics import count, masked_sum
from megatron_rl.losses.spec import GATES, LossSpec


@dataclass
class ClipGate:
    """value: the gate per token (differentiable); clip_low / clip_high / dual_clip: bool [B, T] of
    the tokens whose gradient the clip zeroes (dual_clip is None when dual clip is off)."""

    value: torch.Tensor
    clip_low: torch.Tensor
    clip_high: torch.Tensor
    dual_clip: torch.Tensor | None


def clip_gate(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float, dual_clip_c: float | None
) -> ClipGate:
    """PPO/GSPO clip: min(r*A, clip(r, 1-eps_low, 1+eps_high)*A); with dual clip, max(that, c*A) for A < 0.

    Evaluated in the equivalent form A * (bound if clipped else r), bound = clip(r) (or c for the
    dual clip), with `clipped` = (A > 0 and r > 1+eps_high) or (A < 0 and r < 1-eps_low) or
    (A < 0 and r > c): the gradient w.r.t. r is exactly 0 on the clipped side and exactly A
    elsewhere (also at the bounds), and the clip masks double as the clip-fraction metrics.
    """
    with torch.no_grad():
        r = ratio.detach()
        clip_high = (r > 1.0 + eps_high) & (advantages > 0)
        clip_low = (r < 1.0 - eps_low) & (advantages < 0)
        clipped = clip_high | clip_low
        bound = r.clamp(1.0 - eps_low, 1.0 + eps_high)
        dual = None
        if dual_clip_c is not None:
            dual = (r > dual_clip_c) & (advantages < 0)
            clipped |= dual
            bound = torch.where(dual, dual_clip_c, bound)
    return ClipGate(torch.where(clipped, bound, ratio) * advantages, clip_low, clip_high, dual)


@dataclass
class SoftGate:
    """value: the gate per token (differentiable); weight: its detached gradient weight sech^2(tau (r-1)/2)."""

    value: torch.Tensor
    weight: torch.Tensor


def soft_gate(ratio: torch.Tensor, advantages: torch.Tensor, tau_pos: float, tau_neg: float) -> SoftGate:
    """SAPO: (4/tau) * sigmoid(tau * (r - 1)) * A, tau = tau_pos where A > 0, else tau_neg.

    d gate / d log r = 4 p (1-p) * r * A = sech^2(tau (r-1) / 2) * r * A with p = sigmoid(tau (r-1)):
    the plain policy gradient r*A at r = 1, decaying smoothly as r leaves 1 (no hard clip).
    """
    tau = torch.full_like(advantages, tau_neg).masked_fill_(advantages > 0, tau_pos)
    p = torch.sigmoid(tau * (ratio - 1.0))
    value = p * (4.0 * advantages / tau)
    with torch.no_grad():
        weight = 4.0 * p * (1.0 - p)
    return SoftGate(value, weight)


def gate(
    ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, spec: LossSpec
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The gate `spec.gate` per token (differentiable) and its metrics over the bool `mask`.

    clip: clip_low_tokens, clip_high_tokens and, with dual clip, dual_clip_tokens; soft: sapo_gate_sum.
    """
    if spec.gate == "clip":
        clip = clip_gate(ratio, advantages, spec.clip_eps_low, spec.clip_eps_high, spec.dual_clip_c)
        metrics = {"clip_low_tokens": count(clip.clip_low & mask), "clip_high_tokens": count(clip.clip_high & mask)}
        if clip.dual_clip is not None:
            metrics["dual_clip_tokens"] = count(clip.dual_clip & mask)
        return clip.value, metrics
    if spec.gate == "soft":
        soft = soft_gate(ratio, advantages, spec.sapo_tau_pos, spec.sapo_tau_neg)
        return soft.value, {"sapo_gate_sum": masked_sum(soft.weight, mask)}
    raise ValueError(f"algorithm.gate = {spec.gate!r} is not known; allowed: {list(GATES)}")
