"""What a run reads off its configuration beyond single keys: the loss spec of its `algorithm` section, whether
it builds the frozen reference policy, the log-prob gap bound in force, the optimizer steps of the learning-rate
schedule and its warm-up, the prompts a generation round draws, and the transformer layers of each pipeline stage."""

from __future__ import annotations

import dataclasses
import math

from megatron_rl.config.errors import ConfigError
from megatron_rl.config.parallel_schema import ParallelConfig
from megatron_rl.config.schema import AlgorithmConfig, Config, ModelConfig, TrainConfig
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
    """The optimizer steps of the whole run, which the learning-rate schedule spans: steps x updates_per_step x
    ppo_epochs."""
    if train.steps is None:
        raise ValueError("optimizer_steps: train.steps is null until train.epochs is resolved (config.epochs)")
    return train.steps * train.updates_per_step * train.ppo_epochs


def prompts_per_round(cfg: Config) -> int:
    """The prompts one generation round of an RL step draws: train.prompts_per_step, with dynamic sampling
    times algorithm.oversample_factor, rounded up."""
    pps, alg = cfg.train.prompts_per_step, cfg.algorithm
    return math.ceil(pps * alg.oversample_factor) if alg.dynamic_sampling else pps


def warmup_steps(train: TrainConfig) -> int:
    """The warm-up in optimizer steps: train.lr_warmup_steps, or train.lr_warmup_ratio of all optimizer steps
    floored (verl's int(lr_warmup_steps_ratio x total_training_steps)); the rules refuse both set."""
    return train.lr_warmup_steps or int(train.lr_warmup_ratio * optimizer_steps(train))


def pipeline_stage_layers(model: ModelConfig, parallel: ParallelConfig) -> tuple[range, ...]:
    """The global transformer layers of each pipeline stage, as Megatron-Core splits them
    (`get_num_layers_to_build`, `get_transformer_layer_offset`); ConfigError naming the keys and numbers
    when the split cannot be made.

    Even: every stage model.num_layers / PP. Uneven: the first and/or last stage hold
    `parallel.num_layers_in_first_pipeline_stage` / `..._last_...`, the stages between them (the other
    stages of PP = 2 when only one is given) split the remaining layers evenly, at least one each.
    """
    layers, pp = model.num_layers, parallel.pipeline_model_parallel_size
    first, last = parallel.num_layers_in_first_pipeline_stage, parallel.num_layers_in_last_pipeline_stage
    if first is None and last is None:
        if layers % pp:
            raise ConfigError(
                f"parallel.pipeline_model_parallel_size ({pp}) must divide model.num_layers ({layers}), "
                "or set parallel.num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage"
            )
        return tuple(range(i * layers // pp, (i + 1) * layers // pp) for i in range(pp))
    given = {
        f"parallel.num_layers_in_{which}_pipeline_stage ({n})": n
        for which, n in (("first", first), ("last", last))
        if n is not None
    }
    named = " + ".join(given)
    if pp == 1:
        raise ConfigError(f"{named} splits pipeline stages, but parallel.pipeline_model_parallel_size = 1")
    others, rest = pp - len(given), layers - sum(given.values())
    if others == 0 and rest != 0:
        raise ConfigError(
            f"{named} must equal model.num_layers ({layers}) with parallel.pipeline_model_parallel_size = 2"
        )
    if others > 0 and (rest < others or rest % others):
        raise ConfigError(
            f"model.num_layers ({layers}) - {named} leaves {rest} layer(s) for the other {others} of "
            f"parallel.pipeline_model_parallel_size = {pp} stages: they must split evenly, at least 1 each"
        )
    middle = rest // others if others else 0
    sizes = [middle] * pp
    if first is not None:
        sizes[0] = first
    if last is not None:
        sizes[-1] = last
    starts = [sum(sizes[:i]) for i in range(pp)]
    return tuple(range(start, start + size) for start, size in zip(starts, sizes, strict=True))
