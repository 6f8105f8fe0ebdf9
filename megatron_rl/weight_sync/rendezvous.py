"""Where a weight-update group meets: this machine's address towards the engine, and the trainer's
side of the rendezvous on a thread of its own (the port: `megatron_rl.parallel.launch.free_port`)."""

from __future__ import annotations

import socket
import threading
from concurrent.futures import Future
from typing import Any
from urllib.parse import urlsplit


def reachable_address(url: str) -> str:
    """This machine's address on the route to the server at `url` (what the server can connect back to)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect(sockaddr)  # UDP: picks the route, sends nothing
        return sock.getsockname()[0]


def in_daemon_thread(fn: Any, *args: Any) -> Future:
    """Run `fn(*args)` on a daemon thread (a rendezvous that never completes must not block exit)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as err:  # noqa: BLE001 - handed to the waiting caller
            future.set_exception(err)

    threading.Thread(target=run, name="weight-update-group", daemon=True).start()
    return future
