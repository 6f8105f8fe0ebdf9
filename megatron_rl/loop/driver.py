"""Rank 0's half of the RL loop: the prompts, the tokenizer, the reward scorer, the rollout engine,
each step's batch and the held-out evaluation. Only global rank 0 builds a `RolloutDriver`; the
trainer ranks reach it through `megatron_rl.parallel.rank0.on_rank0` (see `megatron_rl.trainer`).

The data is read first (`RolloutData.load`, before the slow actor start, so bad data fails at
once); the driver is built from it once the engine's model folder exists, and starts the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rl.config import Config
from megatron_rl.data import LoadReport, Prompt, PromptSampler
from megatron_rl.loop.collect import RolloutCollector, StepBatch, evaluate
from megatron_rl.models.source import tokenizer_source
from megatron_rl.parallel.launch import read_launch_env
from megatron_rl.parallel.layout import check_layout
from megatron_rl.rewards import RewardScorer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from megatron_rl.rollout.engine import RolloutEngine


def data_metrics(prefix: str, report: LoadReport) -> dict[str, float]:
    """`data/<prefix>_rows_kept`, `_rows_skipped` and the skips per reason of one loaded file."""
    out = {f"data/{prefix}_rows_kept": float(report.kept), f"data/{prefix}_rows_skipped": float(len(report.skipped))}
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

        tokenizer = load_tokenizer(*tokenizer_source(cfg))
        train = load_prompt_dataset(cfg.data.train_path, tokenizer, cfg.data)
        metrics = data_metrics("train", train.report)
        eval_prompts: list[Prompt] = []
        if cfg.data.eval_path:
            held_out = load_prompt_dataset(cfg.data.eval_path, tokenizer, cfg.data)
            metrics.update(data_metrics("eval", held_out.report))
            eval_prompts = list(held_out)[: cfg.eval.max_prompts]
        sampler = PromptSampler.from_config(train, cfg.data)
        return cls(tokenizer, sampler, eval_prompts, RewardScorer(cfg.reward), metrics)


class RolloutDriver:
    """Rank 0's rollout side: starts (or connects to) the engine on `model_path` and closes it."""

    def __init__(self, cfg: Config, data: RolloutData, *, model_path: str | None, engine_log: Path) -> None:
        from megatron_rl.rollout.engine import RolloutEngine

        self.cfg = cfg
        self.data = data
        # `engine_log` is only used by a local engine; SGLang servers log where they were started
        self.engine: RolloutEngine = RolloutEngine.from_config(
            cfg.rollout, model_path=model_path, log_path=str(engine_log)
        )
        # the batch is split over the data-parallel ranks (validate_run checked this layout)
        dp = check_layout(cfg.parallel, read_launch_env().world_size).data_parallel_size
        self.collector = RolloutCollector(cfg, self.engine, data.tokenizer, data.scorer, data.sampler, min_samples=dp)

    def collect(self, step: int) -> StepBatch:
        """The step's batch and its rollout metrics (with the data counts)."""
        plan = self.collector.collect(step)
        plan.metrics.update(self.data.metrics)
        plan.metrics["rollout/engine_restarts"] = float(self.engine.restarts)  # so far in this process
        return plan

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out accuracy of the served policy, with `time/eval`."""
        began = time.perf_counter()
        data = self.data
        scores = evaluate(self.engine, data.eval_prompts, data.tokenizer, data.scorer, self.cfg, step)
        scores["time/eval"] = time.perf_counter() - began
        return scores

    def close(self) -> None:
        """Stop the engine (the local engine's child process) or disconnect from the servers."""
        self.engine.close()
