"""Per-token estimators of KL(pi_theta || pi_ref) from tokens sampled by the policy (Schulman's k1/k2/k3)."""

from __future__ import annotations

import torch

from megatron_rl.losses.spec import KL_ESTIMATORS


def kl_estimate(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, mask: torch.Tensor, estimator: str, max_log_ratio: float
) -> torch.Tensor:
    """Per-token KL estimate, [B, T], with x = log pi_ref - log pi_theta (0 outside `mask`, clamped to +-max_log_ratio).

    k1 = -x (unbiased, can be negative); k2 = x^2 / 2 (biased, >= 0); k3 = e^x - 1 - x (unbiased, >= 0;
    GRPO's choice). Gradients flow into `log_probs` only.
    """
    x = torch.where(mask, ref_log_probs.detach() - log_probs, 0.0).clamp(-max_log_ratio, max_log_ratio)
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return 0.5 * x * x
    if estimator == "k3":
        return torch.expm1(x) - x
    raise ValueError(f"algorithm.kl_estimator = {estimator!r} is not known; allowed: {list(KL_ESTIMATORS)}")
