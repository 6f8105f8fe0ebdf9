"""Rank 0's rollout runtime: one object, one event loop, every piece of rollout state.

`RolloutRuntime` owns what rank 0 keeps between steps to make batches: the collector (and through
it the sampler, the reward scorer and the engine handle), the engine's idle clock, and the state of
the scheduling policy `rollout.async_mode` picks:

- `sync`: the step's batch is collected on the loop when the step asks for it;
- `one_step_off` (`OneStepOff`): the next step's batch is collected on the loop while this step
  trains; the weight sync waits for it (`finish_step`);
- `fully_async` (`AsyncProducer`): a producer task keeps groups in flight under the staleness
  bound; each step's collection takes its rounds from the producer's buffer.

Threads and tasks, and what each may touch:

- **the trainer's main thread** (the owner of `handoff`) calls `collect`, `finish_step`,
  `checkpoint_state`, `load_state_dict`, `evaluate` and `close`. It never touches the policy state
  itself: each call hands a coroutine to the loop and waits for it through `handoff.wait_future`,
  running meanwhile what the engine hands it (a dead local engine's restart and its weight
  resync: the weight sync's state is the main thread's alone). `OneStepOff`'s `ready` batch is the
  exception: it is only set by the main thread, from a finished collection's result.
- **the runtime thread** ("rollout-runtime") runs the event loop; everything below runs on it and
  owns the policy state (`AsyncProducer`'s counts, buffer, retries and jobs in flight: no lock) and
  the sampler's draws:
  - one **collection task** per step (`collector.collect_async`): its generation rounds, its
    episodes (each a coroutine: generate, environment step, generate...; agents through the
    gateway), then the rewards;
  - in `fully_async`, the **producer task** (`AsyncProducer._run`), which submits a group per
    free worker slot, and one **group task** per group in flight (`AsyncProducer._work`);
  - the held-out **evaluation** (`evaluate_async`), while nothing else collects;
  - after a stop signal, `checkpoint.preempt_timeout_s` later, the **abort** ("abort-episodes"), which
    ends the episodes still running (`megatron_rl.rollout.preempt`) and, in `fully_async`, stops the
    producer's submissions (a step then takes the groups it has).
- **worker threads** started from the loop, touching only what they are given: the episodes'
  generation pool (`/generate` blocks a thread inside the engine handle, whose HTTP client runs on
  its own event-loop thread), a plain environment `step` on a daemon thread of its own (at most
  `env.max_concurrent_steps` at once), a plain agent function's thread, the reward scoring
  (`asyncio.to_thread`: the scorer blocks on its worker processes or the reward server), and the
  agent gateway's server thread, its render threads and generation pool (`megatron_rl.agents`).

A generation thread that sees the local engine die restarts it through the engine handle, which
serialises restarts and hands the restart and its resync to the main thread (`handoff`), waiting
there: no worker thread touches weight-sync state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from megatron_rl.config import Config
from megatron_rl.data import Prompt
from megatron_rl.envs import Trajectory
from megatron_rl.loop.async_rollout import AsyncProducer, BusyMeter, Job, OneStepOff, staleness_metrics
from megatron_rl.loop.collect import RolloutCollector, StepBatch, evaluate_async
from megatron_rl.rollout.handoff import MainThreadCalls
from megatron_rl.rollout.preempt import abort_episodes

log = logging.getLogger(__name__)
T = TypeVar("T")
CLOSE_TIMEOUT_S = 30.0


class RolloutRuntime:
    """Rank 0's rollout runtime (see the module doc). `extra_metrics()` is added to every step's record
    (the data counts, the engine's restarts)."""

    def __init__(
        self,
        cfg: Config,
        collector: RolloutCollector,
        handoff: MainThreadCalls,
        extra_metrics: Callable[[], dict[str, float]] | None = None,
    ) -> None:
        self.cfg = cfg
        self.collector = collector
        self.handoff = handoff
        self.meter = BusyMeter()
        self._extra_metrics = extra_metrics or dict
        self.loop = asyncio.new_event_loop()
        self.aborted = False  # the episodes were aborted: the run stops after this step
        self._thread = threading.Thread(target=self._serve, name="rollout-runtime", daemon=True)
        self._thread.start()
        mode = cfg.rollout.async_mode
        self.one_step_off = OneStepOff(self._submit_collect, handoff) if mode == "one_step_off" else None
        self.producer = (
            AsyncProducer(cfg, self._generate_job, self._next_prompt, self.meter) if mode == "fully_async" else None
        )

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        self.loop.close()

    # ---- from the main thread ----
    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """`coro` on the runtime's loop; its future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """`coro`'s result, run on the loop; the main thread runs what is handed to it while it waits."""
        future = self.submit(coro)
        if threading.current_thread() is self.handoff.owner:
            return self.handoff.wait_future(future)
        return future.result()

    def abort_episodes_after(self, delay_s: float) -> None:
        """(Any thread; a signal handler too.) The abort (see the module doc) `delay_s` seconds from now."""

        def start() -> None:
            self.loop.create_task(self._abort(), name="abort-episodes")

        with contextlib.suppress(RuntimeError):  # the loop already closed (the signal came during the shutdown)
            self.loop.call_soon_threadsafe(self.loop.call_later, delay_s, start)

    # ---- on the loop ----
    async def _abort(self) -> None:
        log.warning(
            "aborting the episodes still running: checkpoint.preempt_timeout_s has passed since the stop signal"
        )
        self.aborted = True
        abort_episodes()
        if self.producer is not None:
            await self.producer.abort()

    async def _collect(self, step: int) -> StepBatch:
        plan = await self.collector.collect_async(step, self._round)
        plan.metrics.update(self._extra_metrics())
        return plan

    def _submit_collect(self, step: int) -> Future[StepBatch]:
        return self.submit(self._collect(step))

    async def _round(self, n: int, step: int, round_: int, kept: int) -> tuple[list[Prompt], list[list[Trajectory]]]:
        if self.producer is not None:
            return await self.producer.take(n, kept)
        with self.meter.busy():
            return await self.collector.generate_round(n, step, round_, kept)

    async def _generate_job(self, job: Job) -> list[Trajectory]:
        """One fully asynchronous group, seeded by its serial number and attempt (not by the step it lands in)."""
        return (await self.collector.generate_async([job.prompt], job.serial, f"async.{job.attempt}"))[0]

    def _next_prompt(self) -> Prompt:
        return self.collector.sampler.next(1)[0]

    # ---- the trainer's calls ----
    def collect(self, step: int, version: int = 0) -> StepBatch:
        """The step's batch and its rollout metrics (with `extra_metrics` and the `async/` metrics);
        `version`: the trainer's weight version at the start of the step (the last one synced)."""
        began = time.perf_counter()
        if self.producer is not None:
            self.run(self.producer.synced(version))
        if self.one_step_off is not None:
            plan, waited = self.one_step_off.take(step)
            if step < self.cfg.train.steps:
                self.one_step_off.start(step + 1)  # generates with the weights this step starts from
        else:
            plan = self.run(self._collect(step))
            waited = time.perf_counter() - began
        if self.producer is not None:
            used = 0 if plan.batch is None else int(plan.metrics["groups/groups_used"])
            plan.metrics.update(self.run(self.producer.settle(used)))
        else:
            plan.metrics.update({"async/dropped_stale": 0.0, "async/buffer_groups": 0.0})
        plan.metrics.update(staleness_metrics(version, plan.versions or []))
        plan.metrics["time/wait_batch"] = waited
        return plan

    def finish_step(self) -> dict[str, float]:
        """Before the step's weight sync: `one_step_off` waits for the next batch (so that the sync never
        races its generation); the seconds waited and the engine's idle seconds of the step."""
        waited = self.one_step_off.wait() if self.one_step_off is not None else 0.0
        return {"time/wait_batch": waited, "time/engine_idle": self.meter.take_idle()}

    @contextlib.contextmanager
    def checkpoint_state(self) -> Iterator[bytes]:
        """What a checkpoint holds of the rollout side, pickled (samples and batches are dataclasses):
        one_step_off's pre-generated batch; fully_async's buffer, the prompts in flight (resubmitted on
        resume) and counters. No prompt is drawn while the block runs."""
        mode = self.cfg.rollout.async_mode
        if self.producer is not None:
            state = self.run(self.producer.hold())
            try:
                yield pickle.dumps({"async_mode": mode, **state})
            finally:
                self.run(self.producer.release())
        elif self.one_step_off is not None:
            yield pickle.dumps({"async_mode": mode, **self.one_step_off.state_dict()})
        else:
            yield pickle.dumps({"async_mode": mode})

    def load_state_dict(self, saved_state: bytes) -> None:
        """Continue from `checkpoint_state`'s bytes. A checkpoint of another asynchronous mode is refused
        (its pre-generated batch or buffer would be lost or misread); one of `sync` holds nothing."""
        state: dict[str, Any] = pickle.loads(saved_state)  # our own checkpoint file
        mode, saved = self.cfg.rollout.async_mode, state.get("async_mode", "sync")
        if saved == "sync":
            return
        if saved != mode:
            raise ValueError(
                f"rollout.async_mode = {mode!r} but the checkpoint was saved with {saved!r}, whose rollout state "
                f"(pre-generated batch or buffer) this mode cannot continue; resume with rollout.async_mode={saved}"
            )
        if self.producer is not None:
            producer = self.producer

            async def load() -> None:
                producer.load_state_dict(state)

            self.run(load())
        elif self.one_step_off is not None:
            self.one_step_off.load_state_dict(state)

    def evaluate(self, prompts: Sequence[Prompt], step: int) -> dict[str, float]:
        """Held-out accuracy of the served policy on `prompts` ({} once the episodes were aborted)."""
        col = self.collector
        if self.aborted:
            return {}
        with self.meter.busy():
            return self.run(evaluate_async(col.engine, prompts, col.tokenizer, col.scorer, self.cfg, step))

    def close(self) -> None:
        """Stop the producer and cancel what still runs on the loop (a generation still running in a
        worker thread ends when the engine closes, next), then stop the loop and its thread."""
        if not self._thread.is_alive():
            return
        try:
            self.submit(self._shutdown()).result(timeout=CLOSE_TIMEOUT_S)
        except Exception as err:  # closing on an error path: the run's own error is the one reported
            log.warning("rollout runtime: closing: %s: %s", type(err).__name__, err)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=CLOSE_TIMEOUT_S)

    async def _shutdown(self) -> None:
        if self.producer is not None:
            await self.producer.stop()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
