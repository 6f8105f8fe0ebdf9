"""Rules between configuration keys that their types cannot state, and `ConfigError`, which every rule raises.

A key that reads another's value only for one choice of it implies that choice: `reward.custom_function`
is read only with `reward.type = custom`, and `rollout.sglang_urls` only with `rollout.engine = sglang`.
`imply` sets the implied key while loading (`megatron_rl.config.load_config`) when no layer (YAML file,
overrides) gives it; `check_implied` refuses the two together with another choice, naming both keys, so
that a setting is never silently ignored (also in a `Config` built in code, where nothing is implied).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf


class ConfigError(ValueError):
    """A configuration value, type, key or combination that cannot run."""


@dataclass(frozen=True)
class Implied:
    """`key`, when set (not null, not empty), implies `target = value`."""

    key: str
    target: str
    value: str


IMPLIED = (
    Implied("reward.custom_function", "reward.type", "custom"),
    Implied("rollout.sglang_urls", "rollout.engine", "sglang"),
)
_ABSENT = object()


def imply(merged: DictConfig, layers: Sequence[DictConfig]) -> None:
    """Set in `merged` each implied key that none of the `layers` gives, when its implying key is set."""
    for rule in IMPLIED:
        given = any(OmegaConf.select(layer, rule.target, default=_ABSENT) is not _ABSENT for layer in layers)
        if OmegaConf.select(merged, rule.key) and not given:
            OmegaConf.update(merged, rule.target, rule.value)


def check_implied(cfg: Any) -> None:
    """ConfigError naming both keys when an implying key is set but its target holds another choice."""
    for rule in IMPLIED:
        value, target = _value(cfg, rule.key), _value(cfg, rule.target)
        if value and target != rule.value:
            raise ConfigError(
                f"{rule.key} = {value!r} is read only with {rule.target} = {rule.value!r}, but {rule.target} = "
                f"{target!r}: set {rule.target} = {rule.value!r} (or leave it out: {rule.key} implies it), or remove "
                f"{rule.key}"
            )


def _value(cfg: Any, key: str) -> Any:
    return functools.reduce(getattr, key.split("."), cfg)
