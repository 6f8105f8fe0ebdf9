"""One step's training batch from the rollout engine: generate, reward, shape, filter, advantages.

`RolloutCollector.collect(step)` runs on the rank that drives the engine (rank 0): steps 1-4 of the
step in docs/architecture.md (generate, reward and shape, dynamic sampling, advantages and the
`ActorBatch`).

Aborted requests (the engine's finish reason "abort": an engine error, a timeout, a paused or
disconnected request) are not trained on: a group with an aborted response is left out whole, before
rewards and dynamic sampling (its advantages would compare against a response that never finished);
`rollout/aborted` counts the aborted responses, `groups/aborted` the groups left out.

The rounds' groups come from a `source`: by default the sampler's next prompts, generated now; in
`rollout.async_mode=fully_async` the producer's buffer (`megatron_rl.loop.async_rollout`), whose
groups are seeded by their own serial number. `StepBatch.versions` holds the weight version of every
trained token (the `async/` staleness metrics).

A batch is split over the data-parallel ranks, one sample each at least: a short batch (dynamic
sampling out of rounds) with fewer samples than `min_samples` (the DP size) is dropped, the step is
skipped and `groups/short_batch_dropped` is 1; one with fewer than `train.updates_per_step` x DP
samples gets fewer mini-batches (the actor's `mini_batches`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.agents import run_agent_episodes
from megatron_rl.algorithms import (
    DynamicSamplingAccumulator,
    group_advantages,
    per_turn_advantages,
    soft_overlong_penalty,
)
from megatron_rl.algorithms.dynamic_sampling import filter_groups
from megatron_rl.config import Config
from megatron_rl.data import Prompt
from megatron_rl.envs import (
    Trajectory,
    TurnRenderer,
    environment_factory,
    episode_metrics,
    run_episodes,
    segments_of,
)
from megatron_rl.envs.failures import check_episode_failures
from megatron_rl.loop.async_rollout import trained_versions
from megatron_rl.rewards import RewardResult, RewardScorer, RewardStats
from megatron_rl.rollout.types import Engine, Sample, SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")


def sampling_seed(base: int, step: int, round_: int | str, index: int) -> int:
    """The rollout seed of request `index` of generation round `round_` of `step`: in [0, 2**63)."""
    digest = hashlib.blake2b(f"{base}/{step}/{round_}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


# (n, step, round, informative groups kept so far) -> the round's prompts and their groups
RoundSource = Callable[[int, int, int, int], Awaitable[tuple[list[Prompt], list[list[Sample]]]]]


@dataclass
class Group:
    """One prompt's responses: `scores` from the reward rule, `rewards` after overlong shaping,
    `failed`: whether the reward function failed on each (its score is then reward.failure_reward)."""

    prompt: Prompt
    samples: list[Sample]
    scores: list[float]
    rewards: list[float]
    failed: list[bool] = field(default_factory=list)


@dataclass
class StepBatch:
    """The batch to train on (None when no group was usable) and the rollout metrics of the step;
    `rewards`: float32 [N], the shaped reward of each sample of `batch` (its episode's: its advantages'
    input); `episodes`: int64 [N], the episode each sample is a sequence of, when an agent episode gave
    several (`segments_of`), else None (sample i is episode i)."""

    batch: ActorBatch | None
    metrics: dict[str, float]
    rewards: torch.Tensor | None = None
    versions: list[list[int]] | None = None  # the weight version of each trained token, per sample of `batch`
    episodes: torch.Tensor | None = None


def advantages_of(cfg: Config, rewards: torch.Tensor) -> list[torch.Tensor]:
    """Group advantages (`algorithm.adv_norm_std`, `adv_eps`) of [N] rewards, one 0-dim tensor per sample."""
    alg = cfg.algorithm
    adv = group_advantages(rewards, cfg.rollout.n_samples_per_prompt, norm_std=alg.adv_norm_std, eps=alg.adv_eps)
    return list(adv.unbind(0))


def kl_penalized_advantages(
    cfg: Config, rewards: torch.Tensor, kl_sums: torch.Tensor, episodes: torch.Tensor | None = None
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """`algorithm.kl_in_reward`: group advantages of R_i - beta * KL_i, KL_i a response's summed
    per-token KL to the reference (verl's `use_kl_in_reward` with the outcome advantage of GRPO).
    `episodes` [N] (`StepBatch.episodes`): the episode of each sequence; an episode's KL is the sum
    over its sequences, and each of them gets the episode's advantage."""
    if kl_sums.shape != rewards.shape:
        raise ValueError(f"kl_sums has shape {tuple(kl_sums.shape)}, rewards has {tuple(rewards.shape)}")
    rewards, kl_sums = rewards.to(torch.float32), kl_sums.to(torch.float32)
    if episodes is not None:
        if episodes.shape != rewards.shape:
            raise ValueError(f"episodes has shape {tuple(episodes.shape)}, rewards has {tuple(rewards.shape)}")
        owner = episodes.to(torch.long)
        count = int(owner.max()) + 1 if owner.numel() else 0
        rewards = torch.zeros(count).index_copy_(0, owner, rewards)  # a sequence carries its episode's reward
        kl_sums = torch.zeros(count).index_add_(0, owner, kl_sums)
    penalty = cfg.algorithm.kl_coef * kl_sums
    metrics = {
        "reward/kl_penalty_mean": float(penalty.mean()),
        "reward/kl_penalized_mean": float((rewards - penalty).mean()),
    }
    advantages = advantages_of(cfg, rewards - penalty)
    if episodes is not None:
        advantages = [advantages[e] for e in episodes.tolist()]
    return advantages, metrics


class RolloutCollector:
    """Builds each step's batch from `engine` (anything with `generate(prompts, params, return_routed_experts)`)."""

    def __init__(
        self, cfg: Config, engine: Engine, tokenizer: Any, scorer: RewardScorer, sampler: Any, *, min_samples: int = 1
    ) -> None:
        self.cfg = cfg
        self.engine = engine
        self.tokenizer = tokenizer
        self.scorer = scorer
        self.sampler = sampler
        self.min_samples = min_samples  # the data-parallel size: a smaller batch cannot be split
        self.make_env = environment_factory(cfg.env)
        self.renderer = TurnRenderer(tokenizer)

    # ---- pieces ----
    async def generate(self, prompts: Sequence[Prompt], step: int, round_: int | str) -> list[list[Sample]]:
        """`rollout.n_samples_per_prompt` seeded trajectories per prompt, grouped by prompt.

        Each is one episode of the environment (`env.*`; `single_turn`: one response, as the
        engine returned it). Turn 0 of request i is seeded with (train.seed, step, round, i),
        turn t > 0 with (train.seed, step, "round.t", i)."""
        ro = self.cfg.rollout
        g = ro.n_samples_per_prompt
        rows = [p for p in prompts for _ in range(g)]
        seed = self.cfg.train.seed

        def params(turn: int, i: int) -> SamplingParams:
            round_key = round_ if turn == 0 else f"{round_}.{turn}"
            return SamplingParams.from_config(ro, sampling_seed=sampling_seed(seed, step, round_key, i))

        trajectories = await episodes(
            self.engine,
            rows,
            params,
            self.renderer,
            self.cfg,
            return_routed_experts=ro.return_routed_experts,
            make_env=self.make_env,
        )
        return [trajectories[k * g : (k + 1) * g] for k in range(len(prompts))]

    def score(self, prompts: Sequence[Prompt], grouped: Sequence[Sequence[Sample]]) -> tuple[list[Group], RewardStats]:
        """Rule rewards and shaped rewards of every group."""
        alg, ro = self.cfg.algorithm, self.cfg.rollout
        if not grouped:  # every group of the round was aborted
            return [], RewardStats()
        flat = [s for group in grouped for s in group]
        rows = [p for p, group in zip(prompts, grouped, strict=True) for _ in group]
        result = score_samples(self.cfg, self.scorer, self.tokenizer, flat, rows)
        shaped = torch.tensor(result.rewards, dtype=torch.float32)
        if alg.soft_overlong_punishment:
            lengths = torch.tensor([len(s.output_ids) for s in flat])
            penalty = soft_overlong_penalty(
                lengths, ro.max_new_tokens, alg.overlong_buffer_len, alg.overlong_penalty_factor
            )
            shaped = shaped + penalty
        groups, start = [], 0
        for prompt, group in zip(prompts, grouped, strict=True):
            end = start + len(group)
            rewards = shaped[start:end].tolist()
            groups.append(Group(prompt, list(group), result.rewards[start:end], rewards, result.failed[start:end]))
            start = end
        return groups, result.stats

    def to_batch(self, groups: Sequence[Group]) -> ActorBatch:
        """The actor batch of `groups`: one sequence per segment of each episode (`segments_of`: the
        episode itself, or an agent's segments), each with its episode's group advantage of the shaped
        rewards on every response token."""
        alg, ro = self.cfg.algorithm, self.cfg.rollout
        rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32)
        episodes = [s for g in groups for s in g.samples]
        samples = [seq for s in episodes for seq in segments_of(s)]
        tokens = [torch.tensor(s.prompt_ids + s.output_ids, dtype=torch.long) for s in samples]
        mask = None
        if alg.overlong_filter or any(_observed(s) for s in samples):
            mask = [_loss_mask(s) & (not (alg.overlong_filter and s.truncated)) for s in samples]
        routed = None
        if ro.return_routed_experts:
            missing = [i for i, s in enumerate(samples) if s.routed_experts is None]
            if missing:
                raise RuntimeError(
                    f"rollout.return_routed_experts: the engine returned no routed experts for {len(missing)} "
                    f"responses (first: {missing[0]}); does the server run with --enable-return-routed-experts?"
                )
            routed = [torch.tensor(s.routed_experts, dtype=torch.int32) for s in samples]
        return ActorBatch(
            tokens=tokens,
            prompt_lengths=[len(s.prompt_ids) for s in samples],
            response_mask=mask,
            advantages=self.advantages(episodes, rewards),
            rollout_log_probs=[torch.tensor(s.logprobs, dtype=torch.float32) for s in samples],
            routed_experts=routed,
        )

    def advantages(self, episodes: Sequence[Sample], rewards: torch.Tensor) -> list[torch.Tensor]:
        """The advantages of each sequence of `episodes` (`segments_of`), `rewards` [N] being the
        episodes', computed over each group of episodes. `algorithm.turn_credit`: outcome = one 0-dim
        advantage per episode, given to each of its sequences; per_turn = [r_i] per token, each token
        the advantage of its turn (`megatron_rl.algorithms.turn_credit`), the turns of an episode
        counted across its segments (its calls, in order)."""
        alg = self.cfg.algorithm
        sequences = [segments_of(s) for s in episodes]
        if alg.turn_credit == "outcome":
            adv = advantages_of(self.cfg, rewards)
            return [a for a, seqs in zip(adv, sequences, strict=True) for _ in seqs]
        turn_rewards = [[r for seq in seqs for r in _turn_rewards(seq)] for seqs in sequences]
        per_turn = per_turn_advantages(
            turn_rewards,
            rewards,
            self.cfg.rollout.n_samples_per_prompt,
            discount=alg.turn_discount,
            norm_std=alg.adv_norm_std,
            eps=alg.adv_eps,
        )
        out = []
        for seqs, adv in zip(sequences, per_turn, strict=True):
            first_turn = 0
            for seq in seqs:
                turn_of = seq.turn_of_token if isinstance(seq, Trajectory) else [0] * len(seq.output_ids)
                out.append(adv[torch.tensor(turn_of, dtype=torch.long) + first_turn])
                first_turn += len(_turn_rewards(seq))
        return out

    async def generate_round(
        self, n: int, step: int, round_: int, kept: int
    ) -> tuple[list[Prompt], list[list[Sample]]]:
        """One generation round: the sampler's next `n` prompts and their groups (`kept`: the informative
        groups of the step so far, which an asynchronous source needs)."""
        prompts = self.sampler.next(n)
        return prompts, await self.generate(prompts, step, round_)

    # ---- one step ----
    async def collect(self, step: int, source: RoundSource | None = None) -> StepBatch:
        """Generate, reward and filter until the step's batch is complete (see the module doc).

        `source(n, step, round, kept)` gives each round's prompts and groups: `generate_round` by
        default; the fully asynchronous producer's buffer in `rollout.async_mode=fully_async`. The
        rewards are scored on a thread (`asyncio.to_thread`): the scorer blocks while its worker
        processes or the reward server answer."""
        source = source or self.generate_round
        cfg, alg = self.cfg, self.cfg.algorithm
        g, target = cfg.rollout.n_samples_per_prompt, cfg.train.prompts_per_step
        dynamic = alg.dynamic_sampling
        per_round = math.ceil(target * alg.oversample_factor) if dynamic else target
        acc = DynamicSamplingAccumulator(target, g, alg.max_gen_rounds) if dynamic else None
        stats, generated = RewardStats(), []
        seconds = {"generate": 0.0, "reward": 0.0}
        informative, rounds, aborted_groups, failed_groups = 0, 0, 0, 0
        used: list[Group] = []
        while True:
            began = time.perf_counter()
            prompts, grouped = await source(per_round, step, rounds, informative)
            generated += [s for group in grouped for s in group]
            whole = [k for k, group in enumerate(grouped) if not any(s.aborted for s in group)]
            aborted_groups += len(grouped) - len(whole)
            prompts, grouped = [prompts[k] for k in whole], [grouped[k] for k in whole]
            scored = time.perf_counter()
            groups, round_stats = await asyncio.to_thread(self.score, prompts, grouped)
            seconds["generate"] += scored - began
            seconds["reward"] += time.perf_counter() - scored
            rounds += 1
            stats = stats.merge(round_stats)
            self.scorer.check_failures(stats, f"step {step}")
            rewarded = [grp for grp in groups if not any(grp.failed)]
            failed_groups += len(groups) - len(rewarded)
            groups = rewarded
            scores = torch.tensor([r for grp in groups for r in grp.scores], dtype=torch.float32)
            if acc is None:
                informative, used = filter_groups(scores, g).kept, groups
                break
            informative += acc.add(scores, groups).kept
            if acc.done:
                break
        if acc is not None:
            result = acc.result()
            used = result.groups
            group_metrics = {f"groups/{k}": v for k, v in result.metrics.items()}
        else:
            group_metrics = {
                "groups/rounds": float(rounds),
                "groups/groups_generated": float(len(used)),
                "groups/groups_used": float(len(used)),
                "groups/target_missed": 0.0,
            }
        group_metrics["groups/informative"] = float(informative)
        group_metrics["groups/filtered"] = group_metrics["groups/groups_generated"] - informative
        group_metrics["groups/aborted"] = float(aborted_groups)
        group_metrics["groups/reward_failed"] = float(failed_groups)
        if stats.failed:
            log.warning(
                "step %d: %d of %d rewards failed%s from %s, %d group(s) left out; first: %s",
                step,
                stats.failed,
                stats.count,
                f" ({stats.timeouts} timed out)" if stats.timeouts else "",
                self.scorer.source,
                failed_groups,
                stats.errors[0] if stats.errors else "no message",
            )
        check_episode_failures(cfg.env, generated, f"step {step}")
        owner = [k for k, s in enumerate(s for grp in used for s in grp.samples) for _ in segments_of(s)]
        short = 0 < len(owner) < self.min_samples
        group_metrics["groups/short_batch_dropped"] = 1.0 if short else 0.0
        responses = [seq for s in generated for seq in segments_of(s)]
        metrics = {**stats.metrics("reward/"), **group_metrics, **self._response_metrics(responses)}
        if cfg.env.type != "single_turn":
            metrics.update(episode_metrics([s for s in generated if isinstance(s, Trajectory)]))
        metrics["time/generate"] = seconds["generate"]
        metrics["time/reward"] = seconds["reward"]
        tokens = metrics["response/tokens"]
        metrics["throughput/generate_tokens_per_s"] = tokens / seconds["generate"] if seconds["generate"] else 0.0
        if not used or short:
            return StepBatch(None, metrics)
        batch = self.to_batch(used)
        metrics["reward/train_mean"] = sum(r for grp in used for r in grp.rewards) / (len(used) * g)
        if cfg.env.type == "agent":
            metrics["env/trained_sequences_per_episode"] = len(owner) / (len(used) * g)
        rewards = torch.tensor([r for grp in used for r in grp.rewards], dtype=torch.float32)
        sequences = [seq for grp in used for s in grp.samples for seq in segments_of(s)]
        several = len(owner) > len(used) * g
        owners = torch.tensor(owner, dtype=torch.int64) if several else None
        versions = [trained_versions(seq) for seq in sequences]
        return StepBatch(batch, metrics, rewards[owner] if several else rewards, versions, owners)

    def _response_metrics(self, samples: Sequence[Sample]) -> dict[str, float]:
        lengths = [len(s.output_ids) for s in samples]
        n = max(len(samples), 1)
        return {
            "response/length_mean": sum(lengths) / n,
            "response/length_max": float(max(lengths, default=0)),
            "response/clipped_frac": sum(s.truncated for s in samples) / n,
            "rollout/aborted": float(sum(s.aborted for s in samples)),
            "response/tokens": float(sum(lengths)),
        }


async def episodes(
    engine: Engine,
    rows: Sequence[Prompt],
    params: Callable[[int, int], SamplingParams],
    renderer: TurnRenderer,
    cfg: Config,
    *,
    return_routed_experts: bool = False,
    make_env: Callable[[], Any] | None = None,
) -> list[Trajectory]:
    """One episode per row: of the environment (`run_episodes`), or of the black-box agent through
    the gateway (`env.type=agent`: `megatron_rl.agents`, at most rollout.max_concurrency at once)."""
    if cfg.env.type == "agent":
        agents = await run_agent_episodes(
            engine,
            rows,
            params,
            renderer,
            cfg.env,
            max_concurrency=cfg.rollout.max_concurrency,
            return_routed_experts=return_routed_experts,
        )
        return [e.trajectory for e in agents]
    make_env = make_env or environment_factory(cfg.env)
    return await run_episodes(
        engine,
        [make_env() for _ in rows],
        rows,
        params,
        renderer,
        cfg.env,
        return_routed_experts=return_routed_experts,
        stall_warning_s=cfg.rollout.stall_warning_s,
    )


def score_samples(
    cfg: Config, scorer: RewardScorer, tokenizer: Any, samples: Sequence[Sample], rows: Sequence[Prompt]
) -> RewardResult:
    """The scores of `samples` (rows[i] the prompt of sample i): the reward rule on their decoded text,
    or the agents' own rewards with `env.agent_reward`."""
    if cfg.env.type == "agent" and cfg.env.agent_reward:
        return agent_rewards(cfg, samples)
    texts = tokenizer.batch_decode([s.output_ids for s in samples], skip_special_tokens=True)
    return scorer.score_prompts(texts, rows)


def agent_rewards(cfg: Config, samples: Sequence[Sample]) -> RewardResult:
    """`env.agent_reward`: the reward each episode's agent returned (`meta_info["agent_reward"]`) as its
    score; correct when at least reward.correct_reward; none is a failed reward (reward.failure_reward)."""
    given = [s.meta_info.get("agent_reward") if isinstance(s, Trajectory) else None for s in samples]
    failed = [r is None for r in given]
    rewards = [cfg.reward.failure_reward if r is None else float(r) for r in given]
    correct = [not f and r >= cfg.reward.correct_reward for r, f in zip(rewards, failed, strict=True)]
    missing = sum(failed)
    stats = RewardStats(
        count=len(samples),
        correct=sum(correct),
        failed=missing,
        reward_sum=sum(rewards),
        errors=[f"env.agent_reward: {missing} agent(s) returned no reward"] if missing else [],
    )
    return RewardResult(rewards, correct, failed, [None] * len(samples), stats)


def _turn_rewards(sample: Sample) -> list[float]:
    return sample.turn_rewards if isinstance(sample, Trajectory) else [0.0]


def _observed(sample: Sample) -> bool:
    return isinstance(sample, Trajectory) and sample.has_observations


def _loss_mask(sample: Sample) -> torch.Tensor:
    """bool [r]: the generated tokens of a trajectory (observation tokens are not trained on)."""
    if isinstance(sample, Trajectory):
        return torch.tensor(sample.loss_mask, dtype=torch.bool)
    return torch.ones(len(sample.output_ids), dtype=torch.bool)


async def evaluate(
    engine: Engine, prompts: Sequence[Prompt], tokenizer: Any, scorer: RewardScorer, cfg: Config, step: int
) -> dict[str, float]:
    """Held-out accuracy of the served policy: greedy (`eval.temperature` 0) or seeded sampling, one
    episode of the environment (`env.*`) per prompt."""
    temperature = cfg.eval.temperature

    def params(turn: int, i: int) -> SamplingParams:
        key = "eval" if turn == 0 else f"eval.{turn}"
        seed = sampling_seed(cfg.train.seed, step, key, i) if temperature > 0 else None
        return SamplingParams.from_config(cfg.rollout, temperature=temperature, sampling_seed=seed)

    samples = await episodes(engine, prompts, params, TurnRenderer(tokenizer), cfg)
    check_episode_failures(cfg.env, samples, f"the evaluation at step {step}")
    result = await asyncio.to_thread(score_samples, cfg, scorer, tokenizer, samples, prompts)
    scorer.check_failures(result.stats, f"the evaluation at step {step}")
    name = "eval/greedy_accuracy" if temperature == 0 else "eval/accuracy"
    return {
        name: result.stats.correct / len(prompts),
        "eval/reward_mean": result.stats.reward_sum / len(prompts),
        "eval/length_mean": sum(len(s.output_ids) for s in samples) / len(prompts),
        "eval/prompts": float(len(prompts)),
    }
