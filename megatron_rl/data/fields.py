"""Row fields by dotted key path (`reward_model.ground_truth`)."""

from __future__ import annotations

from typing import Any

MISSING: Any = object()


def get_field(row: Any, key: str) -> Any:
    """`row[key]` when the row has that literal key, else the nested lookup along the dots; MISSING if absent.

    A present key whose value is None counts as missing (parquet fills absent struct fields with null).
    """
    if isinstance(row, dict) and key in row:
        value = row[key]
        return MISSING if value is None else value
    value = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return MISSING if value is None else value
