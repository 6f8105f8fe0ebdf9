"""The package's HTTP clients (the SGLang client, the remote-reward client): one session factory and
one retry policy.

- `client_session`: an aiohttp session with the caller's key (`Authorization: Bearer KEY`), its
  headers, a bound on open connections and, when given, the timeout of every request.
- `retrying(attempt, policy, log)`: `policy.tries` attempts at most; an attempt that raises
  `RetryableFailure` is tried again after `policy.backoff_s`, doubled each time (a warning names what
  failed, why, and the next try), and given the targets that failed so far, so that it can fail over
  to another server; any other exception ends the call at once. After the last try
  `RetriesExhausted` carries the last failure, for the caller's own message. Which replies retry is the
  caller's to say, as the attempt reads them: the SGLang client retries connection errors and
  502/503/504 and fails at once on a timeout, the reward client also retries timeouts, 429 and 500.

Why this small policy and not `tenacity` (which is not among the package's dependencies): the one
loop above is the whole of what both callers share, while what differs stays in their attempts (the
targets to leave out, the SGLang client's weights gate before each attempt, its count of a server's
connection errors in a row); with tenacity, each attempt's target and the exhaustion's last reason
would pass through its `RetryCallState` and `RetryError`, for the same 2^n backoff, and the
dependency would come with it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

T = TypeVar("T")


def bearer(api_key: str) -> dict[str, str]:
    """The header that carries `api_key`."""
    return {"Authorization": f"Bearer {api_key}"}


def client_session(
    api_key: str | None,
    connections: int,
    timeout: aiohttp.ClientTimeout | None = None,
    headers: Mapping[str, str] | None = None,
) -> aiohttp.ClientSession:
    """A session sending `api_key` (when set) and `headers` with every request, at most `connections`
    connections open; `timeout`: each request's, unless the request gives its own."""
    sent = {**(headers or {}), **(bearer(api_key) if api_key else {})}
    options: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
    return aiohttp.ClientSession(headers=sent, connector=aiohttp.TCPConnector(limit=connections), **options)


def connection_failure(err: BaseException) -> str:
    """A request that reached no server, in a few words: "connection refused", "host name not resolved (...)",
    "cannot connect (...)"; other errors as their type and message."""
    cause = getattr(err, "os_error", None)  # aiohttp's ClientConnectorError wraps the socket's OSError
    if isinstance(cause, ConnectionRefusedError):
        return "connection refused"
    if isinstance(cause, socket.gaierror):
        return f"host name not resolved ({cause.strerror})"
    if isinstance(cause, OSError) and cause.strerror:
        return f"cannot connect ({cause.strerror})"
    return f"{type(err).__name__}: {err}"


@dataclass(frozen=True)
class RetryPolicy:
    """`max_retries` tries after the first, the k-th (from 0) after a wait of `backoff_s * 2**k`."""

    max_retries: int
    backoff_s: float

    @property
    def tries(self) -> int:
        return self.max_retries + 1

    def wait_s(self, attempt: int) -> float:
        return self.backoff_s * 2**attempt

    def total_wait_s(self) -> float:
        """The waits of all the retries together: how long a call's tries span at least."""
        return self.backoff_s * (2**self.max_retries - 1)


class RetryableFailure(Exception):
    """An attempt that may succeed when tried again: `where` it failed (the request, and the server
    when the caller has several), `reason`, the `target` to leave out of the next try, and whether
    the server was reached at all (`replied`)."""

    def __init__(self, where: str, reason: str, target: str = "", replied: bool = True) -> None:
        super().__init__(f"{where}: {reason}")
        self.where, self.reason, self.target, self.replied = where, reason, target, replied


class RetriesExhausted(Exception):
    """Every try failed: `last` is the last failure, `failed` the targets that failed."""

    def __init__(self, tries: int, last: RetryableFailure, failed: set[str]) -> None:
        super().__init__(f"failed after {tries} tries: {last}")
        self.tries, self.last, self.failed = tries, last, failed


async def retrying(attempt: Callable[[set[str]], Awaitable[T]], policy: RetryPolicy, log: logging.Logger) -> T:
    """`attempt(failed)` until it returns, raises anything but `RetryableFailure`, or has been tried
    `policy.tries` times (then `RetriesExhausted`); `failed`: the targets of the failed tries."""
    failed: set[str] = set()
    tries = policy.tries
    for number in range(tries):
        try:
            return await attempt(failed)
        except RetryableFailure as failure:
            last = failure
        failed.add(last.target)
        if number + 1 < tries:
            wait_s = policy.wait_s(number)
            log.warning("%s failed (%s); try %d of %d in %.1f s", last.where, last.reason, number + 2, tries, wait_s)
            await asyncio.sleep(wait_s)
    raise RetriesExhausted(tries, last, failed)
