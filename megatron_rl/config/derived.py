"""What a run reads off its configuration beyond single keys: the loss spec of its `algorithm` section, whether
it builds the frozen reference policy, the log-prob gap bound in force, and the optimizer steps of the learning
-rate schedule and its warm-up."""

from __future__ import annotations

import dataclasses

from megatron_rl.config.errors import ConfigError
from megatron_rl.config.schema import AlgorithmConfig, Config, TrainConfig
from megatron_rl.losses.spec import LossSpec

# rollout.max_logprob_gap's default by model.params_dtype. fp32: measured on CPU (<= 2e-7, the local
# engine against the actor). bf16: published mean |engine - trainer| log-prob gaps of bf16 SGLang
# against bf16 Megatron/FSDP on one checkpoint: 0.005-0.006 for Qwen3-32B, 0.14-0.34 for Qwen3-30B-A3B
# (routing flips); fp16 keeps bf16's bound until measured. tools/gpu/sglang_sync_check.py reports the gap.
LOGPROB_GAP_BY_DTYPE = {"fp32": 0.05, "bf16": 0.5, "fp16": 0.5}


def logprob_gap_limit(cfg: Config) -> float | None:
    """The `rollout.max_logprob_gap` in force: the configured one (0 = off: None), else the dtype's."""
    gap = cfg.rollout.max_logprob_gap
    if gap is None:
        return LOGPROB_GAP_BY_DTYPE[cfg.model.params_dtype]
    return gap or None


def uses_reference(alg: AlgorithmConfig) -> bool:
    """Whether the run builds the frozen reference policy (a KL term, or the KL metrics asked for)."""
    return alg.kl_coef > 0 or alg.ref_kl_metrics


def loss_spec(alg: AlgorithmConfig) -> LossSpec:
    """The run's `LossSpec` from its `algorithm` section (ConfigError naming the key when it cannot run).

    With `kl_in_reward` the KL is in the reward, so the loss's beta is 0 (the KL is only reported)."""
    section = dataclasses.replace(alg, kl_coef=0.0) if alg.kl_in_reward else alg
    try:
        return LossSpec.from_section(section)
    except ValueError as err:
        raise ConfigError(str(err)) from err


def optimizer_steps(train: TrainConfig) -> int:
    """The optimizer steps of the whole run, which the learning-rate schedule spans: steps x updates_per_step."""
    return train.steps * train.updates_per_step


def warmup_steps(train: TrainConfig) -> int:
    """The warm-up in optimizer steps: train.lr_warmup_steps, or train.lr_warmup_ratio of all optimizer steps
    floored (verl's int(lr_warmup_steps_ratio x total_training_steps)); the rules refuse both set."""
    return train.lr_warmup_steps or int(train.lr_warmup_ratio * optimizer_steps(train))
