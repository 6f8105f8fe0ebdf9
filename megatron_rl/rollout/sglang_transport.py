"""The servers an SGLang client talks to (SGLang servers, an sglang-router, or the local engine: same
HTTP API), and how one request reaches them; the base of the generation client (`sglang.py`) and of
the weights client (`sglang_weights.py`).

- Concurrency is bounded (`max_concurrency` requests in flight per server); each request goes to
  the server with the fewest in flight. Connection errors and 502/503/504 are retried with
  exponential backoff (`megatron_rl.http.client`'s policy), on another server when there are several;
  after the last try one `SGLangError` names the server, the endpoint and the request. A 400 is raised
  at once as `BadRequestError` with the server's message, a 401 as `UnauthorizedError`, a timeout
  (`timeout_s`) as `SGLangError`.
- A server that gives `max_retries + 1` connection errors in a row (no reply in between) is dropped
  from the pool with a warning while others remain; when the last one goes, `SGLangError` says that
  none remains. `dead_reason(url)` (set by the owner of a local engine child) turns a connection
  error into `EngineDiedError` at once, without retries, when the server's process has exited.
- Control endpoints go to every server (`_each`), with `admin_api_key` when set (a server started
  with `--admin-api-key` accepts only that key there: `ADMIN_PATHS`).
- `weights_current` (set by the owner of a local engine child, `RolloutEngine`): an asyncio event on
  the client's loop that every gated attempt (each /generate, retries included) waits for (at most
  `timeout_s`).
- `/model_info` and `/server_info`, falling back to the deprecated `/get_model_info` and
  `/get_server_info` (which SGLang 0.5.23 answers with a warning in its log every time) on a 404.
- An sglang-router address: `use_router` (the trainer's engine calls it at start-up) asks each
  address for `GET /workers`, which sglang-router answers with its worker list and a server with
  404. A router then takes every /generate (it balances them), while `urls`, the servers that
  control calls and weight updates reach, become the workers it lists (a router forwards only
  /generate, /health and /flush_cache: a weight update sent to it fails with an empty 404). A request
  for routed experts (R3) goes to the workers directly (`direct`): sglang-router 0.3.2 rebuilds
  /generate bodies from its own typed request, which drops `return_routed_experts`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any, Self

import aiohttp

from megatron_rl.http.client import (
    RetriesExhausted,
    RetryableFailure,
    RetryPolicy,
    bearer,
    client_session,
    connection_failure,
    retrying,
)
from megatron_rl.rollout.sglang_errors import BadRequestError, EngineDiedError, SGLangError, UnauthorizedError

log = logging.getLogger("megatron_rl.rollout.sglang")  # one logger for the client's three modules

RETRY_STATUSES = (502, 503, 504)
# The endpoints the client calls that SGLang 0.5.23 guards with AuthLevel.ADMIN_OPTIONAL: with
# --admin-api-key set, only that key opens them (checked against the wheel by tests/test_sglang_compat.py).
ADMIN_PATHS = frozenset(
    {
        "/abort_request",
        "/pause_generation",
        "/continue_generation",
        "/flush_cache",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/update_weights_from_disk",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/update_weights_from_distributed",
        "/update_weights_from_tensor",
        "/begin_weight_update",
        "/end_weight_update",
        "/get_weights_by_name",
        "/load_lora_adapter",
        "/load_lora_adapter_from_tensors",
        "/unload_lora_adapter",
        "/update_weight_version",
    }
)


def _server_message(text: str) -> str:
    """The human part of an error body: SGLang's {"error": {"message"}}, {"message"}, or the text."""
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip()[:2000]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        if "message" in body:
            return str(body["message"])
        if "detail" in body:
            return str(body["detail"])
    return text.strip()[:2000]


class SGLangTransport:
    """One or more SGLang-compatible servers and the requests to them; create and close it inside one
    event loop."""

    def __init__(
        self,
        urls: Sequence[str],
        api_key: str | None = None,
        max_concurrency: int = 64,
        timeout_s: float = 600.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        connect_timeout_s: float = 10.0,
        admin_api_key: str | None = None,
    ):
        if not urls:
            raise ValueError("SGLangClient needs at least one server address")
        self.urls = [u.rstrip("/") for u in urls]
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"server address {url!r} must start with http:// or https://")
        self.api_key, self.admin_api_key = api_key, admin_api_key
        self.max_concurrency, self.timeout_s = max_concurrency, timeout_s
        self.max_retries, self.backoff_s, self.connect_timeout_s = max_retries, backoff_s, connect_timeout_s
        self.router: str | None = None  # set by `use_router`: where /generate goes instead of `urls`
        self._in_flight = dict.fromkeys(self.urls, 0)
        self._order = itertools.count()
        self._session: aiohttp.ClientSession | None = None
        self._slots: asyncio.Semaphore | None = None
        self.dead_reason: Callable[[str], str | None] | None = None  # why `url` is gone for good, if it is
        self.replies = 0  # HTTP replies received (any status): the stall watch sees progress by it
        self._unreachable: dict[str, tuple[int, float]] = {}  # connection errors in a row, since when
        self.dropped: list[str] = []  # servers dropped from the pool as unreachable
        self._old_info_paths: set[str] = set()  # servers without /model_info and /server_info (404)
        # cleared by the engine's owner from a restart until its resync: every gated attempt waits for it
        self.weights_current: asyncio.Event | None = None
        self.waiting_for_weights = 0  # gated attempts waiting for it now

    # ---- lifecycle ----
    async def start(self) -> None:
        if self._session is None:
            self._session = client_session(self.api_key, self.max_concurrency * len(self.urls) + 16)
            self._slots = asyncio.Semaphore(self.max_concurrency * len(self.urls))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # ---- router discovery ----
    async def use_router(self) -> str | None:
        """If an address is an sglang-router, generate through it and control its workers; returns it.

        Raises SGLangError naming the address when a router lists no worker, lists workers this
        machine cannot reach, or is given next to other addresses, and what to pass instead.
        """
        found = {url: await self._router_workers(url) for url in self.urls}
        routers = {url: workers for url, workers in found.items() if workers is not None}
        if not routers:
            return None
        router, workers = next(iter(routers.items()))
        if len(self.urls) > 1:
            raise SGLangError(
                f"rollout.sglang_urls {self.urls}: {router} is an sglang-router; give the router alone "
                "(its workers are found through GET /workers) or only the servers' own addresses",
                server=router,
            )
        instead = "pass the servers' own addresses in rollout.sglang_urls instead of the router's"
        if not workers:
            raise SGLangError(f"sglang-router {router} lists no worker (GET /workers); {instead}", server=router)
        workers = [w.rstrip("/") for w in workers]
        unreachable = [w for w, ok in (await self._reachable(workers)).items() if not ok]
        if unreachable:
            raise SGLangError(
                f"sglang-router {router} lists workers {workers}, but {unreachable} do not answer /health from "
                f"this machine (weight updates must reach every worker); {instead}, as this machine reaches them",
                server=router,
            )
        self.router, self.urls = router, workers
        self._in_flight = dict.fromkeys([router, *workers], 0)
        await self.close()  # nothing is in flight yet: start again with `max_concurrency` per worker
        await self.start()
        return router

    async def _router_workers(self, url: str) -> list[str] | None:
        """The worker URLs sglang-router at `url` lists, or None when `url` is not a router (404)."""
        try:
            reply = await self._json("GET", "/workers", server=url, retry=False, timeout_s=30)
        except SGLangError as err:
            if err.status == 404:
                return None
            raise
        entries = reply.get("workers") if isinstance(reply, dict) else None
        if not isinstance(entries, list) or not all(isinstance(e, dict) and "url" in e for e in entries):
            raise SGLangError(
                f"GET /workers on {url}: not sglang-router's worker list ({str(reply)[:200]!r}); "
                "pass the servers' own addresses in rollout.sglang_urls",
                server=url,
            )
        return [str(e["url"]) for e in entries]

    async def _reachable(self, urls: Sequence[str]) -> dict[str, bool]:
        async def one(url: str) -> bool:
            try:
                await self._call("GET", "/health", server=url, retry=False, timeout_s=30)
                return True
            except SGLangError:
                return False

        return dict(zip(urls, await asyncio.gather(*(one(u) for u in urls)), strict=True))

    # ---- one request ----
    def _pick(self, exclude: set[str], direct: bool) -> str:
        """The least busy target (`direct`: a server itself, never the router) not in `exclude`."""
        targets = [self.router] if self.router is not None and not direct else self.urls
        candidates = [u for u in targets if u not in exclude] or targets
        tick = next(self._order)
        return min(candidates, key=lambda u: (self._in_flight[u], (targets.index(u) - tick) % len(targets)))

    async def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        server: str | None = None,
        retry: bool = True,
        what: str = "",
        timeout_s: float | None = None,
        direct: bool = False,
        gated: bool = False,
    ) -> tuple[str, int, str]:
        """Send one request (to `server`, or the least busy one: a server itself with `direct`, else
        the router when there is one); returns (server, status, body text). `gated`: each attempt,
        retries included, first waits for `weights_current`."""
        await self.start()
        label = f"{method} {path}" + (f" ({what})" if what else "")
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s, sock_connect=self.connect_timeout_s)
        admin = self.admin_api_key is not None and path in ADMIN_PATHS
        headers = bearer(self.admin_api_key) if admin else None

        async def attempt(failed: set[str]) -> tuple[str, int, str]:
            if gated:
                await self._await_weights_current(label)
            url = server or self._pick(failed, direct)
            self._in_flight[url] = self._in_flight.get(url, 0) + 1
            assert self._session is not None
            try:
                request = self._session.request(method, url + path, json=body, timeout=timeout, headers=headers)
                async with request as resp:
                    text = await resp.text()
                    status = resp.status
            except asyncio.TimeoutError:
                raise SGLangError(f"{label} to {url} timed out after {timeout.total:.0f} s", server=url) from None
            except aiohttp.ClientError as err:
                reason = connection_failure(err)
                dead = self.dead_reason(url) if self.dead_reason is not None else None
                if dead is not None:
                    raise EngineDiedError(f"{label} to {url}: {dead}", server=url) from None
                self._connection_failed(url, reason)
                raise RetryableFailure(f"{label} to {url}", reason, url, replied=False) from None
            finally:
                self._in_flight[url] -= 1
            self.replies += 1
            self._unreachable.pop(url, None)
            if status < 400:
                return url, status, text
            message = _server_message(text)
            if status == 400:
                raise BadRequestError(f"{label} rejected by {url} (HTTP 400): {message}", url, status)
            if status == 401:
                hint = ""
                if path in ADMIN_PATHS and not admin:
                    hint = "; a server started with --admin-api-key takes only that key here: set rollout.admin_api_key"
                raise UnauthorizedError(f"{label} to {url}: HTTP 401 (missing or wrong API key){hint}", url, status)
            if status not in RETRY_STATUSES:
                raise SGLangError(f"{label} to {url} failed with HTTP {status}: {message}", url, status)
            raise RetryableFailure(f"{label} to {url}", f"HTTP {status}: {message}", url)

        try:
            return await retrying(attempt, RetryPolicy(self.max_retries if retry else 0, self.backoff_s), log)
        except RetriesExhausted as out:
            exhausted = out
        last, url = exhausted.last, exhausted.last.target
        gone = ""
        if not last.replied and server is None and set(self.urls) <= exhausted.failed:  # no server of the pool answered
            dropped = f"; dropped before as unreachable: {', '.join(self.dropped)}" if self.dropped else ""
            gone = f"; no rollout server is reachable (none of {', '.join(self.urls)} answered{dropped})"
        tries = exhausted.tries
        raise SGLangError(f"{label} failed after {tries} tries; last server {url}: {last.reason}{gone}", server=url)

    async def _await_weights_current(self, label: str) -> None:
        """Hold an attempt while the engine's weights are not current, for at most `timeout_s`."""
        gate = self.weights_current
        if gate is None or gate.is_set():
            return
        self.waiting_for_weights += 1
        try:
            await asyncio.wait_for(gate.wait(), self.timeout_s)
        except asyncio.TimeoutError:
            raise SGLangError(
                f"{label}: the restarted engine's weights were not current within {self.timeout_s:.0f} s "
                "(rollout.request_timeout_s): its resync did not end"
            ) from None
        finally:
            self.waiting_for_weights -= 1

    def _connection_failed(self, url: str, error: str) -> None:
        """Count a connection error of `url`; once it has failed `max_retries + 1` times in a row over
        at least the retry window, drop it from the pool (a warning) while other servers remain."""
        count, since = self._unreachable.get(url, (0, asyncio.get_running_loop().time()))
        self._unreachable[url] = (count + 1, since)
        window = RetryPolicy(self.max_retries, self.backoff_s).total_wait_s()
        lasted = asyncio.get_running_loop().time() - since
        if count + 1 <= self.max_retries or lasted < window or url not in self.urls or len(self.urls) == 1:
            return
        self.urls.remove(url)
        self.dropped.append(url)
        log.warning(
            "dropping %s from the rollout servers: %d connection errors in a row over %.1f s (last: %s); %d remain: %s",
            url,
            count + 1,
            lasted,
            error,
            len(self.urls),
            ", ".join(self.urls),
        )

    def in_flight(self) -> dict[str, int]:
        """Requests in flight per server (those with any)."""
        return {url: n for url, n in self._in_flight.items() if n}

    async def _json(self, method: str, path: str, body: Any = None, **kwargs: Any) -> Any:
        url, _, text = await self._call(method, path, body, **kwargs)
        try:
            return json.loads(text) if text.strip() else None
        except ValueError:
            raise SGLangError(f"{method} {path} to {url}: the reply is not JSON: {text[:200]!r}", server=url) from None

    async def _each(self, method: str, path: str, body: Any = None, retry: bool = True, **kwargs: Any) -> list[Any]:
        """The same call to every server, concurrently; results in `urls` order."""
        calls = [self._json(method, path, body, server=url, retry=retry, **kwargs) for url in self.urls]
        return list(await asyncio.gather(*calls))

    # ---- health and info ----
    async def health(self) -> dict[str, bool]:
        """Each server's /health (200 = healthy); never raises."""
        return await self._reachable(self.urls)

    async def wait_healthy(self, timeout_s: float = 300.0, interval_s: float = 0.5) -> None:
        """Wait until every server answers /health with 200."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            status = await self.health()
            if all(status.values()):
                return
            if asyncio.get_running_loop().time() > deadline:
                down = [u for u, ok in status.items() if not ok]
                raise SGLangError(f"servers not healthy after {timeout_s:.0f} s: {down}", server=down[0])
            await asyncio.sleep(interval_s)

    async def get_model_info(self) -> dict[str, Any]:
        """The first server's /model_info (`weight_version`, `model_path`, ...)."""
        return await self._info("model_info", self.urls[0])

    async def get_server_info(self, url: str) -> dict[str, Any]:
        """`url`'s /server_info (`version`, `internal_states`, ...)."""
        return await self._info("server_info", url)

    async def _info(self, name: str, url: str) -> Any:
        """GET /`name` on `url`, or the deprecated /get_`name` where it is missing (404: older SGLang)."""
        if url not in self._old_info_paths:
            try:
                return await self._json("GET", f"/{name}", server=url)
            except SGLangError as err:
                if err.status != 404:
                    raise
                self._old_info_paths.add(url)
        return await self._json("GET", f"/get_{name}", server=url)
