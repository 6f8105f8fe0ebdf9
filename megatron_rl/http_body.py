"""Request bodies of the package's HTTP servers (`megatron-rl serve`, `megatron-rl reward-server`).

- `read_body`: the body within a byte limit the caller derives from what the endpoint can
  legitimately carry; beyond it `BodyError` with status 413, before anything is read when the
  Content-Length header already says so, else as soon as the limit is passed (never buffering more).
- `parse_json`: strict JSON. Python's `json` accepts `NaN`, `Infinity`, `-Infinity` and numbers that
  overflow to infinity (`1e999`); none of them is JSON, and as a temperature or a reward they
  produce garbage. They are refused with status 400, naming the field (`sampling_params.temperature`).
"""

from __future__ import annotations

import json
import math
from typing import Any

from aiohttp import web


class BodyError(ValueError):
    """A request body refused before it reaches a handler; `status` is the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def read_body(request: web.Request, limit: int, what: str = "") -> bytes:
    """The whole body of `request`, at most `limit` bytes (else `BodyError` 413)."""
    where = what or f"{request.method} {request.path}"
    length = request.content_length
    if length is not None and length > limit:
        raise BodyError(413, f"{where}: a body of {length} bytes is over this endpoint's limit of {limit} bytes")
    chunks, total = [], 0
    async for chunk in request.content.iter_any():
        total += len(chunk)
        if total > limit:
            raise BodyError(413, f"{where}: the body passed this endpoint's limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


class _NonFinite:
    def __init__(self, text: str) -> None:
        self.text = text


def _number(text: str) -> Any:
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text)


def _first_non_finite(value: Any, path: str) -> tuple[str, str] | None:
    if isinstance(value, _NonFinite):
        return path or "body", value.text
    if isinstance(value, dict):
        items = ((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
    elif isinstance(value, list):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for where, item in items:
        found = _first_non_finite(item, where)
        if found is not None:
            return found
    return None


def parse_json(raw: bytes) -> Any:
    """`raw` as JSON (None when empty); `BodyError` 400 when it is not JSON or holds a non-finite number."""
    if not raw.strip():
        return None
    try:
        value = json.loads(raw, parse_constant=_NonFinite, parse_float=_number)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BodyError(400, f"body: not valid JSON ({err})") from None
    found = _first_non_finite(value, "")
    if found is not None:
        field, text = found
        raise BodyError(400, f"{field}: {text} is not a finite number (not valid JSON)")
    return value
