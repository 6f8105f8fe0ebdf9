"""The one start-up of the package's HTTP servers: the local engine (`megatron-rl serve`), the reward
server (`megatron-rl reward-server`) and the agent gateway.

- `command_start`: a command-line server's arguments checked before anything slow starts (one line,
  exit code 2), its logging, and a warning when it listens beyond this machine without a key.
- The key: `server_api_key` (`--api-key`, else the server's environment variable; required unless
  `--no-auth`), `authorized` (`Authorization: Bearer KEY`, compared in constant time) and
  `key_check`, the first middleware of an app: a refused request is answered by the server's own
  refusal before any other middleware or handler runs, so an unauthenticated body is never read.
- `application`: aiohttp's own body cap one byte past the largest body an endpoint takes, so each
  endpoint's limit (`body.read_body`: 413) answers first.
- `start` (a coroutine: any event loop, any thread) binds 127.0.0.1 unless told otherwise (port 0:
  a free one) and returns a `Serving` handle once the socket listens: its `port` is the bound one.
  A connection that sends no complete request head within `read_timeout_s` of connecting (or of its
  previous answer) is closed (aiohttp's keep-alive timer; its default keeps an idle or half-sent
  connection an hour), and after an answer to a request whose body did not all come (413, 408) the
  rest is awaited at most as long (aiohttp: 10 s).
- `Serving.write_port` (the ready signal of a server started as a child: the port in a file),
  `Serving.until_stop_signal` (SIGTERM or SIGINT, the command-line servers) and `Serving.close`:
  requests still running get `shutdown_timeout_s`, then are cancelled; the whole close is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from aiohttp import web

from megatron_rl.http.body import READ_TIMEOUT_S

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
_LOOPBACK_NAMES = (LOOPBACK, "localhost", "::1")
CLOSE_MARGIN_S = 5.0  # a close's bound beyond the requests' shutdown time: the app's cleanup hooks
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]


def server_api_key(given: str | None, env_name: str, no_auth: bool) -> str | None:
    """The key a server requires: `given` (--api-key), else $`env_name`; None only with `no_auth`.
    ValueError (the line to print) when there is no key without `no_auth`, or a key with it."""
    key = given or os.environ.get(env_name) or None
    if key is None and not no_auth:
        raise ValueError(f"no API key: pass --api-key KEY, set ${env_name}, or serve without one with --no-auth")
    if key is not None and no_auth:
        raise ValueError(f"--no-auth and an API key (--api-key or ${env_name}) contradict each other")
    return key


def exposed_without_key(host: str, api_key: str | None) -> bool:
    """A server bound beyond this machine without a key: worth a warning at start."""
    return api_key is None and host not in _LOOPBACK_NAMES


def add_read_timeout_argument(parser: argparse.ArgumentParser) -> None:
    """`--read-timeout-s`, the `read_timeout_s` of `start` and of the servers' `body.read_body`."""
    parser.add_argument(
        "--read-timeout-s",
        type=float,
        default=READ_TIMEOUT_S,
        help="a connection without a complete request head, or a body not received, within this many seconds is "
        "closed (408 for the body)",
    )


def command_start(
    command: str,
    args: argparse.Namespace,
    env_name: str,
    problem: Callable[[argparse.Namespace], str | None],
    exposure: str,
) -> tuple[str | None, int]:
    """The start of a command-line server (`args`: --api-key, --no-auth, --host, --log-level): its key
    and 0, or (None, 2) after one line naming what makes the arguments unusable (`problem`, checked
    before anything slow starts); then its logging, and a warning of what anyone who reaches an
    exposed port without a key may do (`exposure`)."""
    try:
        api_key = server_api_key(args.api_key, env_name, args.no_auth)
        refused = problem(args)
    except ValueError as err:
        api_key, refused = None, str(err)
    if refused is not None:
        print(f"megatron-rl {command}: {refused}", file=sys.stderr)
        return None, 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if exposed_without_key(args.host, api_key):
        log.warning("serving on %s without an API key: anyone who reaches the port may %s", args.host, exposure)
    return api_key, 0


def authorized(request: web.Request, api_key: str | None) -> bool:
    """`request` carries `Authorization: Bearer api_key` (always true without a key); compared in
    constant time, so the answer's timing does not leak how much of a guess was right."""
    if api_key is None:
        return True
    given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")  # non-UTF-8 bytes too
    return hmac.compare_digest(given, f"Bearer {api_key}".encode())


def key_check(allowed: Callable[[web.Request], bool], refusal: Callable[[], web.Response]) -> Middleware:
    """The middleware that answers `refusal()` to a request `allowed` refuses (put it first)."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not allowed(request):
            return refusal()
        return await handler(request)

    return check


def application(max_body_bytes: int, middlewares: Sequence[Middleware] = ()) -> web.Application:
    """An app whose endpoints read bodies of at most `max_body_bytes` (each its own limit below it)."""
    return web.Application(middlewares=list(middlewares), client_max_size=max_body_bytes + 1)


@dataclass
class Serving:
    """A started server: where it listens, and its close."""

    runner: web.AppRunner
    host: str
    port: int
    shutdown_timeout_s: float

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def write_port(self, path: str | None) -> None:
        """The ready signal of a child server: the bound port, in `path` (when given)."""
        if path:
            with open(path, "w") as handle:
                handle.write(str(self.port))

    async def until_stop_signal(self) -> None:
        """Return at SIGTERM or SIGINT (the main thread's loop only)."""
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()

    async def close(self, timeout_s: float | None = None) -> None:
        """Stop listening, give the requests still running `shutdown_timeout_s`, then cancel them;
        the whole close within `timeout_s` (default: that time and `CLOSE_MARGIN_S`)."""
        bound = self.shutdown_timeout_s + CLOSE_MARGIN_S if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(bound):
                await self.runner.cleanup()
        except TimeoutError:
            log.warning("the server on %s did not close within %.0f s; left behind", self.url, bound)


async def start(
    app: web.Application,
    *,
    host: str = LOOPBACK,
    port: int = 0,
    read_timeout_s: float = READ_TIMEOUT_S,
    shutdown_timeout_s: float = 60.0,
    backlog: int = 128,
    handler_cancellation: bool = False,
) -> Serving:
    """Serve `app` on `host`:`port` from the running event loop; returns once the socket listens.
    `handler_cancellation`: a handler whose client went away is cancelled (aiohttp's default: it runs on)."""
    runner = web.AppRunner(
        app,
        keepalive_timeout=read_timeout_s,
        lingering_time=min(10.0, read_timeout_s),
        handler_cancellation=handler_cancellation,
        shutdown_timeout=shutdown_timeout_s,
        access_log=None,
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, backlog=backlog)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = runner.addresses[0][1]  # the real port when 0 was asked for
    return Serving(runner, host, bound, shutdown_timeout_s)
