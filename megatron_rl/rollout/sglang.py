"""Async client for SGLang servers, an sglang-router, or the local engine (same HTTP API).

- `/generate` with `input_ids` and explicit sampling parameters; log-probs of the output tokens,
  routed experts (base64 int32 [prompt + output - 1, layers, top_k]), the finish reason and the
  weight version of every output token (SGLang's `meta_info.weight_versions` spans, checked to
  cover the output exactly) come back as a `Sample`.
- Concurrency is bounded (`max_concurrency` requests in flight per server); each request goes to
  the server with the fewest in flight. Connection errors and 502/503/504 are retried with
  exponential backoff, on another server when there are several; after the last try one
  `SGLangError` names the server, the endpoint and the request. A 400 is raised at once as
  `BadRequestError` with the server's message, a 401 as `UnauthorizedError`.
- A server that gives `max_retries + 1` connection errors in a row (no reply in between) is dropped
  from the pool with a warning while others remain; when the last one goes, `SGLangError` says that
  none remains. `dead_reason(url)` (set by the owner of a local engine child) turns a connection
  error into `EngineDiedError` at once, without retries, when the server's process has exited.
- Control endpoints (pause, continue, abort, flush, memory, weight updates and the weight-update
  session of SGLang >= 0.5.21, feature-detected) go to every server, with `admin_api_key` when set
  (a server started with `--admin-api-key` accepts only that key there: `ADMIN_PATHS`); the weight
  updates and LoRA adapter calls are `sglang_weights.WeightUpdates`, this client's base.
- `weights_current` (set by the owner of a local engine child, `RolloutEngine`): an asyncio event on
  the client's loop that every /generate attempt, retries included, waits for (at most `timeout_s`).
- `/model_info` and `/server_info`, falling back to the deprecated `/get_model_info` and
  `/get_server_info` (which SGLang 0.5.23 answers with a warning in its log every time) on a 404.
- `token_versions_required` (partial rollouts, set by `sglang_versions.require_versions`): a reply
  without `meta_info.weight_versions` is an error instead of every token taking the reply's one version.
- An sglang-router address: `use_router` (the trainer's engine calls it at start-up) asks each
  address for `GET /workers`, which sglang-router answers with its worker list and a server with
  404. A router then takes every /generate (it balances them), while `urls`, the servers that
  control calls and weight updates reach, become the workers it lists (a router forwards only
  /generate, /health and /flush_cache: a weight update sent to it fails with an empty 404). A request
  for routed experts (R3) goes to the workers directly: sglang-router 0.3.2 rebuilds /generate bodies
  from its own typed request, which drops `return_routed_experts`. The abort of a request that timed
  out through the router goes to every worker (the router answers /abort_request with 404).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import logging
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
import numpy as np

from megatron_rl.http_body import connection_failure
from megatron_rl.rollout.sglang_errors import BadRequestError, EngineDiedError, SGLangError, UnauthorizedError
from megatron_rl.rollout.sglang_weights import WeightUpdates
from megatron_rl.rollout.types import Sample, SamplingParams

log = logging.getLogger(__name__)

RETRY_STATUSES = (502, 503, 504)
# The endpoints this client calls that SGLang 0.5.23 guards with AuthLevel.ADMIN_OPTIONAL: with
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
TOKEN_VERSIONS_SINCE = (0, 5, 19)  # SGLang's meta_info.weight_versions: the version of every output token


def _server_message(text: str) -> str:
    """The human part of an error body: SGLang's {"error": {"message"}}, {"message"}, or the text."""
    import json

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


def token_versions(spans: Any, version: str | None, n_tokens: int, where: str, url: str) -> list[str] | None:
    """One weight version per output token from SGLang's `meta_info.weight_versions` spans
    `[{version, start, end}]`, which must cover tokens [0, n_tokens) in order without a gap or an
    overlap; without spans, `version` (the reply's `weight_version`) for every token (None when the
    server reports neither)."""
    if spans is None:
        return None if version is None else [version] * n_tokens
    try:
        bounds = [(str(s["version"]), int(s["start"]), int(s["end"])) for s in spans]
    except (KeyError, TypeError, ValueError):
        bounds = []
    end = 0
    for _, start, stop in bounds:
        if start != end or stop < start:
            break
        end = stop
    else:
        if bounds and end == n_tokens:
            if len(bounds) == 1:  # the usual reply: one version for the whole response
                return [bounds[0][0]] * n_tokens
            return [v for v, start, stop in bounds for _ in range(stop - start)]
    raise SGLangError(
        f"{where}: meta_info.weight_versions {str(spans)[:500]} do not cover the {n_tokens} output "
        "tokens exactly (contiguous {version, start, end} spans from 0 to the last token)",
        server=url,
    )


def dotted(release: tuple[int, ...]) -> str:
    return ".".join(map(str, release))


class SGLangClient(WeightUpdates):
    """Talks to one or more SGLang-compatible servers; create and close it inside one event loop."""

    def __init__(
        self,
        urls: Sequence[str],
        api_key: str | None = None,
        max_concurrency: int = 64,
        timeout_s: float = 600.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        connect_timeout_s: float = 10.0,
        routed_experts_layout: tuple[int, int] | None = None,
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
        self.routed_experts_layout = routed_experts_layout
        self.lora_path: str | None = None  # the adapter every /generate names (LoRA runs: the current policy)
        self.router: str | None = None  # set by `use_router`: where /generate goes instead of `urls`
        self._in_flight = dict.fromkeys(self.urls, 0)
        self._order = itertools.count()
        self._session: aiohttp.ClientSession | None = None
        self._slots: asyncio.Semaphore | None = None
        self._sessions: set[str] = set()  # servers with a weight-update session open
        self.dead_reason: Callable[[str], str | None] | None = None  # why `url` is gone for good, if it is
        self.replies = 0  # HTTP replies received (any status): the stall watch sees progress by it
        self._unreachable: dict[str, tuple[int, float]] = {}  # connection errors in a row, since when
        self.dropped: list[str] = []  # servers dropped from the pool as unreachable
        self.server_versions: dict[str, str] = {}  # what each server reports (`sglang_versions`)
        self.token_versions_required = False  # a reply without meta_info.weight_versions is an error
        self._old_info_paths: set[str] = set()  # servers without /model_info and /server_info (404)
        # cleared by the engine's owner from a restart until its resync: every /generate attempt waits for it
        self.weights_current: asyncio.Event | None = None
        self.waiting_for_weights = 0  # /generate attempts waiting for it now

    # ---- lifecycle ----
    async def start(self) -> None:
        if self._session is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            connector = aiohttp.TCPConnector(limit=self.max_concurrency * len(self.urls) + 16)
            self._session = aiohttp.ClientSession(headers=headers, connector=connector)
            self._slots = asyncio.Semaphore(self.max_concurrency * len(self.urls))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> SGLangClient:
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

    # ---- transport ----
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
        assert self._session is not None
        tries = self.max_retries + 1 if retry else 1
        failed: set[str] = set()
        last = ""
        label = f"{method} {path}" + (f" ({what})" if what else "")
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s, sock_connect=self.connect_timeout_s)
        admin = self.admin_api_key is not None and path in ADMIN_PATHS
        headers = {"Authorization": f"Bearer {self.admin_api_key}"} if admin else None
        for attempt in range(tries):
            if gated:
                await self._await_weights_current(label)
            url = server or self._pick(failed, direct)
            self._in_flight[url] = self._in_flight.get(url, 0) + 1
            try:
                async with self._session.request(
                    method, url + path, json=body, timeout=timeout, headers=headers
                ) as resp:
                    text = await resp.text()
                    status = resp.status
            except asyncio.TimeoutError:
                raise SGLangError(f"{label} to {url} timed out after {timeout.total:.0f} s", server=url) from None
            except aiohttp.ClientError as err:
                status, text = None, ""
                last = connection_failure(err)
            finally:
                self._in_flight[url] -= 1
            if status is None:
                reason = self.dead_reason(url) if self.dead_reason is not None else None
                if reason is not None:
                    raise EngineDiedError(f"{label} to {url}: {reason}", server=url) from None
                self._connection_failed(url, last)
            else:
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
                last = f"HTTP {status}: {message}"
            failed.add(url)
            if attempt + 1 < tries:
                delay = self.backoff_s * 2**attempt
                log.warning("%s to %s failed (%s); try %d of %d in %.1f s", label, url, last, attempt + 2, tries, delay)
                await asyncio.sleep(delay)
        gone = ""
        if status is None and server is None and set(self.urls) <= failed:  # every server of the pool refused
            dropped = f"; dropped before as unreachable: {', '.join(self.dropped)}" if self.dropped else ""
            gone = f"; no rollout server is reachable (none of {', '.join(self.urls)} answered{dropped})"
        raise SGLangError(f"{label} failed after {tries} tries; last server {url}: {last}{gone}", server=url)

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
        window = self.backoff_s * (2**self.max_retries - 1)
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
        import json

        url, _, text = await self._call(method, path, body, **kwargs)
        try:
            return json.loads(text) if text.strip() else None
        except ValueError:
            raise SGLangError(f"{method} {path} to {url}: the reply is not JSON: {text[:200]!r}", server=url) from None

    async def _each(self, method: str, path: str, body: Any = None, retry: bool = True, **kwargs: Any) -> list[Any]:
        """The same call to every server, concurrently; results in `urls` order."""
        calls = [self._json(method, path, body, server=url, retry=retry, **kwargs) for url in self.urls]
        return list(await asyncio.gather(*calls))

    # ---- generation ----
    def generate_body(
        self,
        input_ids: Sequence[int],
        params: SamplingParams,
        rid: str,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
    ) -> dict[str, Any]:
        """The /generate body for one prompt (explicit sampling parameters, output log-probs)."""
        body: dict[str, Any] = {
            "rid": rid,
            "input_ids": [int(t) for t in input_ids],
            "sampling_params": params.to_sglang(),
            "return_logprob": return_logprob,
            "logprob_start_len": -1,
            "stream": False,
        }
        if return_routed_experts:
            body["return_routed_experts"] = True
        if self.lora_path is not None:
            body["lora_path"] = self.lora_path
        return body

    async def generate(
        self,
        input_ids: Sequence[int],
        params: SamplingParams,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
        rid: str | None = None,
    ) -> Sample:
        """Generate one response for one prompt."""
        if not input_ids:
            raise ValueError("input_ids must not be empty")
        rid = rid or uuid.uuid4().hex
        body = self.generate_body(input_ids, params, rid, return_logprob, return_routed_experts)
        await self.start()
        assert self._slots is not None
        async with self._slots:
            try:
                url, _, text = await self._call(
                    "POST", "/generate", body, what=f"rid={rid}", direct=return_routed_experts, gated=True
                )
            except SGLangError as err:
                if "timed out" in str(err) and err.server:
                    await self._quiet_abort(err.server, rid)
                raise
        return self._sample(url, rid, list(input_ids), text, return_logprob, return_routed_experts)

    async def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        return_logprob: bool = True,
        return_routed_experts: bool = False,
        done: dict[int, Sample] | None = None,
    ) -> list[Sample]:
        """One response per prompt, in prompt order; requests run concurrently within the bound.
        `params`: shared, or one per prompt. `done` receives each sample by prompt index as soon as
        it is complete, so that after a failure only the unfinished requests need to be sent again."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"generate_batch: {len(per_prompt)} sampling params for {len(prompts)} prompts")

        async def one(index: int, prompt: Sequence[int], sp: SamplingParams) -> Sample:
            sample = await self.generate(prompt, sp, return_logprob, return_routed_experts)
            if done is not None:
                done[index] = sample
            return sample

        tasks = [
            asyncio.ensure_future(one(i, p, sp)) for i, (p, sp) in enumerate(zip(prompts, per_prompt, strict=True))
        ]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _quiet_abort(self, url: str, rid: str) -> None:
        """Abort `rid` where it runs: on `url`, or on every worker when `url` is the router."""

        async def one(server: str) -> None:
            try:
                await self._call("POST", "/abort_request", {"rid": rid}, server=server, retry=False, timeout_s=10)
            except SGLangError as err:
                log.warning("could not abort %s on %s: %s", rid, server, err)

        await asyncio.gather(*(one(u) for u in (self.urls if url == self.router else [url])))

    def _sample(self, url: str, rid: str, prompt: list[int], text: str, want_lp: bool, want_routed: bool) -> Sample:
        import json

        where = f"/generate rid={rid} on {url}"
        try:
            reply = json.loads(text)
            meta = reply["meta_info"]
            output_ids = [int(t) for t in reply["output_ids"]]
        except (ValueError, KeyError, TypeError) as err:
            raise SGLangError(f"{where}: malformed reply ({err}): {text[:200]!r}", server=url) from None
        finish = meta.get("finish_reason") or {}
        kind = finish.get("type") if isinstance(finish, dict) else None
        if kind not in ("stop", "length", "abort"):
            raise SGLangError(f"{where}: unexpected finish_reason {finish!r}", server=url)
        logprobs = None
        if want_lp:
            entries = meta.get("output_token_logprobs")
            if entries is None or len(entries) != len(output_ids):
                n = None if entries is None else len(entries)
                raise SGLangError(f"{where}: {n} output log-probs for {len(output_ids)} output tokens", server=url)
            if any(int(e[1]) != t for e, t in zip(entries, output_ids, strict=True)):
                raise SGLangError(f"{where}: output log-probs do not follow output_ids", server=url)
            logprobs = [float(e[0]) for e in entries]
        routed = None
        if want_routed and meta.get("routed_experts") is not None:
            routed = self._decode_routed(meta["routed_experts"], len(prompt) + len(output_ids) - 1, where, url)
        version = meta.get("weight_version")
        version = None if version is None else str(version)
        if self.token_versions_required and meta.get("weight_versions") is None:
            runs = ", ".join(f"{u}: {v}" for u, v in self.server_versions.items()) or "unknown versions"
            raise SGLangError(
                f"{where}: no meta_info.weight_versions in the reply, and rollout.partial_rollout = true needs "
                f"the weight version of every token (SGLang >= {dotted(TOKEN_VERSIONS_SINCE)}; the servers "
                f"report {runs}); upgrade them or set rollout.partial_rollout=false",
                server=url,
            )
        return Sample(
            prompt_ids=prompt,
            output_ids=output_ids,
            logprobs=logprobs,
            finish_reason=kind,
            matched_stop=finish.get("matched"),
            routed_experts=routed,
            weight_version=version,
            weight_versions=token_versions(meta.get("weight_versions"), version, len(output_ids), where, url),
            rid=rid,
            server=url,
            meta_info=meta,
        )

    def _decode_routed(self, encoded: str, tokens: int, where: str, url: str) -> np.ndarray:
        flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
        if self.routed_experts_layout is None:
            raise SGLangError(
                f"{where}: cannot shape routed experts: call load_model_layout() or pass "
                "routed_experts_layout=(num_hidden_layers, num_experts_per_tok)",
                server=url,
            )
        layers, top_k = self.routed_experts_layout
        if flat.size != tokens * layers * top_k:
            raise SGLangError(
                f"{where}: routed experts hold {flat.size} ids, expected {tokens} tokens x {layers} layers x {top_k}",
                server=url,
            )
        return flat.reshape(tokens, layers, top_k)

    async def load_model_layout(self) -> tuple[int, int] | None:
        """Read (num_hidden_layers, num_experts_per_tok) from /model_info when the server reports it."""
        info = await self.get_model_info()
        if "num_hidden_layers" in info and info.get("num_experts_per_tok"):
            self.routed_experts_layout = (int(info["num_hidden_layers"]), int(info["num_experts_per_tok"]))
        return self.routed_experts_layout

    # ---- control (every server) ----
    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        await self._each("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    async def pause_generation(self, mode: str = "abort") -> None:
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"mode {mode!r}: allowed abort, retract, in_place")
        await self._each("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._each("POST", "/continue_generation", {})

    async def flush_cache(self) -> None:
        for url in self.urls:
            await self._call("POST", "/flush_cache", None, server=url)

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self._each("POST", "/release_memory_occupation", {"tags": tags})

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self._each("POST", "/resume_memory_occupation", {"tags": tags})

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
