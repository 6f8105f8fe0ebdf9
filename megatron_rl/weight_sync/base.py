"""What every weight-sync mode shares: the report, the error, and the collective frame of `sync`.

`sync(version)` is collective: every trainer rank calls it. Global rank 0 (the *controller*,
which is also the export sender of pipeline stage 0) prepares the engine (pause, session) and
checks the version; in the disk mode it alone talks to the engine, in the distributed and tensor
modes every export sender posts its own buckets (`senders.py`). An engine error does not stop the
transfer midway, because every rank must still run the exporter's collectives to the end. The
error is remembered, later engine calls are skipped, and at the end rank 0 shares the outcome. So
every rank returns the same `SyncReport` or raises the same `WeightSyncError`.

The distributed and tensor modes run inside SGLang's weight-update session (`/begin_weight_update`
before the first bucket, `/end_weight_update` after the last, also after an error; servers without
the endpoints, SGLang < 0.5.21, need none).

Requests in flight during a sync (`InFlight`, read once from the configuration here, for every
mode): in `sync` and `one_step_off` none are (generation and updates take turns), and only the
tensor mode pauses generation, with mode "abort", as the engine's memory is written. In
`fully_async` with `rollout.partial_rollout` they must survive the update: generation pauses with
SGLang's mode "retract" (running requests go back to the queue with their tokens and are prefilled
again, after the cache flush, under the new weights; "in_place" would keep the old weights' KV
cache) before the transfer (disk: before the load, the folder is written while the engine
generates) and continues after it, and the updates pass `abort_all_requests=false`;
each response then reports which version sampled which tokens. Without partial rollouts they are
aborted: `abort_all_requests=true`, and the modes with a weight-update session (distributed, tensor)
pause with mode "abort" for the whole transfer: SGLang's `/begin_weight_update` on a server that is
not paused waits for every running generation to finish (its writer lock), and between buckets
queued requests would start on half-updated weights.

Colocated runs can hand the engine's memory back between rollout and training with
`release_engine_memory()`. The next `sync` then empties every rank's CUDA cache (and, with
`rollout.colocate_offload`, moves the optimizer state to the host first), resumes the weights before
writing them and everything else afterwards (SGLang's order: weights, update, KV cache); see
`memory.py` for the memory plan.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch.distributed as dist

from megatron_rl.rollout.sglang import SGLangClient, SGLangError
from megatron_rl.rollout.types import MEMORY_TAGS
from megatron_rl.weight_sync.memory import OptimizerOffload, empty_cuda_cache

if TYPE_CHECKING:
    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.config import Config
    from megatron_rl.rollout.engine import RolloutEngine

log = logging.getLogger("megatron_rl.weight_sync")

ENGINE_ERRORS = (SGLangError, TimeoutError, concurrent.futures.TimeoutError)


@dataclass(frozen=True)
class SyncReport:
    """One finished sync: weight bytes moved, wall-clock seconds on rank 0 (export included), and
    the version the engine now reports."""

    mode: str
    bytes: int
    seconds: float
    weight_version: str


@dataclass(frozen=True)
class InFlight:
    """What a sync does with the engine's requests in flight: `pause` is the /pause_generation mode
    before the transfer (continued after it; None = no pause) and `abort_all_requests` goes with
    every update call."""

    pause: str | None
    abort_all_requests: bool

    @classmethod
    def from_config(cls, rollout: Any, pauses_for_transfer: bool, in_session: bool) -> InFlight:
        """`pauses_for_transfer`: the mode stops generation while it writes (tensor, colocated);
        `in_session`: it runs inside SGLang's weight-update session (distributed, tensor)."""
        if rollout.async_mode == "fully_async" and rollout.partial_rollout:
            return cls(pause="retract", abort_all_requests=False)
        aborts = rollout.async_mode == "fully_async"
        pause = pauses_for_transfer or (aborts and in_session)
        return cls(pause="abort" if pause else None, abort_all_requests=aborts)


class WeightSyncError(RuntimeError):
    """A sync the engine did not complete; raised on every rank with the same message."""


class ResyncAtStepBoundary(WeightSyncError):
    """Rank 0, within a rollout: a restarted engine needs weights only a collective sync sends; the
    trainer abandons the step's rollout, syncs on every rank and collects it again."""


def shared_outcome(value: Any) -> Any:
    """Rank 0's `value`, on every rank (collective)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_outcomes(value: Any) -> list[Any]:
    """Every rank's `value`, by global rank, on every rank (collective)."""
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


class WeightSync(ABC):
    """Pushes the actor's current weights to the rollout engine; see the module docstring."""

    mode: ClassVar[str]
    # Distributed and tensor updates run inside SGLang's weight-update session (>= 0.5.21).
    needs_session: ClassVar[bool] = False
    # Generation stops while the weights are written, whatever the loop (tensor: colocated memory).
    pauses_for_transfer: ClassVar[bool] = False
    # A pause spans the whole transfer (export included); False: the mode pauses around its engine call.
    pause_spans_transfer: ClassVar[bool] = True

    def __init__(
        self,
        cfg: Config,
        engine: RolloutEngine | None,
        actor: MegatronActor,
        *,
        bucket_mb: float | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("weight sync needs torch.distributed running (build the MegatronActor first)")
        self.cfg = cfg
        self.model = cfg.model
        self.chunks = actor.chunks
        self.bucket_mb = float(cfg.rollout.bucket_mb if bucket_mb is None else bucket_mb)
        if not self.bucket_mb > 0:
            raise ValueError(f"weight sync bucket_mb must be > 0, got {self.bucket_mb}")
        self.timeout_s = float(cfg.rollout.request_timeout_s)
        self.is_controller = dist.get_rank() == 0
        if self.is_controller and engine is None:
            raise ValueError(
                "make_weight_sync: global rank 0 talks to the engine and needs its RolloutEngine (got None)"
            )
        self.engine = engine if self.is_controller else None
        self.offload = OptimizerOffload(actor.state.optimizer) if cfg.rollout.colocate_offload else None
        self._released: list[str] = []  # the engine memory released now (the same on every rank)
        self._error: str | None = None
        self._version = ""
        self.in_flight = InFlight.from_config(cfg.rollout, self.pauses_for_transfer, self.needs_session)
        self._paused = False
        self.synced: str | None = None  # the version of the last complete sync

    @property
    def client(self) -> SGLangClient:
        """The engine's `SGLangClient` (rank 0, and the export senders of the distributed and tensor modes)."""
        assert self.engine is not None, "this rank does not talk to the engine"
        return self.engine.client

    # ---- the collective frame ----

    def sync(self, version: int | str) -> SyncReport:
        """Send the current weights; the engine serves them as `str(version)` afterwards. Collective."""
        version = str(version)
        if not version:
            raise ValueError("weight sync: the version must not be empty")
        started = time.perf_counter()
        self._error, self._version = None, version
        if self._released:  # colocated: make room on every rank's GPU before the engine takes it back
            if self.offload is not None:
                self.offload.to_host()
            empty_cuda_cache()
            dist.barrier()
        if self.is_controller:
            self._prepare_engine()
        self._start_senders()
        try:
            nbytes = self._transfer(version)
        finally:  # e.g. generation paused for the transfer continues even after an unexpected exception
            if self.is_controller:
                self._restore_engine()
        if self.is_controller and self._error is None:
            self._check_version(version)
        error, nbytes, seconds, self._released = shared_outcome(
            (self._error, int(nbytes), time.perf_counter() - started, self._released)
        )
        if error is not None:
            raise WeightSyncError(error)
        self.synced = version
        if self.is_controller:
            log.info("weight sync (%s): %.1f MB in %.3f s, version %s", self.mode, nbytes / 1e6, seconds, version)
        return SyncReport(self.mode, nbytes, seconds, version)

    def _start_senders(self) -> None:  # noqa: B027 - only modes with several senders need it
        """Every rank, after the controller prepared the engine and before the transfer."""

    @abstractmethod
    def _transfer(self, version: str) -> int:
        """Move the weights (every rank takes part; the ranks that talk to the engine skip that once
        `self._error` is set); returns the weight bytes sent (rank 0: every sender's)."""

    def _prepare_engine(self) -> None:
        """Rank 0, before the transfer: pause generation (see `InFlight`), bring back released
        weights (they are about to be written), then open the weight-update session where the mode
        needs one."""
        if self.pause_spans_transfer:
            self._pause()
        if "weights" in self._released:
            self._resume(["weights"])
        if self.needs_session and self._error is None:
            self._call(self.client.begin_weight_update(), "POST /begin_weight_update")

    def _restore_engine(self) -> None:
        """Rank 0, after the transfer (also a failed one): close the session, then bring back the
        rest of the released memory (KV cache, graphs), then continue a paused generation."""
        if self.needs_session:
            self._call(self.client.end_weight_update(), "POST /end_weight_update")
        if self._error is None and self._released:
            self._resume(list(self._released))
        self._continue()

    def _pause(self) -> None:
        """Rank 0: pause generation as `self.in_flight` says (nothing without a pause mode)."""
        if self.in_flight.pause is not None and self._error is None and not self._paused:
            self._paused = True  # also when the call fails: `_continue` must still be tried
            self._call(self.client.pause_generation(self.in_flight.pause), "POST /pause_generation")

    def _continue(self) -> None:
        """Rank 0: continue what `_pause` paused (also after an error)."""
        if self._paused:
            self._paused = False
            self._call(self.client.continue_generation(), "POST /continue_generation")

    def resync_restarted_engine(self) -> None:
        """Rank 0 alone, within a rollout: an engine restarted from its model folder gets the weights
        of the last sync (nothing to do before the first). Only the disk mode can resend them without
        the other ranks; the others forget what they held of the dead engine and raise
        `ResyncAtStepBoundary`, and the trainer syncs on every rank before collecting again."""
        if self.synced is None:
            return
        self._forget_engine()
        raise ResyncAtStepBoundary(
            f"the restarted engine needs the weights of version {self.synced!r}, which rollout.weight_sync = "
            f"{self.mode} sends only with every rank taking part"
        )

    def _forget_engine(self) -> None:  # noqa: B027 - only the distributed mode holds something of it
        """Rank 0: drop what refers to a dead engine (its weight-update group) before the next sync."""

    def close(self) -> None:  # noqa: B027 - most modes hold nothing
        """Release what the mode holds (groups, buffers); call on every rank."""

    def __enter__(self) -> WeightSync:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- engine calls (rank 0) ----

    def _fail(self, message: str) -> None:
        if self._error is None:
            self._error = f"weight sync ({self.mode}) to version {self._version!r} failed: {message}"
            log.error("%s", self._error)

    def _call(self, coro: Coroutine[Any, Any, Any], what: str) -> Any:
        """Run a client call; on an engine error record it (see `_fail`) and return None."""
        try:
            return self.engine.run(coro, timeout=self.timeout_s)
        except ENGINE_ERRORS as err:
            self._fail(f"{what}: {err}")
            return None

    def _check_version(self, version: str) -> None:
        info = self._call(self.client.get_model_info(), "GET /model_info")
        reported = info.get("weight_version") if isinstance(info, dict) else None
        if reported is not None and str(reported) != version:
            self._fail(f"the engine reports weight_version {reported!r} after the update, expected {version!r}")

    # ---- colocated memory ----

    def release_engine_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free the engine's memory (default: all of `MEMORY_TAGS`) between rollout and
        training; the next `sync` resumes it. Call on every rank (rank 0 acts); requests must be done."""
        tags = list(MEMORY_TAGS if tags is None else tags)
        bad = [t for t in tags if t not in MEMORY_TAGS]
        if bad:
            raise ValueError(f"release_engine_memory: unknown tags {bad}; allowed {list(MEMORY_TAGS)}")
        new = [t for t in tags if t not in self._released]
        problem = None
        if new and self.is_controller:
            try:
                self.engine.run(self.client.release_memory_occupation(new), timeout=self.timeout_s)
            except ENGINE_ERRORS as err:
                problem = f"release_memory_occupation {new}: {err}"
        problem = shared_outcome(problem)  # also the barrier: the engine's memory is free from here on
        if problem is not None:
            raise WeightSyncError(problem)
        self._released += new
        if self.offload is not None and self.offload.offloaded:
            self.offload.to_device()

    def mark_released(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Record memory the engine released before this sync existed (`memory.release_colocated_engines`
        at start-up); the next `sync` resumes it. Call on every rank."""
        self._released += [t for t in tags if t not in self._released]

    def _resume(self, tags: list[str]) -> None:
        self._call(self.client.resume_memory_occupation(tags), f"resume_memory_occupation {tags}")
        if self._error is None:
            self._released = [t for t in self._released if t not in tags]
