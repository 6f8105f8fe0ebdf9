"""A configuration from YAML and `key=value` overrides, and back to YAML.

`load_config` merges, in order: the defaults, the algorithm preset named by `algorithm.name`, the YAML
file and the overrides; sets the implied keys no layer gives (`megatron_rl.config.rules`); then checks the
result (`check_rules`). Every failure raises one `ConfigError` naming the key path, the layer it came from
and what is allowed. `to_yaml` writes a config back with its secrets redacted.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_rl.config.errors import ConfigError
from megatron_rl.config.presets import preset
from megatron_rl.config.reference import describe_type, field_meta, type_hints
from megatron_rl.config.rules import check_rules, imply
from megatron_rl.config.schema import REDACTED, SECRET_KEYS, Config


def _schema() -> DictConfig:
    return OmegaConf.structured(Config)


def _explain(err: OmegaConfBaseException, source: str) -> ConfigError:
    key = getattr(err, "full_key", None) or "?"
    msg = str(err).splitlines()[0]
    allowed = _allowed_values(key)
    hint = f"; allowed: {allowed}" if allowed else ""
    return ConfigError(f"{key}: {msg} (from {source}){hint}")


def _allowed_values(key: str) -> str:
    """Human description of the values a key accepts (choices, bounds or known keys)."""
    parts = key.split(".")
    cls: Any = Config
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(cls):
            return ""
        hints = type_hints(cls)
        if part not in hints:
            return f"keys of {'.'.join(parts[:i]) or 'the root'} are {sorted(hints)}"
        if i == len(parts) - 1:
            return describe_type(hints[part], field_meta(cls, part))
        cls = hints[part]
    return ""


def parse_overrides(overrides: list[str]) -> DictConfig:
    """`key=value` strings (values in YAML syntax) as one config."""
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r}: expected key=value, e.g. train.lr=1e-6")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as err:
        raise ConfigError(f"overrides: {err}") from err


def _load_yaml(path: str | Path) -> DictConfig:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; pass the YAML file (e.g. {path / 'rl.yaml'})")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        loaded = OmegaConf.load(path)
    except Exception as err:  # yaml.YAMLError carries the line and column
        raise ConfigError(f"config file {path}: not valid YAML: {err}") from err
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"config file {path}: the top level must be a mapping of sections")
    return loaded


def _algorithm_name(*layers: DictConfig) -> str:
    name = "grpo"
    for layer in layers:
        value = OmegaConf.select(layer, "algorithm.name", default=None)
        if value is not None:
            name = str(value)
    return name


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults < preset of `algorithm.name` < YAML file < overrides, validated."""
    layers: list[tuple[str, DictConfig]] = []
    if path is not None:
        layers.append((str(path), _load_yaml(path)))
    if overrides:
        layers.append(("the command line", parse_overrides(overrides)))
    name = _algorithm_name(*(layer for _, layer in layers))
    merged = _schema()
    try:
        merged.algorithm = OmegaConf.structured(preset(name))
    except OmegaConfBaseException as err:
        raise _explain(err, "preset") from err
    for source, layer in layers:
        _check_bool_values(OmegaConf.to_container(layer, resolve=False), Config, "", source)
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as err:
            raise _explain(err, source) from err
    imply(merged, [layer for _, layer in layers])
    cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    check_rules(cfg, model_shape=not (cfg.model.hf_path or cfg.checkpoint.load))
    return cfg


def _check_bool_values(values: Any, cls: Any, prefix: str, source: str) -> None:
    """Refuse a non-bool value of a bool key in one layer before OmegaConf converts it (2, 'yes' -> true)."""
    if not isinstance(values, dict) or not dataclasses.is_dataclass(cls):
        return
    hints = type_hints(cls)
    for name, value in values.items():
        if name not in hints:
            continue  # an unknown key: the merge names it
        tp, key = hints[name], f"{prefix}{name}"
        if dataclasses.is_dataclass(tp):
            _check_bool_values(value, tp, f"{key}.", source)
        elif tp in (bool, bool | None) and not isinstance(value, bool) and value is not None:
            if isinstance(value, str) and value.startswith("${"):
                continue  # an interpolation: OmegaConf checks what it resolves to
            nullable = " (or null)" if tp == bool | None else ""
            raise ConfigError(f"{key} = {value!r} (from {source}) is not a bool; allowed: true or false{nullable}")


def _redacted(cfg: Config) -> DictConfig:
    node = OmegaConf.structured(cfg)
    for key in SECRET_KEYS:
        if OmegaConf.select(node, key) is not None:
            OmegaConf.update(node, key, REDACTED)
    return node


def to_yaml(cfg: Config) -> str:
    """The config as YAML, secrets (`SECRET_KEYS`) redacted."""
    return OmegaConf.to_yaml(_redacted(cfg))


def to_dict(cfg: Config) -> dict[str, Any]:
    """The config as nested plain dicts, secrets (`SECRET_KEYS`) redacted, as `to_yaml` writes it."""
    return OmegaConf.to_container(_redacted(cfg))
