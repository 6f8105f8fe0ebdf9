"""Held-out evaluation of the served policy: `evaluate`, greedy or sampled, one episode of the environment per
response, with `eval.n_samples` responses per prompt (mean@N, pass@N and the unbiased pass@k), and the metrics of
each eval file (`data.eval_path` as a list) beside the pooled ones."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_rl.config import Config
from megatron_rl.data import Prompt
from megatron_rl.envs import TurnRenderer
from megatron_rl.envs.failures import check_episode_failures
from megatron_rl.loop.collect import episodes, sampling_seed
from megatron_rl.loop.scoring import score_samples
from megatron_rl.rewards import RewardScorer
from megatron_rl.rollout.types import Engine, SamplingParams


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which c are correct (Chen et al. 2021, "Evaluating
    Large Language Models Trained on Code"): 1 - C(n - c, k) / C(n, k), as their numerically stable product."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: needs 0 <= c <= n and 1 <= k <= n, got n = {n}, c = {c}, k = {k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


async def evaluate(
    engine: Engine,
    prompts: Sequence[Prompt] | Mapping[str, Sequence[Prompt]],
    tokenizer: Any,
    scorer: RewardScorer,
    cfg: Config,
    step: int,
) -> dict[str, float]:
    """Held-out accuracy of the served policy: greedy (`eval.temperature` 0) or seeded sampling, `eval.n_samples`
    episodes of the environment (`env.*`) per prompt. `prompts` by eval file name (a mapping): the metrics of
    each file as eval/NAME/..., and the pooled ones as eval/...; a sequence: the pooled ones only."""
    files = dict(prompts) if isinstance(prompts, Mapping) else {}
    pooled = [p for ps in files.values() for p in ps] if files else list(prompts)
    n, temperature = cfg.eval.n_samples, cfg.eval.temperature

    def params(turn: int, i: int) -> SamplingParams:
        key = "eval" if turn == 0 else f"eval.{turn}"
        seed = sampling_seed(cfg.train.seed, step, key, i) if temperature > 0 else None
        return SamplingParams.from_config(cfg.rollout, temperature=temperature, sampling_seed=seed)

    rows = [p for p in pooled for _ in range(n)]
    samples = await episodes(engine, rows, params, TurnRenderer(tokenizer), cfg)
    check_episode_failures(cfg.env, samples, f"the evaluation at step {step}")
    result = await asyncio.to_thread(score_samples, cfg, scorer, tokenizer, samples, rows)
    scorer.check_failures(result.stats, f"the evaluation at step {step}")
    lengths = [len(s.output_ids) for s in samples]
    scores = _scores("eval", cfg, result.correct, result.rewards, lengths)
    start = 0
    for name, ps in files.items():
        end = start + len(ps) * n
        part = slice(start, end)
        scores.update(_scores(f"eval/{name}", cfg, result.correct[part], result.rewards[part], lengths[part]))
        start = end
    return scores


def _scores(
    prefix: str, cfg: Config, correct: Sequence[bool], rewards: Sequence[float], lengths: Sequence[int]
) -> dict[str, float]:
    """The metrics of prompts whose n = eval.n_samples responses are consecutive in `correct`, `rewards`, `lengths`."""
    n = cfg.eval.n_samples
    prompts = len(correct) // n
    out = {
        f"{prefix}/reward_mean": sum(rewards) / len(rewards),
        f"{prefix}/length_mean": sum(lengths) / len(lengths),
        f"{prefix}/prompts": float(prompts),
    }
    if n == 1:
        name = "greedy_accuracy" if cfg.eval.temperature == 0 else "accuracy"
        out[f"{prefix}/{name}"] = sum(correct) / prompts
        return out
    hits = [sum(correct[i * n : (i + 1) * n]) for i in range(prompts)]
    out[f"{prefix}/mean@{n}"] = sum(hits) / (n * prompts)
    for k in sorted({*cfg.eval.pass_k, n}):
        out[f"{prefix}/pass@{k}"] = sum(pass_at_k(n, c, k) for c in hits) / prompts
    return out
