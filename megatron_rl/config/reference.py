"""How the schema's fields read to a user: the values a key allows (for the error messages of loading and
of the rules) and the reference table of every key (`megatron-rl config --reference`, docs/configuration.md)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal, get_args, get_origin

from megatron_rl.config.schema import Config


def type_hints(cls: type) -> dict[str, Any]:
    """The resolved field types of a section (the schema's annotations are strings)."""
    return typing.get_type_hints(cls)


def field_meta(cls: type, name: str) -> dict[str, Any]:
    """The help and bounds of field `name` of section `cls`."""
    return dict(next(f.metadata for f in dataclasses.fields(cls) if f.name == name))


def describe_type(tp: Any, meta: dict[str, Any]) -> str:
    """The values a field of type `tp` and bounds `meta` allows: the choices, or the type and its bounds."""
    if tp is Any:
        return "str, list or null"  # data.train_path / eval_path: one file or a list of them
    args = [a for a in get_args(tp) if a is not type(None)]
    if get_origin(tp) is Literal:
        return str(list(get_args(tp)))
    if args and get_origin(args[0]) is Literal:
        return str(list(get_args(args[0]))) + " or null"
    bounds = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    parts = [f"{sym} {meta[k]}" for k, sym in bounds.items() if k in meta]
    base = getattr(args[0] if args else tp, "__name__", str(tp))
    nullable = " or null" if type(None) in get_args(tp) else ""
    return f"{base}{' ' + ', '.join(parts) if parts else ''}{nullable}"


def reference_rows() -> list[tuple[str, str, str, str]]:
    """(key, type, default, help) for every field: the config reference of docs/configuration.md."""
    rows: list[tuple[str, str, str, str]] = []
    for section in dataclasses.fields(Config):
        _reference_rows(type_hints(Config)[section.name], section.name, rows)
    return rows


def _reference_rows(cls: type, prefix: str, rows: list[tuple[str, str, str, str]]) -> None:
    default = cls()
    for fld in dataclasses.fields(cls):
        tp = type_hints(cls)[fld.name]
        if dataclasses.is_dataclass(tp):
            _reference_rows(tp, f"{prefix}.{fld.name}", rows)  # a nested section: one row per key
            continue
        meta = dict(fld.metadata)
        rows.append((f"{prefix}.{fld.name}", describe_type(tp, meta), repr(getattr(default, fld.name)), meta["help"]))
