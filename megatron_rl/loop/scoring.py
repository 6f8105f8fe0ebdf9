"""Rewards of a round's episodes: the reward rule on their decoded text (or the agents' own rewards),
then DAPO's soft overlong shaping, grouped by prompt (`Group`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_rl.algorithms import soft_overlong_penalty
from megatron_rl.config import Config
from megatron_rl.data import Prompt
from megatron_rl.envs import Trajectory
from megatron_rl.rewards import RewardResult, RewardScorer, RewardStats


@dataclass
class Group:
    """One prompt's episodes: `scores` from the reward rule, `rewards` after overlong shaping,
    `failed`: whether the reward function failed on each (its score is then reward.failure_reward)."""

    prompt: Prompt
    episodes: list[Trajectory]
    scores: list[float]
    rewards: list[float]
    failed: list[bool] = field(default_factory=list)


def score_groups(
    cfg: Config,
    scorer: RewardScorer,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    grouped: Sequence[Sequence[Trajectory]],
) -> tuple[list[Group], RewardStats]:
    """Rule rewards and shaped rewards of every group (`grouped[k]`: the episodes of `prompts[k]`)."""
    alg, ro = cfg.algorithm, cfg.rollout
    if not grouped:  # every group of the round was aborted
        return [], RewardStats()
    flat = [e for group in grouped for e in group]
    rows = [p for p, group in zip(prompts, grouped, strict=True) for _ in group]
    result = score_samples(cfg, scorer, tokenizer, flat, rows)
    shaped = torch.tensor(result.rewards, dtype=torch.float32)
    if alg.soft_overlong_punishment:
        lengths = torch.tensor([len(e.output_ids) for e in flat])
        shaped = shaped + soft_overlong_penalty(
            lengths, ro.max_new_tokens, alg.overlong_buffer_len, alg.overlong_penalty_factor
        )
    groups, start = [], 0
    for prompt, group in zip(prompts, grouped, strict=True):
        end = start + len(group)
        rewards = shaped[start:end].tolist()
        groups.append(Group(prompt, list(group), result.rewards[start:end], rewards, result.failed[start:end]))
        start = end
    return groups, result.stats


def score_samples(
    cfg: Config, scorer: RewardScorer, tokenizer: Any, episodes: Sequence[Trajectory], rows: Sequence[Prompt]
) -> RewardResult:
    """The scores of `episodes` (rows[i] the prompt of episode i): the reward rule on their decoded text,
    or the agents' own rewards with `env.agent_reward`."""
    if cfg.env.type == "agent" and cfg.env.agent_reward:
        return agent_rewards(cfg, episodes)
    texts = tokenizer.batch_decode([e.output_ids for e in episodes], skip_special_tokens=True)
    return scorer.score_prompts(texts, rows)


def agent_rewards(cfg: Config, episodes: Sequence[Trajectory]) -> RewardResult:
    """`env.agent_reward`: the reward each episode's agent returned (`meta_info["agent_reward"]`) as its
    score; correct when at least reward.correct_reward; none is a failed reward (reward.failure_reward)."""
    given = [e.meta_info.get("agent_reward") for e in episodes]
    failed = [r is None for r in given]
    rewards = [cfg.reward.failure_reward if r is None else float(r) for r in given]
    correct = [not f and r >= cfg.reward.correct_reward for r, f in zip(rewards, failed, strict=True)]
    missing = sum(failed)
    stats = RewardStats(
        count=len(episodes),
        correct=sum(correct),
        failed=missing,
        reward_sum=sum(rewards),
        errors=[f"env.agent_reward: {missing} agent(s) returned no reward"] if missing else [],
    )
    return RewardResult(rewards, correct, failed, [None] * len(episodes), stats)
