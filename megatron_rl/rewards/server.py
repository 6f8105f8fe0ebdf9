"""`megatron-rl reward-server`: any reward function over HTTP, so that verifiers run on other machines
(e.g. CPU nodes of a cluster) than the trainer (`reward.type=remote`).

`POST /score` takes and answers the batches of `rewards/protocol.py`; `GET /health` reports the
function and the request counts (`in_flight`, `max_in_flight`, `requests`, `items`). The function runs
in `--workers` processes; each request is split over them. Binds 127.0.0.1 and requires an API key
(`--api-key` or $MEGATRON_RL_REWARD_API_KEY) unless `--no-auth` is given; bodies larger than
`--max-request-mb` get HTTP 413, bodies not received within `--read-timeout-s` HTTP 408, and values
strict JSON refuses (`NaN`, deep nesting, ...) HTTP 400 (`megatron_rl.http`, the start-up and body
checks of the engine server too). A call of the function that runs past `--item-timeout-s` fails its
item, reported with `"timeout": true` (and the worker goes on with the next): the workers are
`rewards/workers.py`'s, as the trainer's for local rules.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from aiohttp import web

from megatron_rl.http.body import READ_TIMEOUT_S, BodyError, parse_json, read_body
from megatron_rl.http.server import (
    add_read_timeout_argument,
    application,
    authorized,
    command_start,
    key_check,
    start,
)
from megatron_rl.rewards.protocol import API_KEY_ENV, SCORE_PATH, RewardItem, decode_request
from megatron_rl.rewards.registry import RewardConfigError, load_reward_function
from megatron_rl.rewards.workers import RewardWorkers

log = logging.getLogger("megatron_rl.reward_server")


class RewardServer:
    """The HTTP front of a pool of worker processes running one reward function."""

    def __init__(
        self,
        spec: str,
        workers: int,
        api_key: str | None,
        max_request_mb: float,
        item_timeout_s: float = 0.0,
        read_timeout_s: float = READ_TIMEOUT_S,
    ) -> None:
        self.spec, self.workers, self.api_key, self.item_timeout_s = spec, workers, api_key, item_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_request_bytes = int(max_request_mb * (1 << 20))
        self.pool = RewardWorkers(
            spec, workers, item_timeout_s, where=f"--function {spec!r}", timeout_name="--item-timeout-s"
        )
        self.requests = self.items = self.in_flight = self.max_in_flight = 0

    def app(self) -> web.Application:
        refusal = {"error": "missing or wrong API key (Authorization: Bearer KEY)"}
        checked = key_check(lambda r: authorized(r, self.api_key), lambda: web.json_response(refusal, status=401))
        app = application(self.max_request_bytes, [checked])
        app.router.add_post(SCORE_PATH, self.score)
        app.router.add_get("/health", self.health)
        return app

    async def score(self, request: web.Request) -> web.Response:
        self.requests += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            try:
                raw = await read_body(request, self.max_request_bytes, "--max-request-mb", self.read_timeout_s)
                body = parse_json(raw)
                items = decode_request(body)
            except BodyError as err:
                return web.json_response({"error": f"bad request: {err}"}, status=err.status)
            except ValueError as err:  # not the protocol's shape
                return web.json_response({"error": f"bad request: {err}"}, status=400)
            self.items += len(items)
            try:
                results = await self._score(items)
            except BrokenProcessPool as err:  # _score started new workers
                log.error("a worker process died (%s); starting new workers", err)
                return web.json_response({"error": f"a worker process died: {err}"}, status=503)
            return web.json_response({"results": results})
        finally:
            self.in_flight -= 1

    async def _score(self, items: list[RewardItem]) -> list[dict[str, Any]]:
        """The items' results, split over the workers; a dead worker raises BrokenProcessPool (new workers start)."""
        if not items:
            return []
        pool, futures = self.pool.submit(items)
        try:
            done = await asyncio.gather(*(asyncio.wrap_future(future) for future in futures))
        except BrokenProcessPool:
            await asyncio.to_thread(self.pool.restart, pool)  # it joins the killed processes: off the event loop
            raise
        return [result.to_json() for chunk in done for result in chunk]

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "status": "ok",
                "function": self.spec,
                "workers": self.workers,
                "requests": self.requests,
                "items": self.items,
                "in_flight": self.in_flight,
                "max_in_flight": self.max_in_flight,
            }
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--function",
        required=True,
        help="the reward function: a built-in rule (dapo, boxed, math_verify) or module:function / path/file.py:function",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0 = any free port)")
    parser.add_argument(
        "--api-key", default=None, help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})"
    )
    parser.add_argument(
        "--no-auth", action="store_true", help="serve without an API key: anyone who reaches the port may use it"
    )
    parser.add_argument("--workers", type=int, default=1, help="processes running the function (default 1)")
    parser.add_argument("--max-request-mb", type=float, default=64.0, help="largest request body in MiB (else 413)")
    parser.add_argument(
        "--item-timeout-s",
        type=float,
        default=60.0,
        help="a call of the function running longer fails that item (0 = no limit; default 60)",
    )
    add_read_timeout_argument(parser)
    parser.add_argument("--port-file", default=None, help="write the bound port to this file once serving")
    parser.add_argument("--log-level", default="info", help="debug, info, warning")


def _argument_problem(args: argparse.Namespace) -> str | None:
    """What makes these arguments unusable, checked before anything starts."""
    if args.workers < 1:
        return f"--workers {args.workers}: must be >= 1"
    if args.max_request_mb <= 0:
        return f"--max-request-mb {args.max_request_mb}: must be > 0"
    if args.item_timeout_s < 0:
        return f"--item-timeout-s {args.item_timeout_s}: must be >= 0 (0 = no limit)"
    if not args.read_timeout_s > 0:
        return f"--read-timeout-s {args.read_timeout_s}: must be > 0"
    try:
        load_reward_function(args.function, f"--function {args.function!r}")  # fail here, not in a worker
    except RewardConfigError as err:
        return str(err)
    return None


def run(args: argparse.Namespace) -> int:
    api_key, refused = command_start("reward-server", args, API_KEY_ENV, _argument_problem, "use it")
    if refused:
        return refused
    server = RewardServer(
        args.function, args.workers, api_key, args.max_request_mb, args.item_timeout_s, args.read_timeout_s
    )
    try:
        asyncio.run(_serve(server, args.host, args.port, args.port_file))
    except KeyboardInterrupt:
        pass
    finally:
        server.pool.close()
    return 0


async def _serve(server: RewardServer, host: str, port: int, port_file: str | None) -> None:
    serving = await start(server.app(), host=host, port=port, read_timeout_s=server.read_timeout_s)
    try:
        serving.write_port(port_file)
        auth = "API key required" if server.api_key else "no API key"
        log.info("serving %s on http://%s:%d%s (%s)", server.spec, host, serving.port, SCORE_PATH, auth)
        await serving.until_stop_signal()
        log.info("shutting down")
    finally:
        await serving.close()
