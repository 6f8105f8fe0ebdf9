"""Rank 0's half of the RL loop: the prompts, the tokenizer, the reward scorer, the rollout engine,
each step's batch and the held-out evaluation. Only global rank 0 builds a `RolloutDriver`; the
trainer ranks reach it through `megatron_rl.parallel.rank0.on_rank0` (see `megatron_rl.trainer`).

The data is read first (`RolloutData.load`, before the slow actor start, so bad data fails at
once); the driver is built from it once the engine's model folder exists, and starts the engine.

The steps' batches, the evaluation and what a checkpoint holds of the rollout side come from the
rollout runtime (`megatron_rl.loop.runtime.RolloutRuntime`: one event loop, every piece of rollout
state, `rollout.async_mode` its scheduling policy): `sync` collects a batch when the step asks;
`one_step_off` hands over the batch collected during the previous step and starts the next one;
`fully_async` takes it from the producer's buffer. Every step's record gets the `async/` metrics,
`time/wait_batch` and `time/engine_idle`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_rl.config import Config, ConfigError
from megatron_rl.data import LoadReport, Prompt, PromptSampler
from megatron_rl.envs.episodes import EnvRewardError
from megatron_rl.envs.failures import EnvStartError, EpisodeFailureError
from megatron_rl.loop.async_rollout import AsyncProducer
from megatron_rl.loop.collect import RolloutCollector, StepBatch
from megatron_rl.loop.runtime import RolloutRuntime
from megatron_rl.models.source import tokenizer_source
from megatron_rl.parallel.launch import read_launch_env
from megatron_rl.parallel.layout import check_layout
from megatron_rl.rewards import RewardScorer
from megatron_rl.rollout.handoff import MainThreadCalls

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from megatron_rl.rollout.engine import RolloutEngine

# the rollout's own stops, each one line (`megatron_rl.trainer.RUN_ERRORS`): a NaN turn reward, an environment
# that cannot start, more failed episodes than env.max_failure_frac
ROLLOUT_ERRORS: tuple[type[Exception], ...] = (EnvRewardError, EnvStartError, EpisodeFailureError)


def data_metrics(prefix: str, report: LoadReport) -> dict[str, float]:
    """`data/<prefix>_rows_kept`, `_rows_skipped` and the skips per reason of one loaded file."""
    out = {f"data/{prefix}_rows_kept": float(report.kept), f"data/{prefix}_rows_skipped": float(len(report.skipped))}
    out[f"data/{prefix}_unk_tokens"] = float(report.unk_tokens)  # characters outside the tokenizer's vocabulary
    out.update({f"data/{prefix}_skipped_{reason}": float(n) for reason, n in report.counts.items()})
    return out


@dataclass(frozen=True)
class RolloutData:
    """What rank 0 reads from `data` and `reward` before anything starts."""

    tokenizer: PreTrainedTokenizerBase
    sampler: PromptSampler[Prompt]
    eval_prompts: list[Prompt]
    scorer: RewardScorer
    metrics: dict[str, float]  # the load reports' `data/` counts, added to every step's record

    @classmethod
    def load(cls, cfg: Config) -> RolloutData:
        from megatron_rl.data import load_prompt_dataset, load_tokenizer

        tokenizer = load_tokenizer(*tokenizer_source(cfg), vocab_size=cfg.model.vocab_size)
        train = load_prompt_dataset(cfg.data.train_path, tokenizer, cfg.data)
        metrics = data_metrics("train", train.report)
        eval_prompts: list[Prompt] = []
        if cfg.data.eval_path:
            held_out = load_prompt_dataset(cfg.data.eval_path, tokenizer, cfg.data)
            metrics.update(data_metrics("eval", held_out.report))
            eval_prompts = list(held_out)[: cfg.eval.max_prompts]
        sampler = PromptSampler.from_config(train, cfg.data)
        return cls(tokenizer, sampler, eval_prompts, RewardScorer(cfg.reward), metrics)

    def close(self) -> None:
        """End the scorer's reward worker processes (if it started any)."""
        self.scorer.close()


def spawn_engine_early(cfg: Config, engine_log: Path) -> Any:
    """Rank 0's local engine spawned now, when the folder it serves is the policy's HF folder (known
    before the actor starts): it loads its model while the actor is built, and `RolloutDriver(starting=...)`
    waits for it. None for SGLang servers and for a policy exported at start-up (no HF folder)."""
    from megatron_rl.rollout.engine import spawn_local

    if not cfg.rollout.uses_local_engine or cfg.model.hf_path is None:
        return None
    return spawn_local(cfg.rollout, cfg.model.hf_path, log_path=str(engine_log))


SERVER_CHECK_TIMEOUT_S = 30.0  # each request of `check_rollout_servers`


def check_rollout_servers(cfg: Config) -> None:
    """Rank 0, before the slow model start: the SGLang servers or router of `rollout.sglang_urls` answer from here
    and take the key, asked as the engine's start asks (the router discovery, `GET /workers`, once, no retries).
    ConfigError naming the address and what happened (connection refused, HTTP 401, ...); nothing to do for the
    local engine."""
    import asyncio

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
        asyncio.run(discover())
    except UnauthorizedError as err:
        raise ConfigError(f"rollout.sglang_urls: {err}; the key sent is rollout.api_key, else ${API_KEY_ENV}") from None
    except SGLangError as err:
        raise ConfigError(f"rollout.sglang_urls: {err}") from None


class RolloutDriver:
    """Rank 0's rollout side: starts (or connects to) the engine on `model_path` and closes it."""

    def __init__(
        self,
        cfg: Config,
        data: RolloutData,
        *,
        model_path: str | None,
        engine_log: Path,
        engine: Any = None,
        starting: Any = None,
    ) -> None:
        """`engine`: one already started (anything with the `RolloutEngine` methods the loop calls: generate,
        close), instead of starting or connecting to the configured one; `starting`: the local engine
        `spawn_engine_early` spawned (waited for here)."""
        from megatron_rl.rollout.engine import RolloutEngine

        self.cfg = cfg
        self.data = data
        # `engine_log` is only used by a local engine; SGLang servers log where they were started
        self.engine: RolloutEngine = engine or RolloutEngine.from_config(
            cfg.rollout, model_path=model_path, starting=starting, model=cfg.model, log_path=str(engine_log)
        )
        # the batch is split over the data-parallel ranks (validate_run checked this layout)
        dp = check_layout(cfg.parallel, read_launch_env().world_size).data_parallel_size
        self.collector = RolloutCollector(cfg, self.engine, data.tokenizer, data.scorer, data.sampler, min_samples=dp)
        # the engine hands restarts (and their weight resync) to this, the main, thread
        self.handoff = MainThreadCalls()
        self.engine.handoff = self.handoff
        self.runtime = RolloutRuntime(cfg, self.collector, self.handoff, self._step_metrics)

    def _step_metrics(self) -> dict[str, float]:
        return {**self.data.metrics, "rollout/engine_restarts": float(self.engine.restarts)}  # so far in this process

    @property
    def producer(self) -> AsyncProducer | None:
        return self.runtime.producer

    # ---- the trainer's calls ----
    def collect(self, step: int, version: int = 0) -> StepBatch:
        """The step's batch and its rollout metrics (with the data counts and the `async/` metrics);
        `version`: the trainer's weight version at the start of the step (the last one synced)."""
        return self.runtime.collect(step, version)

    def finish_step(self) -> dict[str, float]:
        """Before the step's weight sync: `one_step_off` waits for the next batch (so that the sync never
        races its generation); the seconds waited and the engine's idle seconds of the step."""
        return self.runtime.finish_step()

    @contextlib.contextmanager
    def checkpoint_state(self) -> Iterator[bytes]:
        """What a checkpoint holds of the rollout side (`RolloutRuntime.checkpoint_state`)."""
        with self.runtime.checkpoint_state() as state:
            yield state

    def load_state_dict(self, saved_state: bytes) -> None:
        """Continue from `checkpoint_state`'s bytes (`RolloutRuntime.load_state_dict`)."""
        self.runtime.load_state_dict(saved_state)

    def abort_episodes_after(self, delay_s: float) -> None:
        """After a stop signal (from its handler): the episodes still running `delay_s` seconds from now
        are aborted, so that the step ends (`RolloutRuntime.abort_episodes_after`)."""
        self.runtime.abort_episodes_after(delay_s)

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out accuracy of the served policy, with `time/eval` ({} once the episodes were aborted)."""
        began = time.perf_counter()
        scores = self.runtime.evaluate(self.data.eval_prompts, step)
        if scores:
            scores["time/eval"] = time.perf_counter() - began
        return scores

    def close(self) -> None:
        """Stop the rollout runtime, then the engine (the local engine's child process) or disconnect,
        then the reward worker processes (a collection still scoring gets failures, not new workers)."""
        try:
            self.handoff.close()  # a worker waiting for the main thread ends
            self.runtime.close()
        finally:
            try:
                self.engine.close()
            finally:
                self.data.close()
