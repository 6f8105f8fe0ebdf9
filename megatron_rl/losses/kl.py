"""Per-token estimators of KL(pi_theta || pi_ref) from tokens sampled by the policy (Schulman's k1/k2/k3)."""

from __future__ import annotations

import torch

from megatron_rl.losses.spec import KL_ESTIMATORS

# verl's `low_var_kl` clamps k3 to [-10, 10]: e^x - 1 - x grows to e^20 per token at the log-ratio
# clamp, so one token far from the reference would dominate the loss (or, with kl_in_reward, the reward)
K3_MAX = 10.0


def kl_estimate(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, mask: torch.Tensor, estimator: str, max_log_ratio: float
) -> torch.Tensor:
    """Per-token KL estimate, [B, T], with x = log pi_ref - log pi_theta (0 outside `mask`, clamped to +-max_log_ratio).

    k1 = -x (unbiased, can be negative; in the loss its gradient, that of log pi_theta, has zero
    expectation, so `megatron_rl.config` allows it only in the reward); k2 = x^2 / 2 (biased, >= 0);
    k3 = e^x - 1 - x (unbiased, >= 0; GRPO's choice), clamped to `K3_MAX` as verl's `low_var_kl`,
    with zero gradient beyond. Gradients flow into `log_probs` only.
    """
    x = torch.where(mask, ref_log_probs.detach() - log_probs, 0.0).clamp(-max_log_ratio, max_log_ratio)
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return 0.5 * x * x
    if estimator == "k3":
        return (torch.expm1(x) - x).clamp(max=K3_MAX)
    raise ValueError(f"algorithm.kl_estimator = {estimator!r} is not known; allowed: {list(KL_ESTIMATORS)}")
