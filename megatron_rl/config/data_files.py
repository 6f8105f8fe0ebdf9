"""The files behind `data.train_path` and `data.eval_path`: one path, or a list of them with the train files'
weights (`data.train_weights`) and the eval files' metric names (`data.eval_names`), checked here once."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rl.config.errors import ConfigError


@dataclass(frozen=True)
class DataFile:
    path: str
    name: str  # eval files: the NAME of eval/NAME/... ("" for a single file, whose metrics are eval/...)
    weight: float | None = None  # train files: the mixture weight; None = one pool of every file's rows


def _paths(key: str, value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(f"{key} = {value!r}: a .jsonl/.parquet path or a non-empty list of them")
    for i, path in enumerate(value):
        if not isinstance(path, str) or not path:
            raise ConfigError(f"{key}[{i}] = {path!r} is not a file path")
    return list(value)


def train_files(data: Any) -> list[DataFile]:
    """`data.train_path` as files (none when unset), each with its `data.train_weights` entry."""
    paths, weights = _paths("data.train_path", data.train_path), list(data.train_weights)
    if weights and (isinstance(data.train_path, str) or len(weights) != len(paths)):
        raise ConfigError(
            f"data.train_weights has {len(weights)} weights for {len(paths)} file(s) of data.train_path: "
            "one weight per file of a list"
        )
    for i, w in enumerate(weights):
        ok = isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and w > 0
        if not ok:
            raise ConfigError(f"data.train_weights[{i}] = {w!r} is not a number > 0")
    return [DataFile(p, Path(p).stem, float(weights[i]) if weights else None) for i, p in enumerate(paths)]


def eval_files(data: Any) -> list[DataFile]:
    """`data.eval_path` as files (none when unset), named by `data.eval_names` or their stems."""
    paths, names = _paths("data.eval_path", data.eval_path), list(data.eval_names)
    if isinstance(data.eval_path, str) or data.eval_path is None:
        if names:
            raise ConfigError("data.eval_names names the files of a list in data.eval_path, which is one file")
        return [DataFile(p, "") for p in paths]
    if names and len(names) != len(paths):
        raise ConfigError(f"data.eval_names has {len(names)} names for {len(paths)} files of data.eval_path")
    names = names or [Path(p).stem for p in paths]
    for i, name in enumerate(names):
        if not isinstance(name, str) or not name or "/" in name:
            raise ConfigError(f"data.eval_names[{i}] = {name!r}: a non-empty name without '/' (eval/NAME/...)")
    if len(set(names)) != len(names):
        raise ConfigError(f"eval files' names {names} repeat: give each file its own in data.eval_names")
    return [DataFile(p, n) for p, n in zip(paths, names, strict=True)]


def files_of_config(data: Any) -> None:
    """ConfigError naming the key when the train or eval files, weights or names do not fit together."""
    train_files(data)
    eval_files(data)
