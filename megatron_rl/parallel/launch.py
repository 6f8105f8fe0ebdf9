"""Who am I in the job: rank, world size and rendezvous address from torchrun or Slurm variables."""

from __future__ import annotations

import dataclasses
import os
import random
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
_SLURM = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT")


class LaunchError(RuntimeError):
    """The process was not started by a launcher this package understands."""


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun" or "slurm"


def _int(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"environment variable {name}={value!r} is not an integer") from None


def read_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Rank, world size, local rank and MASTER_ADDR/PORT; torchrun variables win over Slurm's."""
    env = os.environ if environ is None else environ
    if any(name in env for name in _TORCHRUN[:2]):
        names, source = _TORCHRUN, "torchrun"
        missing = [n for n in _TORCHRUN[:2] if n not in env]
    elif any(name in env for name in _SLURM[:2]):
        names, source = _SLURM, "slurm"
        missing = [n for n in _SLURM[:2] if n not in env]
    else:
        raise LaunchError(
            "no launcher variables: start with torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, "
            "MASTER_PORT) or srun (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID plus MASTER_ADDR, MASTER_PORT)"
        )
    missing += [n for n in _RENDEZVOUS if n not in env]
    if missing:
        raise LaunchError(f"launched by {source} but {', '.join(missing)} is not set")
    rank, world_size = _int(env, names[0]), _int(env, names[1])
    local_rank = _int(env, names[2]) if names[2] in env else rank
    if world_size < 1 or not 0 <= rank < world_size:
        raise LaunchError(f"{names[0]}={rank} is not a rank of {names[1]}={world_size}")
    port = _int(env, "MASTER_PORT")
    if not 0 < port < 65536:
        raise LaunchError(f"MASTER_PORT={port} is not a TCP port")
    return LaunchEnv(rank, world_size, local_rank, env["MASTER_ADDR"], port, source)


def launch_rank() -> int:
    """This process's global rank by its launcher's variables (torchrun's, else Slurm's); 0 when not launched."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))


def ensure_launch_env() -> None:
    """A process started without torchrun/srun gets the variables of a world of one (a free local port)."""
    if any(v in os.environ for v in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")):
        return
    global _picked_port
    _picked_port = free_port()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_picked_port))


_picked_port: int | None = None  # the MASTER_PORT ensure_launch_env chose for this process's world of one


def repick_port(env: LaunchEnv) -> LaunchEnv | None:
    """`env` with another free port when it is the world of one whose MASTER_PORT `ensure_launch_env` chose (a port
    free when chosen can be bound by another process before the rendezvous binds it: EADDRINUSE); MASTER_PORT
    follows. None for a launcher's port (torchrun's, Slurm's), which every rank must agree on."""
    global _picked_port
    if env.world_size != 1 or _picked_port is None or env.master_port != _picked_port:
        return None
    _picked_port = free_port()
    os.environ["MASTER_PORT"] = str(_picked_port)
    return dataclasses.replace(env, master_port=_picked_port)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on at `host` right now, drawn below the kernel's ephemeral range: the ports the
    kernel hands out itself (to a bind to port 0, to every outgoing connection: gloo's, HTTP clients') cannot take
    it between this choice and its bind, as one of them took an ephemeral choice on a busy machine (EADDRINUSE).
    The kernel's own pick where no port below its range is free."""
    lowest_ephemeral = _lowest_ephemeral_port()
    below = range(_LOWEST_DRAWN_PORT, lowest_ephemeral)
    for port in random.SystemRandom().sample(below, min(64, len(below))):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


_LOWEST_DRAWN_PORT = 10000  # above the ports services commonly listen on


def _lowest_ephemeral_port() -> int:
    """The low end of the kernel's ephemeral port range (Linux's default, 32768, where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
