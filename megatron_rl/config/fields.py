"""The one way a configuration field is declared: its default, its documentation and its numeric bounds."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def described_field(default: Any, help: str, **bounds: float) -> Any:
    """A field with documentation and optional bounds (ge, gt, le, lt)."""
    meta = {"help": help, **bounds}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)
