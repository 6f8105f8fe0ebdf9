"""Where a weight-update group meets: this machine's address towards the engine, and the trainer's
side of the rendezvous on a thread of its own (the port: `megatron_rl.parallel.launch.free_port`)."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

from megatron_rl.rollout.wire import in_daemon_thread

__all__ = ["in_daemon_thread", "reachable_address"]


def reachable_address(url: str) -> str:
    """This machine's address on the route to the server at `url` (what the server can connect back to)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect(sockaddr)  # UDP: picks the route, sends nothing
        return sock.getsockname()[0]
