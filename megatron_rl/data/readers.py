"""Rows of a prompt file (.jsonl or .parquet), each with where it came from."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

SUFFIXES = (".jsonl", ".parquet")


class DataError(ValueError):
    """A prompt file that cannot be used (missing, unreadable, or without one usable row)."""


@dataclass(frozen=True)
class RowLocation:
    """Where a row lives: a 1-based line of a .jsonl file or a 0-based row index of a .parquet file."""

    path: str
    kind: Literal["line", "row"]
    number: int

    def __str__(self) -> str:
        return f"{self.path}:{self.number}" if self.kind == "line" else f"{self.path} (row {self.number})"


@dataclass(frozen=True)
class RawRow:
    """One row as read: `value` is the decoded JSON / parquet record, or None with `error` set."""

    location: RowLocation
    value: Any
    error: str | None = None


def iter_rows(path: str | Path) -> Iterator[RawRow]:
    """Rows of a .jsonl (blank lines are ignored) or .parquet file, in file order."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist")
    if path.suffix == ".jsonl":
        return _iter_jsonl(path)
    if path.suffix == ".parquet":
        return _iter_parquet(path)
    raise DataError(f"data file {path}: unsupported format {path.suffix!r}; allowed: {list(SUFFIXES)}")


def _iter_jsonl(path: Path) -> Iterator[RawRow]:
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            location = RowLocation(str(path), "line", number)
            try:
                yield RawRow(location, json.loads(line.decode("utf-8")))
            except UnicodeDecodeError as err:
                yield RawRow(location, None, f"not UTF-8: {err}")
            except json.JSONDecodeError as err:
                yield RawRow(location, None, f"invalid JSON: {err}")


def _iter_parquet(path: Path) -> Iterator[RawRow]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises ArrowInvalid / OSError subclasses
        raise DataError(f"data file {path}: not a readable parquet file: {err}") from err
    number = 0
    for batch in parquet.iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            yield RawRow(RowLocation(str(path), "row", number), record)
            number += 1
