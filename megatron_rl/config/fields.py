"""`described`, the one way a schema field is declared: its default, its help text (with the unit) and its
optional numeric bounds (`ge`, `gt`, `le`, `lt`), which `megatron_rl.config.rules` checks."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def described(default: Any, help: str, **bounds: float) -> Any:
    """A field with documentation and optional bounds (ge, gt, le, lt)."""
    meta = {"help": help, **bounds}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)
