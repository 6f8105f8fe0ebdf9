"""A configuration field with its documentation and bounds, as every section declares its keys."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def documented(default: Any, help: str, **bounds: float) -> Any:
    """A field with documentation (`help`, with the unit) and optional bounds (ge, gt, le, lt)."""
    meta = {"help": help, **bounds}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)
