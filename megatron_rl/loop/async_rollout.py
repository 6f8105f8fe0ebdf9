"""Asynchronous rollouts on rank 0 (`rollout.async_mode`): weight versions, the one-step-off
pre-generation, the fully asynchronous producer and its buffer, the engine's idle clock.

Weight versions are the strings the trainer syncs with: str(step) after step `step`'s update; the
engine's version before the first sync ("default" in SGLang and the local engine) is version 0.
The trainer's version at the start of a step is the last synced one; a token's staleness is the
trainer's version minus the version that generated it.

Both are scheduling policies of the rollout runtime (`megatron_rl.loop.runtime`), whose event loop
runs their collections:

- `one_step_off` (`OneStepOff`): while step t trains, the runtime collects batch t+1 with
  the weights step t started from; step t's weight sync waits for it, so which weights generated
  which sample never depends on timing (batches 1 and 2 both come from the start weights).
- `fully_async` (`AsyncProducer`): a producer task submits one group (a prompt's
  `rollout.n_samples_per_prompt` trajectories) per free worker slot (max_concurrency / group size of
  them, each group a task) to the engine, as long as the groups trained, taken, buffered and in flight stay within
  (version + max_staleness + 1) x train.prompts_per_step (AReaL's bound, `StalenessBound`, numbers only);
  finished groups go into a
  FIFO buffer. The trainer takes its rounds of groups from the buffer, dropping (and resubmitting the
  prompt of) every group holding a token more than `rollout.max_staleness` versions behind it. A round
  takes at most what the bound leaves it (a dynamic-sampling round of oversample_factor x
  prompts_per_step groups can ask for more than the bound ever lets exist), so it never waits for a
  group the producer may not submit. A group
  with an aborted response (an engine error, or a weight sync with `rollout.partial_rollout=false`) is
  resubmitted, up to `rollout.max_retries` times, then left out (`async/aborted_groups_left_out`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from megatron_rl.config import Config
from megatron_rl.data import Prompt
from megatron_rl.envs import Trajectory, segments_of

# how often a round waiting for groups checks that some can still arrive (requests have their own timeouts)
STARVATION_CHECK_S = 5.0

START_VERSIONS = ("default", "")  # what an engine reports before its first weight sync


def version_number(version: str | None) -> int:
    """The integer of a weight version string: str(step) -> step; None or the engine's start version -> 0."""
    if version is None or version in START_VERSIONS:
        return 0
    try:
        return int(version)
    except ValueError:
        raise ValueError(
            f"weight version {version!r} is not a step number (the trainer syncs str(step)); was the engine "
            "updated by another trainer?"
        ) from None


def token_versions(sample: Trajectory) -> list[int]:
    """The weight version of each output token: `sample.weight_versions` when the engine reported them,
    else the sample's one `weight_version` for every token."""
    per_token = sample.weight_versions
    if per_token is None:
        per_token = [sample.weight_version] * len(sample.output_ids)  # type: ignore[list-item]
    if len(per_token) != len(sample.output_ids):
        raise ValueError(
            f"sample {sample.rid!r}: {len(per_token)} weight versions for {len(sample.output_ids)} output tokens"
        )
    return [version_number(v) for v in per_token]


def trained_versions(sequence: Trajectory) -> list[int]:
    """The versions of the generated tokens (a trajectory's observation tokens are not trained on)."""
    return [v for v, m in zip(token_versions(sequence), sequence.loss_mask, strict=True) if m]


def staleness_metrics(trainer_version: int, versions: Sequence[Sequence[int]]) -> dict[str, float]:
    """The step's `async/` metrics of its trained tokens, `versions[i]` those of sample i: staleness
    (trainer version minus token version) mean and max, partial rollouts (samples spanning more than
    one version) and their share of the tokens, tokens per distinct version. All 0 without tokens."""
    tokens = [v for vs in versions for v in vs]
    if not tokens:
        return {
            "async/staleness_mean": 0.0,
            "async/staleness_max": 0.0,
            "async/partial_rollouts": 0.0,
            "async/partial_token_share": 0.0,
            "async/tokens_per_version": 0.0,
        }
    stale = [trainer_version - v for v in tokens]
    partial = [len(vs) for vs in versions if len(set(vs)) > 1]
    return {
        "async/staleness_mean": sum(stale) / len(stale),
        "async/staleness_max": float(max(stale)),
        "async/partial_rollouts": float(len(partial)),
        "async/partial_token_share": sum(partial) / len(tokens),
        "async/tokens_per_version": len(tokens) / len(set(tokens)),
    }


def too_stale(trainer_version: int, samples: Sequence[Trajectory], max_staleness: int) -> bool:
    """Whether any output token of `samples` (of any of their segments) is more than `max_staleness`
    versions behind the trainer."""
    oldest = min((v for s in samples for seq in segments_of(s) for v in token_versions(seq)), default=trainer_version)
    return trainer_version - oldest > max_staleness


class BusyMeter:
    """The engine's idle seconds: time during which no generation of this process was running."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._idle = 0.0
        self._idle_since: float | None = time.perf_counter()

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        with self._lock:
            if self._active == 0 and self._idle_since is not None:
                self._idle += time.perf_counter() - self._idle_since
                self._idle_since = None
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    self._idle_since = time.perf_counter()

    def take_idle(self) -> float:
        """Idle seconds since the last call."""
        with self._lock:
            now = time.perf_counter()
            idle = self._idle + (now - self._idle_since if self._idle_since is not None else 0.0)
            self._idle = 0.0
            if self._idle_since is not None:
                self._idle_since = now
            return idle


class OneStepOff:
    """The batch of the next step, collected on the rollout runtime's loop while this step trains.

    `submit(step)` starts collecting step `step`'s batch on the runtime and gives its future; the
    main thread waits for it with `wait(future)` (the runtime's: bounded, running what the collection
    hands it meanwhile)."""

    def __init__(self, submit: Callable[[int], Future], wait: Callable[[Future], Any]) -> None:
        self._submit = submit
        self._wait = wait
        self._future: Future | None = None
        self.ready: Any = None  # the next step's finished batch (a checkpoint holds it)
        self.ready_step: int | None = None

    def take(self, step: int) -> tuple[Any, float]:
        """Step `step`'s batch (collected now when none was pre-generated) and the seconds waited for it."""
        began = time.perf_counter()
        self.wait()
        if self.ready is not None and self.ready_step == step:
            step_batch, self.ready, self.ready_step = self.ready, None, None
        else:
            step_batch = self._wait(self._submit(step))
        return step_batch, time.perf_counter() - began

    def start(self, step: int) -> None:
        """Begin collecting step `step`'s batch in the background."""
        if self._future is not None:
            raise RuntimeError("one_step_off: a background collection is still running")
        self._future = self._submit(step)
        self.ready_step = step

    def wait(self) -> float:
        """Wait for the background collection (before the weight sync); returns the seconds waited."""
        began = time.perf_counter()
        if self._future is not None:
            future, self._future = self._future, None
            self.ready = self._wait(future)
        return time.perf_counter() - began

    def state_dict(self) -> dict[str, Any]:
        if self._future is not None:
            raise RuntimeError("one_step_off: checkpoint taken while the next batch is being collected")
        return {"ready": self.ready, "ready_step": self.ready_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ready, self.ready_step = state["ready"], state["ready_step"]


@dataclass
class Job:
    """One group to generate: `serial` numbers it (its sampling seeds), `attempt` its resubmissions."""

    serial: int
    prompt: Prompt
    attempt: int = 0


@dataclass
class StalenessBound:
    """AReaL's staleness bound on fully_async's groups, as numbers only (its owner holds the lock): at
    trainer version v, the groups consumed in earlier steps, taken this step, buffered and in flight
    are at most `capacity` = (v + max_staleness + 1) x batch_groups together."""

    max_staleness: int
    batch_groups: int
    version: int = 0
    consumed: int = 0  # groups trained on (or used) in earlier steps
    taken: int = 0  # groups of the step being collected that count towards the bound

    @property
    def capacity(self) -> int:
        return (self.version + self.max_staleness + 1) * self.batch_groups

    def allowance(self, pending: int) -> int:
        """Groups that may still be submitted, `pending` being buffered or in flight."""
        return self.capacity - self.consumed - self.taken - pending

    def round_size(self, wanted: int, counted: int) -> int:
        """How many of `wanted` groups a round may wait for when `counted` groups of the step are kept:
        every slot not consumed or kept can hold one of them, never more (the rest can never exist)."""
        return min(wanted, self.capacity - self.consumed - counted)

    def describe(self) -> str:
        return f"staleness bound {self.capacity}, consumed {self.consumed}, taken {self.taken}"


@dataclass
class Finished:
    job: Job
    samples: list[Trajectory]


class AsyncProducer:
    """The fully asynchronous producer (see the module doc), on the rollout runtime's event loop: every
    method runs there (the coroutines, and `allowance`, `load_state_dict` before it starts), so its
    state has one owner and no lock. `generate(job)` is the coroutine of one group's samples;
    `next_prompt()` draws from the sampler. Its tasks: the producer (`_run`, one), which submits a
    group per free worker slot, and one `_work` task per group in flight."""

    def __init__(
        self,
        cfg: Config,
        generate: Callable[[Job], Awaitable[list[Trajectory]]],
        next_prompt: Callable[[], Prompt],
        meter: BusyMeter,
    ) -> None:
        ro = cfg.rollout
        self.max_staleness = ro.max_staleness
        self.max_attempts = ro.max_retries + 1
        self.workers = max(1, ro.max_concurrency // ro.n_samples_per_prompt)
        self._generate = generate
        self._next_prompt = next_prompt
        self._meter = meter
        self.bound = StalenessBound(ro.max_staleness, cfg.train.prompts_per_step)
        self.serial = 0
        self.buffer: deque[Finished] = deque()
        self.retry: deque[Job] = deque()
        self.in_flight: dict[int, Job] = {}
        self.dropped_stale = 0  # samples, since the last `step_counts`
        self.aborted_groups = 0
        self.held = False
        self.aborted = False  # `abort`: nothing submitted any more, `take` returns what it has
        self.error: BaseException | None = None
        self._stopping = False
        self._changed: asyncio.Condition | None = None
        self._task: asyncio.Task | None = None
        self._works: set[asyncio.Task] = set()

    @property
    def changed(self) -> asyncio.Condition:
        """Notified whenever the state changes (created on the loop that first asks)."""
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def wait_until(self, predicate: Callable[[], bool], timeout: float | None) -> bool:
        """Wait until `predicate()` holds, at most `timeout` seconds; whether it holds."""
        try:
            async with asyncio.timeout(timeout), self.changed:
                await self.changed.wait_for(predicate)
        except TimeoutError:
            pass
        return predicate()

    # ---- the producer task ----
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="rollout-producer")

    def allowance(self) -> int:
        """Groups that may still be submitted under the staleness bound."""
        return self.bound.allowance(len(self.buffer) + len(self.in_flight))

    def _can_submit(self) -> bool:
        return (
            not self.held
            and not self.aborted
            and self.error is None
            and len(self.in_flight) < self.workers
            and (self.allowance() > 0 or bool(self.retry))
        )

    async def _run(self) -> None:
        while True:
            await self.wait_until(lambda: self._stopping or self._can_submit(), None)
            if self._stopping:
                return
            try:
                # a resubmission takes the place its group already had under the bound
                job = self.retry.popleft() if self.retry else Job(self._new_serial(), self._next_prompt())
            except BaseException as err:  # the sampler failed: the trainer raises it
                self.error = err
                await self._notify()
                return
            self.in_flight[job.serial] = job
            work = asyncio.get_running_loop().create_task(self._work(job), name=f"rollout-group-{job.serial}")
            self._works.add(work)
            work.add_done_callback(self._works.discard)

    def _new_serial(self) -> int:
        self.serial += 1
        return self.serial

    async def _work(self, job: Job) -> None:
        try:
            with self._meter.busy():
                samples = await self._generate(job)
        except asyncio.CancelledError:
            raise
        except BaseException as err:
            self.in_flight.pop(job.serial, None)
            if not self._stopping:
                self.error = err
            await self._notify()
            return
        if self.in_flight.pop(job.serial, None) is None:
            return  # checkpoint restore or shutdown replaced it
        if any(s.aborted for s in samples):
            if job.attempt + 1 < self.max_attempts:
                self.retry.append(Job(job.serial, job.prompt, job.attempt + 1))
            else:
                self.aborted_groups += 1
        else:
            self.buffer.append(Finished(job, samples))
        await self._notify()

    # ---- the trainer's side (a step's collection, on the runtime) ----
    async def take(self, n: int, counted: int) -> tuple[list[Prompt], list[list[Trajectory]]]:
        """The next `n` finished groups fresh enough to train on, or as many as the staleness bound leaves
        this round (fewer than `n` when it caps them), waiting for them; a stale one is dropped (its
        samples counted) and its prompt resubmitted. `counted`: the groups already taken this step that
        still count towards the bound (the informative ones kept so far)."""
        self.start()
        prompts: list[Prompt] = []
        grouped: list[list[Trajectory]] = []
        self.bound.taken = counted
        n = self.bound.round_size(n, counted)  # a dropped stale group's prompt keeps its slot
        await self._notify()
        while len(grouped) < n:
            while not await self.wait_until(self._takeable, STARVATION_CHECK_S):
                if self._starved():
                    raise RuntimeError(
                        f"rollout producer: waiting for {n - len(grouped)} more group(s) that can never "
                        f"arrive (none buffered or in flight, none may be submitted: {self.bound.describe()})"
                    )
            if self.error is not None:
                raise RuntimeError(f"rollout producer: {self.error}") from self.error
            if not self.buffer:  # aborted: the step trains on what it has
                break
            done = self.buffer.popleft()
            if too_stale(self.bound.version, done.samples, self.max_staleness):
                self.dropped_stale += len(done.samples)
                self.retry.appendleft(Job(done.job.serial, done.job.prompt, done.job.attempt + 1))
            else:
                prompts.append(done.job.prompt)
                grouped.append(done.samples)
                self.bound.taken += 1
            await self._notify()
        return prompts, grouped

    def _takeable(self) -> bool:
        return bool(self.buffer) or self.error is not None or self.aborted

    def _starved(self) -> bool:
        """Nothing buffered, nothing in flight and nothing the producer may submit."""
        producing = self._task is not None and not self._task.done() and self._can_submit()
        return not self.buffer and not self.in_flight and not producing

    async def settle(self, used: int) -> dict[str, float]:
        """The step's batch holds `used` groups: they count as consumed; the step's producer counts."""
        self.bound.consumed += used
        self.bound.taken = 0
        out = {
            "async/dropped_stale": float(self.dropped_stale),
            "async/buffer_groups": float(len(self.buffer)),
            "async/aborted_groups_left_out": float(self.aborted_groups),
        }
        self.dropped_stale = self.aborted_groups = 0
        await self._notify()
        return out

    async def synced(self, version: int) -> None:
        self.bound.version = version
        await self._notify()

    async def hold(self) -> dict[str, Any]:
        """The producer's state for a checkpoint; no prompt is drawn until `release` (the sampler's
        position saved with it stays consistent). In-flight groups are saved as prompts to resubmit."""
        self.held = True
        return {
            "version": self.bound.version,
            "consumed": self.bound.consumed,
            "serial": self.serial,
            "buffer": [(d.job, d.samples) for d in self.buffer],
            "pending": [*self.in_flight.values(), *self.retry],
        }

    async def abort(self) -> None:
        """The run is stopping (`RolloutRuntime.abort_episodes_after`): no group is submitted any more,
        and a step's `take` returns the groups it has. The groups in flight stay pending (a checkpoint
        saves them to be submitted again on resume)."""
        self.aborted = True
        await self._notify()

    async def release(self) -> None:
        self.held = False
        await self._notify()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._task is not None:
            raise RuntimeError("AsyncProducer.load_state_dict: the producer already runs")
        self.bound.version = state["version"]
        self.bound.consumed = state["consumed"]
        self.serial = state["serial"]
        self.buffer = deque(Finished(job, samples) for job, samples in state["buffer"])
        self.retry = deque(sorted(state["pending"], key=lambda j: j.serial))

    async def stop(self) -> None:
        """End the producer task and cancel the groups in flight (their requests end with the engine)."""
        self._stopping = True
        await self._notify()
        tasks = [t for t in (self._task, *self._works) if t is not None and not t.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
