"""One order for every engine: the senders of the distributed mode post to the engines in turns.

SGLang takes a server's weight-update requests one at a time, in arrival order, and blocks inside
each: a group's init until every rank of the group has joined, a distributed update in its
broadcast (NCCL's first broadcast builds the communicator with every rank). Every sender's group
spans every server. Two senders posting at once can reach server 1 in one order and server 2 in the
other; each server then waits in one group for the other server, which waits in the other group.

So a sender posts only while it holds the turn (`EngineTurns.turn`), from its post until every
server has answered (its broadcast done): there is never more than one request at the engines, and
every server takes the requests in the same order, the order in which the turns were taken. The
turns are a FIFO ticket lock in the trainer's store (the default process group's): a sender draws a
ticket, waits until the ticket before its own is done, and hands on by marking its own done.

A turn is asked for with a bucket already exported, and its holder waits for nothing but the
engines, so every turn comes (each holder finishes within its request timeouts), and a sender that
waits for its turn holds its exporter (and the gathers its rank takes part in) only while the turns
ahead of it run. The alternative, one sender at a time with all of its buckets, would hold a waiting
sender's exporter for a whole sync: where that sender's rank takes part in the TP gathers of the
sender holding the token (a stage's non-first TP rank that sends an EP rank's experts, ETP < TP),
the two would wait for each other.

Each phase (the groups' start, each sync, the close) runs its own chain of tickets (`new_round`,
called by every sender in the same order; rank 0 starts the chain), so a chain a failure broke is
never waited on again.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
from collections.abc import Iterator

import torch.distributed as dist

_IDS = itertools.count(1)


class TurnTimeout(TimeoutError):
    """The turn did not come within the wait; the message names the sender that held it."""


class EngineTurns:
    """The turns of one weight sync's senders (see the module docstring). `wait_s` bounds the wait for
    one's turn: as long as every sender ahead may hold it."""

    def __init__(self, wait_s: float) -> None:
        from torch.distributed import distributed_c10d as c10d

        name = [f"megatron-rl-turns-{os.getpid()}-{next(_IDS)}"]
        dist.broadcast_object_list(name, src=0)  # one chain for every rank of this sync
        self.store = c10d.PrefixStore(name[0], c10d._get_default_store())
        self.wait_s = wait_s
        self.round = 0

    def new_round(self) -> None:
        """Start the next phase's chain; every sender calls it at the same point, rank 0 starts it."""
        self.round += 1
        if dist.get_rank() == 0:
            if self.round > 1:  # every sender is past the last round: forget its keys
                last = self.store.add(f"{self.round - 1}/tickets", 0)
                for key in ("tickets", "holder", f"done/{last - 1}"):
                    with contextlib.suppress(RuntimeError):
                        self.store.delete_key(f"{self.round - 1}/{key}")
            self.store.set(f"{self.round}/done/-1", "")

    @contextlib.contextmanager
    def turn(self, who: str) -> Iterator[None]:
        """Hold the turn for the block; raises `TurnTimeout` when it does not come within `wait_s`."""
        ticket = self.store.add(f"{self.round}/tickets", 1) - 1
        before = f"{self.round}/done/{ticket - 1}"
        try:
            self.store.wait([before], datetime.timedelta(seconds=self.wait_s))
        except RuntimeError:  # torch's DistStoreError: the wait timed out
            key = f"{self.round}/holder"
            holder = self.store.get(key).decode() if self.store.check([key]) else "no sender yet"
            raise TurnTimeout(
                f"{who} waited {self.wait_s:.0f} s for its turn to post to the engines; {holder} held it"
            ) from None
        self.store.delete_key(before)
        self.store.set(f"{self.round}/holder", who)
        try:
            yield
        finally:
            self.store.set(f"{self.round}/done/{ticket}", "")
