"""The policy loss of every objective in one form: aggregate(-gate(ratio, A) * w_is) + beta * KL."""

from __future__ import annotations

import torch

from megatron_rl.losses.aggregation import Normalizer, normalizer_from_lengths, token_weights
from megatron_rl.losses.gates import gate
from megatron_rl.losses.importance import importance_weights, kept_mask
from megatron_rl.losses.kl import kl_estimate
from megatron_rl.losses.metrics import count, masked_max, masked_min, masked_sum
from megatron_rl.losses.ratios import ratio, token_log_ratio
from megatron_rl.losses.spec import LossSpec


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    spec: LossSpec,
    *,
    rollout_log_probs: torch.Tensor | None = None,
    ref_log_probs: torch.Tensor | None = None,
    normalizer: Normalizer | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one (micro-)batch and its reducible metrics.

    Inputs are [B, T], aligned per response token: `log_probs` (log pi_theta of the sampled
    tokens, with grad), `old_log_probs` (pi_old), `advantages` (per token; broadcast a sequence
    advantage over its tokens), `response_mask` (nonzero = response token; outside it every
    input may hold any value, even inf/NaN), optional `rollout_log_probs` (the engine's, for
    `algorithm.is_correction`) and `ref_log_probs` (needed when `algorithm.kl_coef` > 0; given
    with kl_coef = 0, the KL is only reported). Each row must hold a whole response
    (sequence-level quantities are per row). `spec` holds the `algorithm` settings, validated
    when it was built (`LossSpec.from_section(cfg.algorithm)`, once per run); only the inputs are
    checked here. Computation is in float64 for float64 `log_probs`, else in float32 (bf16/fp16
    inputs are upcast; the loss is float32).

    Loss = sum_it W_it * (-gate_it * w_is_it + beta * KL_it), with W_it the aggregation weight
    of `spec.loss_agg_mode` built from `normalizer` (`losses.aggregation`), the ratio and
    its +-`max_log_ratio` clamp from `losses.ratios`, the gate from `losses.gates`, w_is from
    `losses.importance` (1 when `is_correction` is none) and KL from `losses.kl`.

    Split contract: build ONE normaliser for the whole global batch with
    `global_normalizer(whole_batch_response_mask, token_norm=rollout.max_new_tokens)` and pass it
    to every call. Then for any split of the rows into micro-batches over gradient-accumulation
    steps and DP ranks, sum_{ranks} sum_{micro-batches} loss_mb equals the whole-batch loss, and
    its gradient equals the whole-batch gradient, exactly, in every mode. The gradient wanted is
    therefore the SUM (not the mean) of the per-micro-batch gradients over all ranks and steps: a
    framework that averages must be compensated, e.g. under Megatron-Core's defaults (loss_func
    returning (loss, reduced), `calculate_per_token_loss=False`) the schedule divides each loss
    by num_microbatches and DDP scales gradients by 1/dp_size, so the actor returns
    loss * num_microbatches * dp_size. Without `normalizer`, the call's own mask is the whole batch.
    With `is_correction` reject, the rejected tokens (or sequences) leave the response mask before
    anything else (`losses.importance.kept_mask`): build the normaliser from the kept masks,
    `global_normalizer([kept_mask(spec, m, old, rollout) ...])`, and the contract holds as stated
    (the actor does so and reports the rejected share as is_rejected_frac).

    Metrics: detached 0-dim float64 tensors, reduced per `losses.metrics.metric_reduce_op` (SUM,
    or MAX/MIN for `_max`/`_min` keys), then `finalize_metrics`. The key set depends only on the
    spec and on which optional inputs are given, so it is the same on every rank:
    - always: tokens, sequences (rows with a response token), loss, pg_loss (the shares of this
      call, summing to the batch values), ratio_sum/_max/_min (the ratio the gate sees: r_t, or
      s_i on every token of row i), approx_kl_sum (k3 estimate of KL(pi_old || pi_theta) per token,
      (r-1) - log r with the token ratio);
    - gate clip: clip_low_tokens (A < 0 and ratio < 1-eps_low), clip_high_tokens (A > 0 and
      ratio > 1+eps_high), and dual_clip_tokens (A < 0 and ratio > c) when dual clip is on;
    - gate soft: sapo_gate_sum (the gradient weight sech^2(tau (r-1)/2), 1 on-policy);
    - ref_log_probs given: kl_loss (beta * aggregated KL share), ref_kl_sum (per-token estimate);
    - rollout_log_probs given: is_weight_sum/_max/_min (raw pi_old/pi_rollout at `is_level`),
      rollout_kl_sum (k3 estimate of KL(pi_rollout || pi_old)), is_truncated_tokens (mode
      truncate), is_dropped_tokens (mode mask; mode reject has removed them before, see above).
    """
    if not isinstance(spec, LossSpec):
        raise TypeError(f"policy_loss: spec must be a LossSpec, got {type(spec).__name__}")
    _check_inputs(log_probs, old_log_probs, advantages, response_mask, rollout_log_probs, ref_log_probs)
    if spec.is_correction != "none" and rollout_log_probs is None:
        raise ValueError(f"algorithm.is_correction = {spec.is_correction!r} needs rollout_log_probs (got None)")
    if spec.kl_coef > 0 and ref_log_probs is None:
        raise ValueError(f"algorithm.kl_coef = {spec.kl_coef} needs ref_log_probs (got None)")

    dtype = torch.float64 if log_probs.dtype == torch.float64 else torch.float32
    mask = kept_mask(spec, response_mask, old_log_probs, rollout_log_probs)
    lengths = mask.sum(dim=-1)
    logp, old = log_probs.to(dtype), old_log_probs.detach().to(dtype)
    adv = torch.where(mask, advantages.detach().to(dtype), 0.0)
    if normalizer is None:
        normalizer = normalizer_from_lengths(lengths, token_norm=mask.shape[-1])
    weights = token_weights(mask, lengths, spec.loss_agg_mode, normalizer, dtype)
    log_r = token_log_ratio(logp, old, mask, spec.max_log_ratio)
    r = ratio(log_r, lengths, spec.ratio_level)
    gate_value, gate_metrics = gate(r, adv, mask, spec)
    token_loss = -gate_value
    iw = None
    if rollout_log_probs is not None:
        iw = importance_weights(
            old, rollout_log_probs.detach().to(dtype), mask, mode=spec.is_correction, level=spec.is_level,
            threshold=spec.is_threshold, mask_min=spec.is_mask_min, mask_max=spec.is_mask_max,
            max_log_ratio=spec.max_log_ratio,
        )  # fmt: skip
        if spec.is_correction != "none":
            token_loss = token_loss * iw.weight
    pg_loss = (token_loss * weights).sum()
    loss = pg_loss
    kl = None
    if ref_log_probs is not None:
        kl = kl_estimate(logp, ref_log_probs.detach().to(dtype), mask, spec.kl_estimator, spec.max_log_ratio)
        kl_loss = spec.kl_coef * (kl * weights).sum()
        if spec.kl_coef > 0:
            loss = loss + kl_loss

    with torch.no_grad():
        metrics = {
            "tokens": lengths.sum().to(torch.float64),
            "sequences": count(lengths > 0),
            "loss": loss.detach().to(torch.float64),
            "pg_loss": pg_loss.detach().to(torch.float64),
            "ratio_sum": masked_sum(r, mask),
            "ratio_max": masked_max(r, mask),
            "ratio_min": masked_min(r, mask),
            # log_r is 0 outside the mask, where (r - 1) - log r vanishes too
            "approx_kl_sum": (torch.expm1(log_r) - log_r).sum().to(torch.float64),
        }
        metrics.update(gate_metrics)
        if kl is not None:
            metrics["kl_loss"] = kl_loss.detach().to(torch.float64)
            metrics["ref_kl_sum"] = masked_sum(kl, mask)
        if iw is not None:
            metrics["is_weight_sum"] = masked_sum(iw.raw, mask)
            metrics["is_weight_max"] = masked_max(iw.raw, mask)
            metrics["is_weight_min"] = masked_min(iw.raw, mask)
            metrics["rollout_kl_sum"] = (torch.expm1(iw.log_token) - iw.log_token).sum().to(torch.float64)
            if spec.is_correction == "truncate":
                metrics["is_truncated_tokens"] = count(iw.truncated)
            elif spec.is_correction == "mask":
                metrics["is_dropped_tokens"] = count(iw.dropped)
    return loss, metrics


def _check_inputs(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_log_probs: torch.Tensor | None,
    ref_log_probs: torch.Tensor | None,
) -> None:
    if not isinstance(log_probs, torch.Tensor) or log_probs.dim() != 2 or not log_probs.is_floating_point():
        shape = tuple(log_probs.shape) if isinstance(log_probs, torch.Tensor) else type(log_probs).__name__
        raise ValueError(f"policy_loss: log_probs must be a floating [B, T] tensor, got {shape}")
    named = {
        "old_log_probs": old_log_probs,
        "advantages": advantages,
        "response_mask": response_mask,
        "rollout_log_probs": rollout_log_probs,
        "ref_log_probs": ref_log_probs,
    }
    for name, tensor in named.items():
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor) or tensor.shape != log_probs.shape:
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"policy_loss: {name} has shape {shape}, log_probs has {tuple(log_probs.shape)}")
        if name != "response_mask" and not tensor.is_floating_point():
            raise ValueError(f"policy_loss: {name} must be floating point, got {tensor.dtype}")
