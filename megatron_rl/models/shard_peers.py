"""A TP group on one machine's CPUs: its first rank reads the other members' shards in their own memory.

Gloo moves a gathered shard through a loopback TCP socket (about 0.4 GB/s on a shared 2-core
machine: a TP2 export of 248 MB took 0.33 s against 0.025 s at one rank). When every member of the
group holds its parameters on the CPU of one machine, each member instead hands the group's first
rank a handle to the memory its split parameters live in (torch's shared-memory reduction, file-system
strategy: the storage moves into shared memory in place, once, and every view of it, the
parameter and Megatron's buffers, follows), and the first rank copies the shards from there into
the full tensor: one copy, no socket. The handles are taken anew at every export, so a parameter
that moved to new memory since is read where it is now.

What makes that copy cost one memcpy and not several is what the first rank keeps between exports
(`ExportMemory`, one per model): the members' memory stays mapped (mapping it anew costs a page
fault per 4 KiB page on every read), and each full tensor is written into the same buffer as the
last time (new memory of that size costs a fault per page on first touch, several times the copy).
So on that rank a full tensor is valid until the next export of the model, and the split parameters
take twice their memory there (CPU runs: tests and small models).

The members must leave their parameters as they are until the first rank has read them: `close`
(collective over the group, at the end of an export) holds them until then.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import socket
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@contextlib.contextmanager
def file_system_sharing() -> Iterator[None]:
    """torch.multiprocessing's file-system sharing strategy for the duration of the block (unrelated
    processes can open its segments; file descriptors cannot cross unrelated processes)."""
    import torch.multiprocessing as tmp

    previous = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        tmp.set_sharing_strategy(previous)


def _handles(tensors: list[torch.Tensor]) -> bytes:
    """The tensors pickled as handles to their (now shared) memory."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing.reductions  # noqa: F401  (registers the shared-memory reducers)

    buf = io.BytesIO()
    with file_system_sharing():
        ForkingPickler(buf).dump([t.detach() for t in tensors])
    return buf.getvalue()


@dataclass
class ExportMemory:
    """What a TP group's first rank keeps between exports of one model (see the module docstring):
    the members' shards last read (holding their memory mapped) and the full tensors' buffers."""

    views: dict[bool, list[list[torch.Tensor]]] = field(default_factory=dict)  # by is_expert
    full: dict[str, torch.Tensor] = field(default_factory=dict)  # by global parameter name

    def full_buffer(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """The buffer of `name`'s full tensor, the last export's when its shape and dtype still fit."""
        buffer = self.full.get(name)
        if buffer is None or tuple(buffer.shape) != shape or buffer.dtype != like.dtype:
            buffer = self.full[name] = torch.empty(shape, dtype=like.dtype, device=like.device)
        return buffer


_MEMORY: weakref.WeakKeyDictionary[torch.nn.Module, ExportMemory] = weakref.WeakKeyDictionary()


def export_memory(model: torch.nn.Module) -> ExportMemory:
    """`model`'s `ExportMemory` (kept as long as the model lives)."""
    if model not in _MEMORY:
        _MEMORY[model] = ExportMemory()
    return _MEMORY[model]


class PeerShards:
    """The shards of `params` (this rank's split parameters, in the order every member walks them)
    of the group's other members, readable in place on the group's first rank when the whole group
    runs on one machine's CPUs (`shared`); otherwise nothing, and the gather goes through the group.
    Collective over `group` when the model is on the CPU (the same on every rank) and the group has
    more than one member. `memory` is the model's, `expert` says which of its groups this is."""

    def __init__(
        self, group: dist.ProcessGroup, params: list[torch.Tensor], memory: ExportMemory | None, expert: bool
    ) -> None:
        self.group = group
        self.shared = False
        self.memory = memory
        self._views: list[list[torch.Tensor]] = []  # by member 1.., by parameter index (first rank only)
        count = dist.get_world_size(group)
        if count == 1 or memory is None:
            return
        me = dist.get_rank(group)
        payload = _handles(params) if me > 0 and params else b""
        places: list[tuple[str, int, bytes]] = [("", 0, b"")] * count
        dist.all_gather_object(places, (socket.gethostname(), len(params), payload), group=group)
        self.shared = len({host for host, _, _ in places}) == 1
        if self.shared and {n for _, n, _ in places} != {len(params)}:
            raise RuntimeError(
                f"TP group members hold {[n for _, n, _ in places]} split parameters: they must walk the same ones"
            )
        if self.shared and me == 0 and params:
            # unpickled while the last export's views still hold the memory mapped: torch maps it once
            self._views = [pickle.loads(p) for _, _, p in places[1:]]
            memory.views[expert] = self._views

    def of(self, index: int) -> list[torch.Tensor]:
        """The other members' shards of split parameter `index` (first rank of a shared group only)."""
        return [member[index] for member in self._views]

    def close(self) -> None:
        """The end of the export (collective over the group): the first rank has read every shard."""
        self._views = []
        if self.shared:
            dist.barrier(group=self.group)
