"""The run's configuration: the typed tree, the objectives' presets, loading and the configuration's own rules.

- `schema.py`: the sections (OmegaConf structured dataclasses), each field with its help and bounds;
- `parallel_schema.py`: the `parallel` section (the layout, uneven pipeline stages, the optimizer's place);
- `fields.py`: `described`, how every field is declared (default, help, bounds);
- `presets.py`: the published defaults of each objective (`algorithm.name`);
- `loading.py`: `load_config` (defaults < preset < YAML file < `key=value` overrides, implied keys, validated)
  and `to_yaml` / `to_dict` (secrets redacted);
- `rules.py`: `check_rules`, the configuration's own rules (ranges, choices, combinations, implied keys);
- `derived.py`: what a run reads off its config (the loss spec, the reference policy, the log-prob gap bound,
  the optimizer steps and warm-up of the learning-rate schedule, the prompts a generation round draws, the
  transformer layers of each pipeline stage);
- `epochs.py`: `train.epochs`, the run's steps derived from its data once read (`with_epoch_steps`);
- `data_schema.py`: the `data` and `eval` sections;
- `reference.py`: the values a key allows, and the reference table of every key;
- `errors.py`: `ConfigError`.

A run is validated by `megatron_rl.validation.validate_run`, the one check every entry point calls: it reads
the model from its checkpoint and runs `check_rules` among the checks that need more than the config.
"""

from megatron_rl.config.derived import (
    LOGPROB_GAP_BY_DTYPE,
    logprob_gap_limit,
    loss_spec,
    optimizer_steps,
    pipeline_stage_layers,
    prompts_per_round,
    uses_reference,
    warmup_steps,
)
from megatron_rl.config.epochs import epoch_steps, with_epoch_steps
from megatron_rl.config.errors import ConfigError
from megatron_rl.config.loading import load_config, parse_overrides, to_dict, to_yaml
from megatron_rl.config.presets import PRESETS, preset
from megatron_rl.config.reference import reference_rows
from megatron_rl.config.rules import IMPLIED, Implied, check_implied, check_rules, check_step_rules, imply
from megatron_rl.config.schema import (
    MLA_FAMILIES,
    REDACTED,
    SECRET_KEYS,
    SPARSE_ATTENTION_FAMILIES,
    AlgorithmConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    Dtype,
    EnvConfig,
    EvalConfig,
    Family,
    LinearAttentionConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    ParallelConfig,
    RewardConfig,
    RolloutConfig,
    TrainConfig,
)

# The name `check_rules` had before the split (tests and the branches in flight import it).
validate = check_rules

__all__ = [
    "IMPLIED",
    "LOGPROB_GAP_BY_DTYPE",
    "MLA_FAMILIES",
    "PRESETS",
    "REDACTED",
    "SECRET_KEYS",
    "SPARSE_ATTENTION_FAMILIES",
    "AlgorithmConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "Dtype",
    "EnvConfig",
    "EvalConfig",
    "Family",
    "Implied",
    "LoggingConfig",
    "LinearAttentionConfig",
    "LoraConfig",
    "ModelConfig",
    "ParallelConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainConfig",
    "check_implied",
    "check_rules",
    "check_step_rules",
    "epoch_steps",
    "imply",
    "load_config",
    "logprob_gap_limit",
    "pipeline_stage_layers",
    "loss_spec",
    "optimizer_steps",
    "parse_overrides",
    "preset",
    "prompts_per_round",
    "reference_rows",
    "to_dict",
    "to_yaml",
    "uses_reference",
    "validate",
    "warmup_steps",
    "with_epoch_steps",
]
