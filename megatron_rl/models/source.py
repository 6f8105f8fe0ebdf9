"""Where the policy comes from: the `model` section derived from a Hugging Face config.json.

Users name a checkpoint (`model.hf_path`, or a Megatron `checkpoint.load` written by the
converter, which keeps the source's config.json in `hf_config/`); the architecture fields of
`model` are then read from that config.json and whatever the YAML says about them is replaced.
Only the training choices (`TRAINING_CHOICES`) are taken from the config as written.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from megatron_rl.config import Config, ConfigError, check_rules
from megatron_rl.models.hf_config import ConversionError, hf_config_from_model, model_config_from_hf, read_hf_config

# `model` fields that are not architecture: they keep the value of the run's config.
TRAINING_CHOICES = (
    "expert_bias_update_rate",
    "freeze_expert_bias",
    "make_vocab_size_divisible_by",
    "moe_aux_loss_coeff",
    "moe_token_dispatcher",
    "params_dtype",
    "recompute",
    "lora",  # the adapters are a training choice: the base's config.json says nothing of them
)
HF_CONFIG_DIR = "hf_config"  # inside a converted Megatron checkpoint (megatron_rl.commands.convert)


def hf_config_folder(cfg: Config) -> Path | None:
    """The folder whose config.json describes the policy: model.hf_path, else checkpoint.load/hf_config."""
    if cfg.model.hf_path:
        return Path(cfg.model.hf_path)
    if cfg.checkpoint.load and (Path(cfg.checkpoint.load) / HF_CONFIG_DIR / "config.json").is_file():
        return Path(cfg.checkpoint.load) / HF_CONFIG_DIR
    return None


def resolve_model(cfg: Config) -> Config:
    """`cfg` with its `model` section read from the policy's config.json (see the module doc), validated.

    Without such a file (a checkpoint saved by the actor), `model` is used as written.
    """
    folder = hf_config_folder(cfg)
    if folder is None:
        return cfg
    key = "model.hf_path" if cfg.model.hf_path else "checkpoint.load"
    source = f"{folder}/config.json ({key})"
    choices = {name: getattr(cfg.model, name) for name in TRAINING_CHOICES}
    try:
        model = model_config_from_hf(read_hf_config(folder), hf_path=cfg.model.hf_path, source=source, **choices)
    except ConversionError as err:
        raise ConfigError(str(err)) from None
    resolved = dataclasses.replace(cfg, model=model)
    check_rules(resolved)
    return resolved


def hf_config_for_export(cfg: Config) -> dict[str, Any]:
    """The config.json of exported HF folders: the source's (keeps its extra keys), else one built from `model`."""
    folder = hf_config_folder(cfg)
    return read_hf_config(folder) if folder is not None else hf_config_from_model(cfg.model)


def assets_folder(cfg: Config) -> str | None:
    """Where tokenizer and generation-config files for exported HF folders come from."""
    folder = hf_config_folder(cfg)
    return str(folder) if folder is not None else cfg.data.tokenizer_path


def tokenizer_source(cfg: Config) -> tuple[str, str]:
    """(folder, config key that gave it) of the tokenizer: data.tokenizer_path, else model.hf_path."""
    if cfg.data.tokenizer_path:
        return cfg.data.tokenizer_path, "data.tokenizer_path"
    if cfg.model.hf_path:
        return cfg.model.hf_path, "model.hf_path"
    folder = hf_config_folder(cfg)
    if folder is not None:
        return str(folder), "checkpoint.load"
    raise ConfigError("data.tokenizer_path: no tokenizer (set it, or model.hf_path)")
