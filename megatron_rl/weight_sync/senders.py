"""Who sends the exported weights: every rank that holds them, each to the engines directly.

`export_hf_weights(..., ep_senders=True)` yields each pipeline stage's dense tensors on the stage's
first rank and, with expert parallelism, each EP rank's experts on that EP rank's first rank
(`models/export.py`; gpt-oss's stacked experts leave from the stage's first rank: `sends_experts_per_rank`). Those ranks are the *senders* (`export_senders`); global rank 0 is stage 0's
and EP rank 0's, and it is also the *controller*, the rank that pauses generation, opens and closes
the weight-update session and checks the version (`base.py`). The distributed and tensor modes
(`FromSenders`) give every sender a client of its own for the same servers (`sender_engine`), and
each sender posts its own buckets: over its own weight-update group in the distributed mode (as
slime's `slime-pp_{rank}` groups; SGLang keys its groups by `group_name` and receives each request
from rank 0 of the group it names), by handles to its own memory in the tensor mode. No weight
byte passes through another trainer rank.

The version and the cache flush go with the controller's last bucket, which it holds back until
every sender has finished (an `all_gather` of each sender's outcome): the engine reports the new
version only once all of it is loaded, and after a refusal anywhere the old version stays. SGLang
serves the senders' requests one at a time (its communicator queues them), so each sender waits
only for its own.
"""

from __future__ import annotations

import socket
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_rl.config import ModelConfig
from megatron_rl.models.export import export_hf_weights, is_export_sender, sends_experts_per_rank
from megatron_rl.weight_sync.base import WeightSync, all_outcomes, shared_outcome
from megatron_rl.weight_sync.packing import Bucket, with_last
from megatron_rl.weight_sync.prefetch import prefetched


@dataclass(frozen=True)
class Sender:
    """One export sender: its global rank, pipeline stage, expert-parallel rank and host name."""

    rank: int
    stage: int
    ep_rank: int
    host: str


def check_senders(roles: Sequence[tuple[int, int, str] | None], stages: int) -> list[Sender]:
    """The senders from every rank's (stage, EP rank, host) or None (not a sender), by global rank;
    raises RuntimeError unless each (stage, EP rank) has one sender, every stage has one, and global
    rank 0 sends for stage 0 / EP rank 0."""
    senders: dict[tuple[int, int], Sender] = {}
    for rank, role in enumerate(roles):
        if role is None:
            continue
        stage, ep_rank, host = role
        if (stage, ep_rank) in senders:
            raise RuntimeError(
                f"pipeline stage {stage}, EP rank {ep_rank} has two export senders, ranks "
                f"{senders[stage, ep_rank].rank} and {rank}"
            )
        senders[stage, ep_rank] = Sender(rank, stage, ep_rank, host)
    found = sorted({stage for stage, _ in senders})
    first = senders.get((0, 0))
    if found != list(range(stages)) or first is None or first.rank != 0:
        raise RuntimeError(
            f"export senders {sorted(senders)} (stage, EP rank): expected every stage of {stages}, "
            "with global rank 0 sending for stage 0 / EP rank 0"
        )
    return [senders[key] for key in sorted(senders)]


def export_senders(model: ModelConfig) -> list[Sender]:
    """Every export sender of weight sync's `export_hf_weights`, by (stage, EP rank) (collective)."""
    role = None
    if is_export_sender(ep_senders=sends_experts_per_rank(model)):
        ep_rank = ps.get_expert_model_parallel_rank() if ps.get_expert_model_parallel_world_size() > 1 else 0
        role = (ps.get_pipeline_model_parallel_rank(), ep_rank, socket.gethostname())
    roles: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(roles, role)
    return check_senders(roles, ps.get_pipeline_model_parallel_world_size())


def params_device(chunks: list[torch.nn.Module]) -> torch.device:
    """Where the model's parameters, hence the exported tensors, live."""
    return next(iter(chunks[0].parameters())).device


def sender_engine(controller: Any, is_sender: bool) -> Any:
    """A `RolloutEngine` for the controller's servers (its client's addresses, keys and timeouts) on
    a sender other than rank 0, on an event loop of its own (`close` ends both); the controller's own
    engine on rank 0; None elsewhere (collective)."""
    from megatron_rl.rollout.engine import RolloutEngine
    from megatron_rl.rollout.event_loop import RolloutLoop
    from megatron_rl.rollout.sglang import SGLangClient

    settings = None
    if controller is not None:
        c = controller.client
        settings = dict(
            urls=list(c.urls),
            api_key=c.api_key,
            admin_api_key=c.admin_api_key,
            timeout_s=c.timeout_s,
            max_retries=c.max_retries,
            connect_timeout_s=c.connect_timeout_s,
        )
    settings = shared_outcome(settings)
    if controller is not None or not is_sender:
        return controller
    loop = RolloutLoop()
    try:
        return RolloutEngine(SGLangClient(**settings), loop)
    except BaseException:
        loop.close()
        raise


class FromSenders(WeightSync):
    """A mode in which every sender posts its own buckets (distributed, tensor; see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.senders = export_senders(self.model)
        me = dist.get_rank()
        self.sender = next((s for s in self.senders if s.rank == me), None)
        self.engine = sender_engine(self.engine, self.sender is not None)
        # bumped by the controller when it forgets a dead engine; the other senders follow at the next sync
        self._engine_epoch = 0

    @property
    def is_sender(self) -> bool:
        return self.sender is not None

    def _forget_engine(self) -> None:
        self._engine_epoch += 1
        self._drop_engine_state()

    def _start_senders(self) -> None:
        error, epoch = shared_outcome((self._error, self._engine_epoch))
        self._error = error
        if epoch != self._engine_epoch:
            self._engine_epoch = epoch
            if self.is_sender:
                self._drop_engine_state()
        if self.is_sender and self._error is None:
            self._before_sending()

    def _transfer(self, version: str) -> int:
        buckets = export_hf_weights(
            self.chunks, self.model, bucket_mb=self.bucket_mb, ep_senders=sends_experts_per_rank(self.model)
        )
        if self.is_sender:  # bucket k + 1 is gathered while bucket k goes to the engine
            buckets = prefetched(buckets, device=params_device(self.chunks))
        held: Bucket | None = None
        sent = 0
        for bucket, last in with_last(buckets):
            if self._error is not None:
                continue  # the exporter still runs to its end: the other ranks' collectives need it
            if last and self.is_controller:
                held = bucket  # the version goes with it, once every sender is done
                continue
            sent += self._send(bucket, None)
        outcomes = all_outcomes((self._error, sent))
        errors = [error for error, _ in outcomes if error is not None]
        self._error = errors[0] if errors else None
        total = sum(n for _, n in outcomes)
        if self.is_controller and self._error is None and held is not None:
            total += self._send(held, version)
        return total

    @abstractmethod
    def _send(self, bucket: Bucket, version: str | None) -> int:
        """Post one bucket (the new version and the cache flush with it when `version` is set);
        returns its bytes, 0 after an error (`_fail`)."""

    def _before_sending(self) -> None:  # noqa: B027 - only the distributed mode has something to set up
        """A sender, before its first bucket of a sync: set up what the mode needs (a group)."""

    def _drop_engine_state(self) -> None:  # noqa: B027 - only the distributed mode holds something of it
        """A sender: forget what refers to a dead engine (its weight-update group)."""

    def close(self) -> None:
        if self.is_sender and not self.is_controller and self.engine is not None:
            try:
                self.engine.close()
            finally:
                self.engine.loop.close()
                self.engine = None
