"""`rollout.weight_sync = distributed`: each sender broadcasts its buckets over a group of its own.

Every export sender (`senders.py`: one per pipeline stage and, with EP, per expert-parallel rank)
builds its own weight-update group with every engine rank, once, when the sync is made, the way
SGLang builds its side (`rollout/wire.py: init_weights_update_group`): the sender is rank 0 of its
group (it hosts the rendezvous store), engine server i holds ranks 1 + i * rollout.engine_gpus
onwards, and the group is named after the sender (`megatron-rl-<pid>-pp<stage>-ep<rank>-<n>`), so an
engine holds one group per sender, as SGLang keys them by `group_name`. The backend is nccl when the
model is on a GPU and gloo otherwise. For every bucket, the sender first posts
`/update_weights_from_distributed` (names, dtypes, shapes, its group's name) asynchronously, then
broadcasts. A bucket of one dtype goes as one flattened uint8 buffer over NCCL; otherwise it goes
tensor by tensor. The new version and the cache flush go with the controller's last bucket, after
every sender is done (`senders.FromSenders`). Every request a sender posts (its group's init and
destroy, each bucket) goes in its turn (`turns.py`), so that every engine takes them in one order.

After any failure the group is dropped and the next sync builds a new one. A refusal does not
tell whether the engine took the broadcast (the local engine receives, then validates) or never
joined it (an unknown group, a malformed request, while a small broadcast still "completes" into
the socket buffer), so the group may be out of step. A group with a broadcast still pending is
only abandoned, not destroyed, because destroying it would wait for the stuck peer.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import Any

import torch.distributed as dist

from megatron_rl.parallel.launch import free_port
from megatron_rl.rollout.wire import destroy_weights_update_group, init_weights_update_group
from megatron_rl.weight_sync.base import ENGINE_ERRORS, WeightSyncError, all_outcomes
from megatron_rl.weight_sync.packing import Bucket, broadcasts_flat
from megatron_rl.weight_sync.rendezvous import in_daemon_thread, reachable_address
from megatron_rl.weight_sync.send import broadcast_named_tensors, tensor_specs
from megatron_rl.weight_sync.senders import FromSenders, params_device
from megatron_rl.weight_sync.turns import EngineTurns, TurnTimeout

log = logging.getLogger("megatron_rl.weight_sync")
_GROUP_IDS = itertools.count(1)  # group names stay unique within a process


def _refusal(reply: Future, wait_s: float) -> str | None:
    """The engine's error for a pending update call, if it fails within `wait_s`."""
    try:
        reply.result(timeout=wait_s)
    except (TimeoutError, concurrent.futures.TimeoutError):
        return None
    except ENGINE_ERRORS as err:
        return str(err)
    return None


class DistributedSync(FromSenders):
    mode = "distributed"
    needs_session = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.backend = "nccl" if params_device(self.chunks).type == "cuda" else "gloo"
        if self.backend == "nccl" and self.cfg.rollout.colocate:
            super().close()
            raise WeightSyncError(
                "rollout.weight_sync = distributed with rollout.colocate = true on GPUs: a trainer sender and an "
                "engine rank share a GPU, and NCCL refuses a communicator holding one GPU twice; use "
                "rollout.weight_sync=tensor (engines on rank 0's node) or rollout.weight_sync=disk"
            )
        self.engine_ranks = int(self.cfg.rollout.engine_gpus)
        self._group: dist.ProcessGroup | None = None
        self._group_name = ""
        self._abandoned: list[dist.ProcessGroup] = []
        # a turn waits while each sender ahead posts one request: its broadcast and its reply, each bounded
        self.turns = EngineTurns(wait_s=len(self.senders) * (2 * self.timeout_s + 60))
        self.turns.new_round()
        problems = all_outcomes(self._connect() if self.is_sender else None)
        problem = next((p for p in problems if p is not None), None)
        if problem is not None:
            if self.is_sender:
                self._drop_group(pending=True)  # another sender's group failed: this one is not used
            super().close()
            raise WeightSyncError(problem)

    @property
    def _who(self) -> str:
        assert self.sender is not None
        return f"the sender of pipeline stage {self.sender.stage}, EP rank {self.sender.ep_rank}"

    def _start_senders(self) -> None:
        self.turns.new_round()
        super()._start_senders()

    def _connect(self) -> str | None:
        """A sender, in its turn: build its weight-update group with every engine; an error message or None."""
        try:
            with self.turns.turn(self._who):
                return self._join()
        except TurnTimeout as err:
            return str(err)

    def _join(self) -> str | None:
        assert self.sender is not None
        urls = self.client.urls
        world_size = 1 + len(urls) * self.engine_ranks
        name = f"megatron-rl-{os.getpid()}-pp{self.sender.stage}-ep{self.sender.ep_rank}-{next(_GROUP_IDS)}"
        try:
            address = reachable_address(urls[0])
            port = free_port(address)
        except OSError as err:
            return f"cannot find this machine's address towards {urls[0]}: {err}"
        joining = self.engine.submit(
            self.client.init_weights_update_group(
                address, port, world_size, name, self.backend, ranks_per_server=self.engine_ranks
            )
        )
        ours = in_daemon_thread(
            init_weights_update_group, address, port, 0, world_size, name, self.backend, self.timeout_s
        )
        done, _ = wait([joining, ours], timeout=self.timeout_s, return_when=FIRST_EXCEPTION)
        for future, side in ((joining, "the engine"), (ours, "the trainer")):
            if future in done and future.exception() is not None:
                return f"{side} could not join weight-update group {name!r} at {address}:{port}: {future.exception()}"
        if len(done) < 2:
            return f"weight-update group {name!r} at {address}:{port} not formed within {self.timeout_s:.0f} s"
        self._group, self._group_name = ours.result(), name
        log.info("weight-update group %r: %d ranks (%s) at %s:%d", name, world_size, self.backend, address, port)
        return None

    def _before_sending(self) -> None:
        if self._group is None:
            problem = self._connect()
            if problem is not None:
                self._fail(problem)

    def _send(self, bucket: Bucket, version: str | None) -> int:
        try:
            with self.turns.turn(self._who):
                return self._post(bucket, version)
        except TurnTimeout as err:
            self._fail(str(err))
            return 0

    def _post(self, bucket: Bucket, version: str | None) -> int:
        names, dtypes, shapes = tensor_specs(bucket)
        # NCCL: one flattened broadcast (a device copy costs little, a collective launch more). Gloo:
        # tensor by tensor, from the parameters' own memory into the engine's (no packing copy on
        # either side; the local engine receives into its parameters in place).
        flattened = self.backend == "nccl" and broadcasts_flat(bucket)
        reply = self.engine.submit(
            self.client.update_weights_from_distributed(
                names,
                dtypes,
                shapes,
                group_name=self._group_name,
                weight_version=version,
                flattened_bucket=flattened,
                flush_cache=version is not None,
                abort_all_requests=self.in_flight.abort_all_requests,
            )
        )
        what = (
            f"bucket of {len(bucket)} tensors from {names[0]!r} (group {self._group_name!r}) to "
            f"{', '.join(self.client.urls)}"
        )
        try:
            sent = broadcast_named_tensors(self._group, bucket, flattened, reply, timeout_s=self.timeout_s)
        except (RuntimeError, TimeoutError) as err:
            reason = _refusal(reply, wait_s=5.0)
            self._fail(f"broadcast of the {what}: {err}" + (f"; the engine says: {reason}" if reason else ""))
            self._leave_group(pending=True)
            return 0
        try:
            reply.result(timeout=self.timeout_s)
        except ENGINE_ERRORS as err:
            self._fail(f"POST /update_weights_from_distributed ({what}): {err}")
            self._leave_group(pending=False)
            return 0
        return sent

    def _drop_group(self, pending: bool) -> None:
        """`_leave_group` in this sender's turn (a turn that does not come leaves the engines' side be)."""
        if self._group is None:
            return
        try:
            with self.turns.turn(self._who):
                self._leave_group(pending)
        except TurnTimeout as err:
            log.warning("weight-update group %r left on the engines: %s", self._group_name, err)
            self._abandoned.append(self._group)
            self._group = None

    def _leave_group(self, pending: bool) -> None:
        """Leave the group on both sides; with a broadcast `pending`, keep our side referenced, not destroyed."""
        group, self._group = self._group, None
        if group is None:
            return
        try:
            self.engine.run(self.client.destroy_weights_update_group(self._group_name), timeout=30)
        except ENGINE_ERRORS as err:
            log.warning("could not destroy weight-update group %r on the engine: %s", self._group_name, err)
        if pending:
            self._abandoned.append(group)
        else:
            destroy_weights_update_group(group)

    def _drop_engine_state(self) -> None:
        self._drop_group(pending=True)  # the dead peer would never answer a destroy; the next sync joins anew

    def close(self) -> None:
        self.turns.new_round()
        if self.is_sender:
            self._drop_group(pending=False)
        super().close()
