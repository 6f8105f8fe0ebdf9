"""Request bodies, as the package's HTTP servers (the local engine, the reward server, the agent
gateway) read them.

- `read_body`: the body within a byte limit the caller derives from what the endpoint can
  legitimately carry; beyond it `BodyError` with status 413, before anything is read when the
  Content-Length header already says so, else as soon as the limit is passed (never buffering more);
  a body that has not arrived within the read timeout of the head answers 408, so half-sent requests
  never hold a connection open (the head's own timeout: `server.start`).
- `parse_json`: strict JSON. Python's `json` accepts `NaN`, `Infinity`, `-Infinity` and numbers that
  overflow to infinity (`1e999`); none of them is JSON, and as a temperature or a reward they
  produce garbage. They are refused with status 400, naming the field (`sampling_params.temperature`),
  as are integers over 4300 digits (Python refuses to convert them), strings holding a lone UTF-16
  surrogate (not Unicode: no tokenizer or encoder takes them) and nesting deeper than `MAX_DEPTH`.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import sys
from typing import Any

from aiohttp import web

READ_TIMEOUT_S = 60.0  # the servers' --read-timeout-s default
MAX_DEPTH = 64  # nesting of JSON objects and arrays: far beyond any body the servers take
MAX_INT_DIGITS = sys.int_info.default_max_str_digits  # 4300: Python's own limit for int(str)


class BodyError(ValueError):
    """A request body refused before it reaches a handler; `status` is the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def read_body(request: web.Request, limit: int, what: str = "", timeout_s: float = READ_TIMEOUT_S) -> bytes:
    """The whole body of `request`, at most `limit` bytes (else `BodyError` 413), within `timeout_s`
    (else `BodyError` 408)."""
    where = what or f"{request.method} {request.path}"
    length = request.content_length
    if length is not None and length > limit:
        raise BodyError(413, f"{where}: a body of {length} bytes is over this endpoint's limit of {limit} bytes")
    chunks, total = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.content.iter_any():
                total += len(chunk)
                if total > limit:
                    raise BodyError(413, f"{where}: the body passed this endpoint's limit of {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise BodyError(
            408, f"{where}: the body did not arrive within the read timeout of {timeout_s:g} s ({total} bytes came)"
        ) from None
    return b"".join(chunks)


class _Refused:
    """A JSON value the parser keeps aside, to be reported with its field's path."""

    def __init__(self, problem: str) -> None:
        self.problem = problem


def _constant(text: str) -> _Refused:
    return _Refused(f"{text} is not a finite number (not valid JSON)")


def _number(text: str) -> Any:
    value = float(text)
    return value if math.isfinite(value) else _constant(text)


def _integer(text: str) -> Any:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        return _Refused(f"an integer of {digits} digits is over the limit of {MAX_INT_DIGITS} digits")
    return int(text)


# a surrogate in a JSON escape or as UTF-8 bytes (json decodes bytes with "surrogatepass"); valid
# pairs match too, and the walk that follows finds nothing in them
_MAY_HOLD_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def _text_problem(text: str) -> str | None:
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return f"a lone surrogate {text[err.start]!r} at character {err.start} (not valid Unicode)"
    return None


def _problem(value: Any) -> str | None:
    if isinstance(value, _Refused):
        return value.problem
    if isinstance(value, str):
        return _text_problem(value)
    return None


def _too_deep(value: Any) -> bool:
    """Nesting beyond `MAX_DEPTH`, level by level (comprehensions: fast on large flat bodies)."""
    level = [value] if isinstance(value, (dict, list)) else []
    for _ in range(MAX_DEPTH):
        if not level:
            return False
        children = (c for node in level for c in (node.values() if isinstance(node, dict) else node))
        level = [c for c in children if isinstance(c, (dict, list))]
    return bool(level)


def _path(trail: tuple | None) -> str:
    keys = []
    while trail is not None:
        trail, key = trail
        keys.append(key)
    parts = [f"[{key}]" if isinstance(key, int) else f".{key}" for key in reversed(keys)]
    return "".join(parts).removeprefix(".") or "body"


def _first_problem(value: Any) -> str | None:
    """`path: problem` for a refused value, a bad string (or key) or nesting beyond `MAX_DEPTH`; None
    when there is none. Iterative: a deep body cannot exhaust the stack here."""
    problem = _problem(value)
    if problem is not None:
        return f"body: {problem}"
    pending: list[tuple[Any, tuple | None, int]] = [(value, None, 1)] if isinstance(value, (dict, list)) else []
    while pending:
        node, trail, depth = pending.pop()
        for key, child in node.items() if isinstance(node, dict) else enumerate(node):
            if isinstance(key, str) and (problem := _text_problem(key)) is not None:
                return f"{_path(trail)}: the key {key!r} holds {problem}"
            if isinstance(child, (dict, list)):
                if depth >= MAX_DEPTH:
                    return f"{_path((trail, key))}: nested deeper than {MAX_DEPTH} levels"
                pending.append((child, (trail, key), depth + 1))
            elif (problem := _problem(child)) is not None:
                return f"{_path((trail, key))}: {problem}"
    return None


def _loads(raw: bytes, refused: list[_Refused]) -> Any:
    """`json.loads`, every refused value appended to `refused`. Integers are parsed by json's own C
    code unless one is over `MAX_INT_DIGITS` (json raises ValueError): then again, keeping it aside."""

    def kept(value: Any) -> Any:
        if isinstance(value, _Refused):
            refused.append(value)
        return value

    hooks: dict[str, Any] = {"parse_constant": lambda t: kept(_constant(t)), "parse_float": lambda t: kept(_number(t))}
    try:
        return json.loads(raw, **hooks)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise
    except ValueError:
        return json.loads(raw, parse_int=lambda t: kept(_integer(t)), **hooks)


def parse_json(raw: bytes) -> Any:
    """`raw` as JSON (None when empty); `BodyError` 400 when it is not JSON or holds a value JSON or
    the servers cannot take (see the module's docstring), naming the field."""
    if not raw.strip():
        return None
    refused: list[_Refused] = []
    try:
        value = _loads(raw, refused)
    except RecursionError:  # json's C scanner recurses per level: deeper than the interpreter's stack
        raise BodyError(400, f"body: nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise BodyError(400, f"body: not valid JSON ({err})") from None
    if refused or _MAY_HOLD_SURROGATE.search(raw) or _too_deep(value):
        problem = _first_problem(value)
        if problem is not None:
            raise BodyError(400, problem)
    return value
