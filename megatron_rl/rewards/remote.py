"""`reward.type=remote`: score responses on a reward server (`megatron-rl reward-server` or any server
that speaks `rewards/protocol.py`).

The items go out in batches of `reward.batch_size`, at most `reward.max_concurrency` requests in
flight. A request without a reply within `reward.timeout_s`, a connection error, or HTTP 429 / 5xx is
retried `reward.max_retries` times, waiting `reward.retry_backoff_s` (doubled each time), on the rollout
runtime's event loop (`run`: `RolloutLoop.run`, called from the scoring thread); a batch still
failing then stands as a failure for each of its items (the scorer counts them; their groups are not
trained on, and more than `reward.max_failure_frac` of a step's responses stops the run), so one
batch takes at most (max_retries + 1) x timeout_s plus the waits. A reply that breaks the protocol
(no score, NaN, a wrong number of results) fails the items it concerns with an error naming the problem. A refused key (401/403), a wrong address (404) or a refused request
(400, 413) cannot heal by retrying: it raises `RemoteRewardError` at once, a `ConfigError` (the stage ends
with one line), as does a server that does not answer the start-up check (`check`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import aiohttp

from megatron_rl.config import ConfigError, RewardConfig
from megatron_rl.http.client import (
    RetriesExhausted,
    RetryableFailure,
    RetryPolicy,
    client_session,
    connection_failure,
    retrying,
)
from megatron_rl.rewards.protocol import (
    API_KEY_ENV,
    MalformedReplyError,
    RewardItem,
    RuleOutput,
    decode_reply,
    encode_request,
)

log = logging.getLogger(__name__)

RETRY_STATUSES = (429, 500, 502, 503, 504)
# runs a coroutine on the rollout runtime's loop and waits at most the seconds given (`RolloutLoop.run`)
LoopRunner = Callable[[Coroutine[Any, Any, Any], float], Any]


class RemoteRewardError(ConfigError):
    """The reward server cannot be used as configured (key, address, request refused); not retried."""


class RemoteRewardFailure(RuntimeError):
    """A batch that failed for good after its retries: a failure of each of its items."""


class RemoteRewardClient:
    """POSTs batches of `RewardItem`s to `url` and returns one output (or the error standing for it)
    per item, in order."""

    def __init__(
        self,
        url: str,
        run: LoopRunner,
        api_key: str | None = None,
        batch_size: int = 64,
        max_concurrency: int = 8,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 1.0,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"reward.url = {url!r} must start with http:// or https://")
        self.url, self.api_key, self._run = url, api_key, run
        self.batch_size, self.max_concurrency = batch_size, max_concurrency
        self.timeout_s, self.max_retries, self.backoff_s = timeout_s, max_retries, backoff_s

    @classmethod
    def from_config(cls, cfg: RewardConfig, run: LoopRunner) -> RemoteRewardClient:
        """The client of reward.url, on the loop `run` runs coroutines on; the key is reward.api_key, else $MEGATRON_RL_REWARD_API_KEY."""
        if not cfg.url:
            raise ValueError("reward.type = 'remote' needs reward.url (e.g. http://host:8000/score)")
        return cls(
            cfg.url,
            run,
            api_key=cfg.api_key or os.environ.get(API_KEY_ENV) or None,
            batch_size=cfg.batch_size,
            max_concurrency=cfg.max_concurrency,
            timeout_s=cfg.timeout_s,
            max_retries=cfg.max_retries,
            backoff_s=cfg.retry_backoff_s,
        )

    def check(self) -> None:
        """One empty batch: raises RemoteRewardError when the server cannot be reached (after the
        retries), refuses the key or does not speak the protocol."""
        check = self._with_session(lambda session, slots: self._batch(session, slots, 0, []))
        outcome = self._run(check, self.bound_s(1))
        if isinstance(outcome, Exception):
            raise RemoteRewardError(
                f"reward.url = {self.url!r} cannot be used: {outcome} (is `megatron-rl reward-server` running there?)"
            )

    def score(self, items: Sequence[RewardItem]) -> list[RuleOutput | Exception]:
        """Per item: its output, or the exception that stands for it (a failed or malformed batch)."""
        if not items:
            return []
        starts = range(0, len(items), self.batch_size)

        async def every_batch(session: aiohttp.ClientSession, slots: asyncio.Semaphore) -> list[Any]:
            batches = [self._batch(session, slots, s, items[s : s + self.batch_size]) for s in starts]
            return list(await asyncio.gather(*batches))

        outputs: list[RuleOutput | Exception] = []
        batches = self._run(self._with_session(every_batch), self.bound_s(len(starts)))
        for start, outcome in zip(starts, batches, strict=True):
            size = len(items[start : start + self.batch_size])
            outputs += [outcome] * size if isinstance(outcome, Exception) else outcome
        return outputs

    def bound_s(self, batches: int) -> float:
        """The longest `batches` batches can take: each wave of `max_concurrency` requests with every try's
        timeout and backoff, plus a second for the session."""
        tries = self.max_retries + 1
        one = tries * self.timeout_s + self.backoff_s * (2**tries - 1)
        return math.ceil(batches / self.max_concurrency) * one + 1.0

    async def _with_session(self, body: Any) -> Any:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        headers = {"Content-Type": "application/json"}
        async with client_session(self.api_key, self.max_concurrency, timeout, headers) as session:
            return await body(session, asyncio.Semaphore(self.max_concurrency))

    async def _batch(
        self, session: aiohttp.ClientSession, slots: asyncio.Semaphore, start: int, items: Sequence[RewardItem]
    ) -> list[RuleOutput | Exception] | Exception:
        """The outputs of one batch, or one exception standing for all of them."""
        what = f"responses {start}-{start + len(items) - 1}" if items else "an empty batch"
        label = f"reward server {self.url}, {what}"
        body = encode_request(items)
        async with slots:
            text = await self._post(session, body, label, len(items))
        if isinstance(text, Exception):
            return text
        try:
            return decode_reply(text, len(items), f"{label}: malformed reply")
        except MalformedReplyError as err:
            return err

    async def _post(self, session: aiohttp.ClientSession, body: bytes, label: str, n: int) -> str | Exception:
        async def attempt(_failed: set[str]) -> str:
            try:
                async with session.post(self.url, data=body) as reply:
                    status, text = reply.status, await reply.text()
            except asyncio.TimeoutError:
                raise RetryableFailure(label, f"no reply within reward.timeout_s = {self.timeout_s:g} s") from None
            except aiohttp.ClientError as err:
                raise RetryableFailure(label, connection_failure(err), replied=False) from None
            if status < 300:
                return text
            message = text.strip()[:300]
            if status in (401, 403):
                raise RemoteRewardError(
                    f"{label}: HTTP {status} (the API key is missing or wrong): set reward.api_key "
                    f"or ${API_KEY_ENV} to the server's --api-key"
                )
            if status == 413:
                raise RemoteRewardError(
                    f"{label}: HTTP 413: the request ({len(body)} bytes, {n} responses) is larger than the "
                    "server accepts; lower reward.batch_size or raise the server's --max-request-mb"
                )
            if status not in RETRY_STATUSES:
                raise RemoteRewardError(
                    f"{label}: HTTP {status}: {message} (reward.url must be the server's /score endpoint)"
                )
            raise RetryableFailure(label, f"HTTP {status}: {message}")

        try:
            return await retrying(attempt, RetryPolicy(self.max_retries, self.backoff_s), log)
        except RetriesExhausted as out:
            return RemoteRewardFailure(f"{label}: failed after {out.tries} tries: {out.last.reason}")
