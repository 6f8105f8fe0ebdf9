"""Held-out accuracy of a warm start: greedy (the loop's `evaluate`) and pass@n of seeded samples, coroutines
on the rollout loop.

A warm start is useful for RL when greedy accuracy is low while some of n samples are right
(pass@n high): RL then has informative groups from the first step on.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

from megatron_rl.config import Config
from megatron_rl.data import Prompt
from megatron_rl.envs import TurnRenderer
from megatron_rl.loop.collect import episodes, sampling_seed
from megatron_rl.loop.evaluation import evaluate
from megatron_rl.loop.scoring import score_samples
from megatron_rl.rewards import RewardScorer
from megatron_rl.rollout.types import Engine, SamplingParams


async def pass_at_n(
    engine: Engine, prompts: Sequence[Prompt], tokenizer: Any, scorer: RewardScorer, cfg: Config, n: int, step: int
) -> dict[str, float]:
    """`eval/pass@n`: the share of prompts with at least one correct answer among n samples at
    `rollout.temperature` (seeded per request from `train.seed` and `step`), each sample one episode
    of the environment (`env.*`); `eval/sampled_accuracy`: the share of correct samples."""
    if not prompts or n < 1:
        raise ValueError(f"pass_at_n: needs prompts and n >= 1 (got {len(prompts)} prompts, n = {n})")

    def params(turn: int, i: int) -> SamplingParams:
        key = "pass@n" if turn == 0 else f"pass@n.{turn}"
        return SamplingParams.from_config(cfg.rollout, sampling_seed=sampling_seed(cfg.train.seed, step, key, i))

    rows = [p for p in prompts for _ in range(n)]
    samples = await episodes(engine, rows, params, TurnRenderer(tokenizer), cfg)
    correct = (await asyncio.to_thread(score_samples, cfg, scorer, tokenizer, samples, rows)).correct
    hits = sum(any(correct[i * n : (i + 1) * n]) for i in range(len(prompts)))
    return {f"eval/pass@{n}": hits / len(prompts), "eval/sampled_accuracy": sum(correct) / len(correct)}


async def warm_start_scores(
    engine: Engine, prompts: Sequence[Prompt], tokenizer: Any, scorer: RewardScorer, cfg: Config, step: int
) -> dict[str, float]:
    """Greedy accuracy (`eval.temperature` 0) and pass@`rollout.n_samples_per_prompt`."""
    greedy = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, temperature=0.0, n_samples=1))
    scores = await evaluate(engine, prompts, tokenizer, scorer, greedy, step)
    scores.update(await pass_at_n(engine, prompts, tokenizer, scorer, cfg, cfg.rollout.n_samples_per_prompt, step))
    return scores
