"""Rank 0's rollout runtime: one object, one event loop, every piece of rollout state.

Only global rank 0 builds a `RolloutRuntime`; the trainer ranks reach it through
`megatron_rl.parallel.rank0.on_rank0` (see `megatron_rl.trainer`). The data is read first
(`RolloutData.load`, before the slow actor start, so bad data fails at once), which starts the rollout
side's one event loop (`megatron_rl.rollout.event_loop.RolloutLoop`, thread "rollout-runtime"); the
runtime is built from it once the engine's model folder exists, and starts the engine on that loop.

`RolloutRuntime` owns what rank 0 keeps between steps to make batches: the engine handle, the
collector (and through it the sampler, the reward scorer), the engine's idle clock, and the state of
the scheduling policy `rollout.async_mode` picks:

- `sync`: the step's batch is collected on the loop when the step asks for it;
- `one_step_off` (`OneStepOff`): the next step's batch is collected on the loop while this step
  trains; the weight sync waits for it (`finish_step`);
- `fully_async` (`AsyncProducer`): a producer task keeps groups in flight under the staleness
  bound; each step's collection takes its rounds from the producer's buffer.

Every step's record gets the `async/` metrics, `time/wait_batch` and `time/engine_idle`.

Threads and tasks, and what each may touch (docs/architecture.md's table is the full list):

- **the trainer's main thread** (the owner of `handoff`) calls `collect`, `finish_step`,
  `checkpoint_state`, `load_state_dict`, `evaluate` and `close`. It never touches the policy state
  itself: each call hands a coroutine to the loop and waits for it (`run`, bounded), running
  meanwhile what the loop hands it: a restarted local engine's weight resync, a collective of every
  trainer rank (the weight sync's state is the main thread's alone). `OneStepOff`'s `ready` batch is
  the exception: it is only set by the main thread, from a finished collection's result.
- **the loop's thread** ("rollout-runtime") runs everything else of the rollout side, and owns the
  policy state (`AsyncProducer`'s counts, buffer, retries and jobs in flight: no lock), the sampler's
  draws and the engine's restart supervision:
  - one **collection task** per step (`collector.collect`): its generation rounds, its episodes
    (each a coroutine: generate, environment step, generate...; agents through the gateway's site,
    on this loop too), then the rewards;
  - in `fully_async`, the **producer task** (`AsyncProducer._run`), which submits a group per
    free worker slot, and one **group task** per group in flight (`AsyncProducer._work`);
  - with a teacher (`distill`), its **scoring** of each round's or group's episodes, inside their
    collection or group task (`megatron_rl.loop.distill`), on the teacher's own engine handle;
  - the held-out **evaluation**, while nothing else collects;
  - after a stop signal, `checkpoint.preempt_timeout_s` later, the **abort** ("abort-episodes"), which
    ends the episodes still running (`megatron_rl.rollout.preempt`) and, in `fully_async`, stops the
    producer's submissions (a step then takes the groups it has).
- **worker threads**, touching only what they are given: a plain environment `step` on a daemon
  thread of its own (at most `env.max_concurrent_steps` at once), a plain agent function's thread, the
  reward scoring (`asyncio.to_thread`: the scorer blocks on its worker processes, or on the remote
  reward client it runs back on the loop), a dead local engine's start (`asyncio.to_thread`), the
  gateway's render threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import pickle
import time
from collections.abc import Coroutine, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from megatron_rl.algorithms import GroupFilterError
from megatron_rl.config import Config, ConfigError, prompts_per_round
from megatron_rl.config.data_files import eval_files, train_files
from megatron_rl.data import LoadReport, Prompt, PromptDataset, PromptSampler, WeightedSampler, pooled
from megatron_rl.envs import Trajectory
from megatron_rl.envs.episodes import EnvRewardError
from megatron_rl.envs.failures import EnvStartError, EpisodeFailureError
from megatron_rl.loop.async_rollout import AsyncProducer, BusyMeter, Job, OneStepOff, staleness_metrics
from megatron_rl.loop.collect import RolloutCollector, StepBatch
from megatron_rl.loop.distill import check_teacher_tokenizer
from megatron_rl.loop.evaluation import evaluate
from megatron_rl.models.source import tokenizer_source
from megatron_rl.parallel.launch import read_launch_env
from megatron_rl.parallel.layout import check_layout
from megatron_rl.rewards import RewardScorer
from megatron_rl.rollout.event_loop import RolloutLoop
from megatron_rl.rollout.handoff import MainThreadCalls
from megatron_rl.rollout.preempt import abort_episodes
from megatron_rl.rollout.teacher import Teacher, TeacherError, start_teacher
from megatron_rl.rollout.types import Engine

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)
T = TypeVar("T")
# the producer's bookkeeping calls (`synced`, `settle`, `hold`, ...) never wait for a generation
CONTROL_TIMEOUT_S = 60.0

# the rollout's own stops, each one line (`megatron_rl.trainer.RUN_ERRORS`): a NaN turn reward, an environment
# that cannot start, more failed episodes than env.max_failure_frac, a teacher that cannot score (distill),
# a dynamic-sampling filter that raised or returned no bool
ROLLOUT_ERRORS: tuple[type[Exception], ...] = (
    EnvRewardError,
    EnvStartError,
    EpisodeFailureError,
    TeacherError,
    GroupFilterError,
)


def _summed(parts: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            out[key] = out.get(key, 0.0) + value
    return out


def data_metrics(prefix: str, report: LoadReport) -> dict[str, float]:
    """`data/<prefix>_rows_kept`, `_rows_skipped` and the skips per reason of one loaded file."""
    out = {f"data/{prefix}_rows_kept": float(report.kept), f"data/{prefix}_rows_skipped": float(len(report.skipped))}
    out[f"data/{prefix}_unk_tokens"] = float(report.unk_tokens)  # characters outside the tokenizer's vocabulary
    out.update({f"data/{prefix}_skipped_{reason}": float(n) for reason, n in report.counts.items()})
    return out


@dataclass(frozen=True)
class TrainPrompts:
    """The tokenizer and the usable prompts of each train file, as rank 0 reads them; with `train.epochs` every
    rank reads them first, for the step count (`config.epochs`)."""

    tokenizer: PreTrainedTokenizerBase
    datasets: list[PromptDataset]

    @classmethod
    def load(cls, cfg: Config) -> TrainPrompts:
        from megatron_rl.data import load_prompt_dataset, load_tokenizer

        tokenizer = load_tokenizer(*tokenizer_source(cfg), vocab_size=cfg.model.vocab_size)
        return cls(tokenizer, [load_prompt_dataset(f.path, tokenizer, cfg.data) for f in train_files(cfg.data)])

    @property
    def count(self) -> int:
        """The usable prompts of all the files."""
        return sum(len(ds) for ds in self.datasets)


@dataclass(frozen=True)
class RolloutData:
    """What rank 0 reads from `data` and `reward` before anything starts, and the rollout side's event
    loop (started here: the remote-reward client's start-up check runs on it)."""

    tokenizer: PreTrainedTokenizerBase
    sampler: PromptSampler[Prompt] | WeightedSampler
    eval_prompts: list[Prompt] | dict[str, list[Prompt]]  # by eval file name when data.eval_path is a list
    scorer: RewardScorer
    metrics: dict[str, float]  # the load reports' `data/` counts (summed over the files), added to every step
    loop: RolloutLoop

    @classmethod
    def load(cls, cfg: Config, prompts: TrainPrompts | None = None) -> RolloutData:
        """`prompts`: the train files already read (`TrainPrompts.load`), else read here."""
        from megatron_rl.data import load_prompt_dataset

        prompts = TrainPrompts.load(cfg) if prompts is None else prompts
        tokenizer, train, files = prompts.tokenizer, prompts.datasets, train_files(cfg.data)
        metrics = _summed([data_metrics("train", ds.report) for ds in train])
        held_out = {f.name: load_prompt_dataset(f.path, tokenizer, cfg.data) for f in eval_files(cfg.data)}
        metrics.update(_summed([data_metrics("eval", ds.report) for ds in held_out.values()]))
        eval_sets = {name: list(ds)[: cfg.eval.max_prompts] for name, ds in held_out.items()}
        eval_prompts = eval_sets.get("", []) if set(eval_sets) <= {""} else eval_sets
        if files[0].weight is None:
            sampler: PromptSampler[Prompt] | WeightedSampler = PromptSampler.from_config(
                train[0] if len(train) == 1 else pooled(train), cfg.data
            )
        else:
            sampler = WeightedSampler(train, [f.weight for f in files], cfg.data.shuffle, cfg.data.seed)
        if cfg.distill.enabled:
            check_teacher_tokenizer(cfg, tokenizer)
        loop = RolloutLoop()
        try:
            scorer = RewardScorer(cfg.reward, run=loop.run)
        except BaseException:
            loop.close()
            raise
        return cls(tokenizer, sampler, eval_prompts, scorer, metrics, loop)

    def close(self) -> None:
        """End the scorer's reward worker processes (if it started any), then the event loop."""
        try:
            self.scorer.close()
        finally:
            self.loop.close()


def spawn_engine_early(cfg: Config, engine_log: Path) -> Any:
    """Rank 0's local engine spawned now, when the folder it serves is the policy's HF folder (known
    before the actor starts): it loads its model while the actor is built, and `RolloutRuntime(starting=...)`
    waits for it. None for SGLang servers and for a policy exported at start-up (no HF folder)."""
    from megatron_rl.rollout.engine import spawn_local

    if not cfg.rollout.uses_local_engine or cfg.model.hf_path is None:
        return None
    return spawn_local(cfg.rollout, cfg.model.hf_path, log_path=str(engine_log))


SERVER_CHECK_TIMEOUT_S = 30.0  # each request of `check_rollout_servers`


def check_rollout_servers(cfg: Config, loop: RolloutLoop) -> None:
    """Rank 0, before the slow model start: the SGLang servers or router of `rollout.sglang_urls` answer from here
    and take the key, asked as the engine's start asks (the router discovery, `GET /workers`, once, no retries,
    on `loop`). ConfigError naming the address and what happened (connection refused, HTTP 401, ...); nothing to
    do for the local engine."""
    from megatron_rl.rollout.engine import configured_api_key
    from megatron_rl.rollout.local.launcher import API_KEY_ENV
    from megatron_rl.rollout.sglang import SGLangClient, SGLangError, UnauthorizedError

    ro = cfg.rollout
    if ro.uses_local_engine:
        return

    async def discover() -> None:
        key = configured_api_key(ro)
        async with SGLangClient(ro.sglang_urls, api_key=key, timeout_s=SERVER_CHECK_TIMEOUT_S, max_retries=0) as client:
            await client.use_router()

    try:
        loop.run(discover(), 2 * SERVER_CHECK_TIMEOUT_S)
    except UnauthorizedError as err:
        raise ConfigError(f"rollout.sglang_urls: {err}; the key sent is rollout.api_key, else ${API_KEY_ENV}") from None
    except SGLangError as err:
        raise ConfigError(f"rollout.sglang_urls: {err}") from None


def collection_bound_s(cfg: Config, prompts: int) -> float:
    """The longest the main thread waits for one collection or evaluation of `prompts` prompts per round
    (past it: TimeoutError, a bug rather than slowness). The sum of the bounds of its parts: each round's
    requests go out `rollout.max_concurrency` at a time, each turn a request (every try's timeout, a
    restart's resync) then an environment step, or an agent's whole episode; then its rewards, scored one
    at a time at worst (each within reward.item_timeout_s, or the remote client's bound)."""
    ro, env, rw = cfg.rollout, cfg.env, cfg.reward
    requests = prompts * ro.n_samples_per_prompt
    request_s = (ro.max_retries + 2) * ro.request_timeout_s
    episode_s = max(env.max_turns * (request_s + env.step_timeout_s), env.agent_timeout_s + request_s)
    waves = math.ceil(requests / ro.max_concurrency)
    tries = rw.max_retries + 1
    rewards_s = requests * rw.item_timeout_s + tries * (rw.timeout_s + rw.retry_backoff_s * 2**tries)
    return cfg.algorithm.max_gen_rounds * (waves * episode_s + rewards_s)


class RolloutRuntime:
    """Rank 0's rollout side (see the module doc): starts (or connects to) the engine on `model_path` on
    the data's event loop, collects each step's batch, evaluates, and closes it all."""

    def __init__(
        self,
        cfg: Config,
        data: RolloutData,
        *,
        model_path: str | None,
        engine_log: Path,
        engine: Engine | None = None,
        starting: Any = None,
        teacher: Teacher | None = None,
    ) -> None:
        """`engine`: one already started (the tests' fake engine), instead of starting or connecting to
        the configured one; `starting`: the local engine `spawn_engine_early` spawned (waited for here);
        `teacher`: on-policy distillation's, already started, instead of the configured one (`distill`)."""
        from megatron_rl.rollout.engine import RolloutEngine

        self.cfg, self.data, self.loop = cfg, data, data.loop
        self.handoff = MainThreadCalls()  # the resync of a restarted engine runs on this, the main, thread
        if engine is None:
            # `engine_log` is only used by a local engine; SGLang servers log where they were started
            engine = RolloutEngine.from_config(
                cfg.rollout,
                self.loop,
                model_path=model_path,
                starting=starting,
                model=cfg.model,
                log_path=str(engine_log),
            )
            engine.handoff = self.handoff
        self.engine = engine
        if teacher is None and cfg.distill.enabled:
            try:
                teacher = start_teacher(cfg.rollout, cfg.distill, self.loop, str(engine_log.with_name("teacher.log")))
            except BaseException:
                engine.close()
                raise
        self.teacher = teacher
        # the batch is split over the data-parallel ranks (validate_run checked this layout)
        dp = check_layout(cfg.parallel, read_launch_env().world_size).data_parallel_size
        self.collector = RolloutCollector(
            cfg, engine, data.tokenizer, data.scorer, data.sampler, min_samples=dp, teacher=teacher
        )
        self.collect_timeout_s = collection_bound_s(cfg, prompts_per_round(cfg))
        self.meter = BusyMeter()
        self.aborted = False  # the episodes were aborted: the run stops after this step
        mode = cfg.rollout.async_mode
        self.one_step_off = OneStepOff(self._submit_collect, self._wait) if mode == "one_step_off" else None
        self.producer = (
            AsyncProducer(cfg, self._generate_job, self._next_prompt, self.meter) if mode == "fully_async" else None
        )

    def _step_metrics(self) -> dict[str, float]:
        return {
            **self.data.metrics,
            "data/epoch": self.data.sampler.epochs_drawn,
            "rollout/engine_restarts": float(self.engine.restarts),  # so far in this process
        }

    # ---- from the main thread ----
    def run(self, coro: Coroutine[Any, Any, T], timeout: float = CONTROL_TIMEOUT_S) -> T:
        """`coro`'s result, run on the loop; TimeoutError after `timeout` seconds. The main thread runs what
        is handed to it while it waits."""
        return self.loop.run(coro, timeout, self.handoff)

    def _wait(self, future: Future[T]) -> T:
        """(The main thread.) A collection's result, running what is handed to it meanwhile."""
        return self.handoff.wait_future(future, self.collect_timeout_s)

    def abort_episodes_after(self, delay_s: float) -> None:
        """(Any thread; a signal handler too.) The abort (see the module doc) `delay_s` seconds from now."""

        def start() -> None:
            self.loop.loop.create_task(self._abort(), name="abort-episodes")

        loop = self.loop.loop
        with contextlib.suppress(RuntimeError):  # the loop already closed (the signal came during the shutdown)
            loop.call_soon_threadsafe(loop.call_later, delay_s, start)

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
        plan = await self.collector.collect(step, self._round)
        plan.metrics.update(self._step_metrics())
        return plan

    def _submit_collect(self, step: int) -> Future[StepBatch]:
        return self.loop.submit(self._collect(step))

    async def _round(self, n: int, step: int, round_: int, kept: int) -> tuple[list[Prompt], list[list[Trajectory]]]:
        if self.producer is not None:
            return await self.producer.take(n, kept)
        with self.meter.busy():
            return await self.collector.generate_round(n, step, round_, kept)

    async def _generate_job(self, job: Job) -> list[Trajectory]:
        """One fully asynchronous group, seeded by its serial number and attempt (not by the step it lands in)."""
        return (await self.collector.generate([job.prompt], job.serial, f"async.{job.attempt}"))[0]

    def _next_prompt(self) -> Prompt:
        return self.collector.sampler.next(1)[0]

    # ---- the trainer's calls ----
    def collect(self, step: int, version: int = 0) -> StepBatch:
        """The step's batch and its rollout metrics (with the data counts, the engine's restarts and the `async/` metrics);
        `version`: the trainer's weight version at the start of the step (the last one synced)."""
        began = time.perf_counter()
        if self.producer is not None:
            self.run(self.producer.synced(version))
        if self.one_step_off is not None:
            plan, waited = self.one_step_off.take(step)
            if step < self.cfg.train.steps:
                self.one_step_off.start(step + 1)  # generates with the weights this step starts from
        else:
            plan = self.run(self._collect(step), self.collect_timeout_s)
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

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out accuracy of the served policy, with `time/eval` ({} once the episodes were aborted)."""
        col, prompts = self.collector, self.data.eval_prompts
        if self.aborted:
            return {}
        began = time.perf_counter()
        count = sum(map(len, prompts.values())) if isinstance(prompts, dict) else len(prompts)
        with self.meter.busy():
            scores = self.run(
                evaluate(col.engine, prompts, col.tokenizer, col.scorer, self.cfg, step),
                collection_bound_s(self.cfg, count * self.cfg.eval.n_samples),
            )
        scores["time/eval"] = time.perf_counter() - began
        return scores

    def close(self) -> None:
        """Stop the producer and cancel what still runs on the loop, then the engine (the local engine's child
        process) or disconnect, then the reward worker processes (a collection still scoring gets failures,
        not new workers) and the loop (`RolloutData.close`, the trainer's)."""
        try:
            self.handoff.close()  # a coroutine waiting for the main thread ends
            self.run(self._shutdown())
        except Exception as err:  # closing on an error path: the run's own error is the one reported
            log.warning("rollout runtime: closing: %s: %s", type(err).__name__, err)
        finally:
            try:
                self.engine.close()
            finally:
                if self.teacher is not None:
                    self.teacher.close()

    async def _shutdown(self) -> None:
        if self.producer is not None:
            await self.producer.stop()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
