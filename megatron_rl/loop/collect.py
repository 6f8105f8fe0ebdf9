"""One step's training batch from the rollout engine: generate, reward, shape, filter, then build.

`RolloutCollector.collect(step)` runs on the rank that drives the engine (rank 0): steps 1-4 of the
step in docs/architecture.md: generation rounds (`_round`: episodes, aborted groups left out, rewards
by `loop.scoring`), the groups chosen (`_choose`: dynamic sampling), failures checked, the metrics,
and the batch of the chosen groups from the sample builder (`loop.samples`).

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
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from megatron_rl.agents import run_agent_episodes
from megatron_rl.algorithms import DynamicSamplingAccumulator
from megatron_rl.algorithms.dynamic_sampling import filter_groups
from megatron_rl.config import Config, prompts_per_round
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
from megatron_rl.loop.distill import TeacherMeter, reverse_kl_metrics, score_with_teacher
from megatron_rl.loop.samples import SampleBuilder, StepBatch
from megatron_rl.loop.samples import advantages_of as advantages_of  # re-exported: the step's one advantage function
from megatron_rl.loop.samples import kl_penalized_advantages as kl_penalized_advantages
from megatron_rl.loop.scoring import Group, score_groups
from megatron_rl.rewards import RewardScorer, RewardStats, load_group_filter
from megatron_rl.rollout.teacher import Teacher
from megatron_rl.rollout.types import Engine, SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")


def sampling_seed(base: int, step: int, round_: int | str, index: int) -> int:
    """The rollout seed of request `index` of generation round `round_` of `step`: in [0, 2**63)."""
    digest = hashlib.blake2b(f"{base}/{step}/{round_}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


# (n, step, round, informative groups kept so far) -> the round's prompts and their groups
RoundSource = Callable[[int, int, int, int], Awaitable[tuple[list[Prompt], list[list[Trajectory]]]]]


@dataclass
class _Tally:
    """What a step's generation rounds left, for its metrics: the reward statistics, every episode
    generated, the counts of rounds, informative, aborted and reward-failed groups, the seconds spent."""

    stats: RewardStats = field(default_factory=RewardStats)
    generated: list[Trajectory] = field(default_factory=list)
    rounds: int = 0
    informative: int = 0
    aborted_groups: int = 0
    failed_groups: int = 0
    generate_s: float = 0.0
    reward_s: float = 0.0


class RolloutCollector:
    """Builds each step's batch from `engine` (anything with `generate(prompts, params, return_routed_experts)`)."""

    def __init__(
        self,
        cfg: Config,
        engine: Engine,
        tokenizer: Any,
        scorer: RewardScorer,
        sampler: Any,
        *,
        min_samples: int = 1,
        teacher: Teacher | None = None,
    ) -> None:
        """`teacher`: on-policy distillation's (`distill`), which scores every generated sample."""
        self.cfg = cfg
        self.engine = engine
        self.teacher = teacher
        self.teacher_meter = TeacherMeter()
        self.tokenizer = tokenizer
        self.scorer = scorer
        self.sampler = sampler
        self.min_samples = min_samples  # the data-parallel size: a smaller batch cannot be split
        self.make_env = environment_factory(cfg.env)
        self.renderer = TurnRenderer(tokenizer)
        self.builder = SampleBuilder(cfg)
        spec = cfg.algorithm.dynamic_sampling_filter
        self.keep = load_group_filter(spec) if spec else None  # (Group) -> bool, in place of the reward spread

    # ---- pieces ----
    async def generate(self, prompts: Sequence[Prompt], step: int, round_: int | str) -> list[list[Trajectory]]:
        """`rollout.n_samples_per_prompt` seeded trajectories per prompt, grouped by prompt.

        Each is one episode of the environment (`env.*`; `single_turn`: one response, as the
        engine returned it). Turn 0 of request i is seeded with (train.seed, step, round, i),
        turn t > 0 with (train.seed, step, "round.t", i). With a teacher, each is scored by it
        before it is returned (`loop.distill.score_with_teacher`)."""
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
        if self.teacher is not None:
            top_k = self.cfg.distill.top_k if self.cfg.distill.mode == "forward_topk" else 0
            await score_with_teacher(self.teacher, trajectories, self.teacher_meter, top_k)
        return [trajectories[k * g : (k + 1) * g] for k in range(len(prompts))]

    def score(
        self, prompts: Sequence[Prompt], grouped: Sequence[Sequence[Trajectory]]
    ) -> tuple[list[Group], RewardStats]:
        """Rule rewards and shaped rewards of every group (`loop.scoring`)."""
        return score_groups(self.cfg, self.scorer, self.tokenizer, prompts, grouped)

    async def generate_round(
        self, n: int, step: int, round_: int, kept: int
    ) -> tuple[list[Prompt], list[list[Trajectory]]]:
        """One generation round: the sampler's next `n` prompts and their groups (`kept`: the informative
        groups of the step so far, which an asynchronous source needs)."""
        prompts = self.sampler.next(n)
        return prompts, await self.generate(prompts, step, round_)

    # ---- one step ----
    async def collect(self, step: int, source: RoundSource | None = None) -> StepBatch:
        """Generate, reward and filter until the step's groups are chosen, then build the batch of the
        chosen groups (`loop.samples.SampleBuilder`; see the module doc).

        `source(n, step, round, kept)` gives each round's prompts and groups: `generate_round` by
        default; the fully asynchronous producer's buffer in `rollout.async_mode=fully_async`."""
        tally = _Tally()
        used, group_metrics = await self._choose(step, source or self.generate_round, tally)
        self._check_failures(step, tally)
        sequences = sum(len(segments_of(e)) for grp in used for e in grp.episodes)
        short = 0 < sequences < self.min_samples
        metrics = self._metrics(tally, group_metrics, short)
        if not used or short:
            return StepBatch(None, metrics)
        return self.builder.build(used, metrics)

    async def _choose(self, step: int, source: RoundSource, tally: _Tally) -> tuple[list[Group], dict[str, float]]:
        """The step's groups and their `groups/` metrics: one round's, or with `algorithm.dynamic_sampling`
        the informative groups of as many rounds as it takes (`DynamicSamplingAccumulator`): those whose
        scores differ, or those `algorithm.dynamic_sampling_filter` keeps."""
        alg, g, target = self.cfg.algorithm, self.cfg.rollout.n_samples_per_prompt, self.cfg.train.prompts_per_step
        if not alg.dynamic_sampling:
            used = await self._round(source, step, target, tally)
            tally.informative = filter_groups(_scores(used), g).kept
            generated = float(len(used))
            counts = {"rounds": float(tally.rounds), "groups_generated": generated, "groups_used": generated}
            return used, {**{f"groups/{k}": v for k, v in counts.items()}, "groups/target_missed": 0.0}
        name = f"algorithm.dynamic_sampling_filter {alg.dynamic_sampling_filter!r}"
        acc = DynamicSamplingAccumulator(target, g, alg.max_gen_rounds, keep=self.keep, keep_name=name)
        while True:
            groups = await self._round(source, step, prompts_per_round(self.cfg), tally)
            tally.informative += acc.add(_scores(groups), groups).kept
            if acc.done:
                break
        result = acc.result()
        return result.groups, {f"groups/{k}": v for k, v in result.metrics.items()}

    async def _round(self, source: RoundSource, step: int, n: int, tally: _Tally) -> list[Group]:
        """One generation round of `n` groups from `source`, scored: the groups with neither an aborted
        episode nor a failed reward. The rewards are scored on a thread (`asyncio.to_thread`): the
        scorer blocks while its worker processes or the reward server answer."""
        began = time.perf_counter()
        prompts, grouped = await source(n, step, tally.rounds, tally.informative)
        tally.generated += [e for group in grouped for e in group]
        whole = [k for k, group in enumerate(grouped) if not any(e.aborted for e in group)]
        tally.aborted_groups += len(grouped) - len(whole)
        scored = time.perf_counter()
        groups, stats = await asyncio.to_thread(self.score, [prompts[k] for k in whole], [grouped[k] for k in whole])
        tally.generate_s += scored - began
        tally.reward_s += time.perf_counter() - scored
        tally.rounds += 1
        tally.stats = tally.stats.merge(stats)
        self.scorer.check_failures(tally.stats, f"step {step}")
        rewarded = [grp for grp in groups if not any(grp.failed)]
        tally.failed_groups += len(groups) - len(rewarded)
        return rewarded

    def _check_failures(self, step: int, tally: _Tally) -> None:
        """One warning for the step's failed rewards; a stop when too many episodes failed."""
        stats = tally.stats
        if stats.failed:
            log.warning(
                "step %d: %d of %d rewards failed%s from %s, %d group(s) left out; first: %s",
                step,
                stats.failed,
                stats.count,
                f" ({stats.timeouts} timed out)" if stats.timeouts else "",
                self.scorer.source,
                tally.failed_groups,
                stats.errors[0] if stats.errors else "no message",
            )
        check_episode_failures(self.cfg.env, tally.generated, f"step {step}")

    def _metrics(self, tally: _Tally, group_metrics: dict[str, float], short: bool) -> dict[str, float]:
        """The step's rollout metrics: rewards, groups (`short`: a batch too short to split, dropped),
        responses, episodes, timings."""
        groups = {
            **group_metrics,
            "groups/informative": float(tally.informative),
            "groups/filtered": group_metrics["groups/groups_generated"] - tally.informative,
            "groups/aborted": float(tally.aborted_groups),
            "groups/reward_failed": float(tally.failed_groups),
            "groups/short_batch_dropped": 1.0 if short else 0.0,
        }
        responses = [seq for e in tally.generated for seq in segments_of(e)]
        metrics = {**tally.stats.metrics("reward/"), **groups, **self._response_metrics(responses)}
        if self.cfg.env.type != "single_turn":
            metrics.update(episode_metrics(tally.generated))
        if self.teacher is not None:
            metrics.update({**reverse_kl_metrics(responses), **self.teacher_meter.take()})
        metrics["time/generate"] = tally.generate_s
        metrics["time/reward"] = tally.reward_s
        tokens = metrics["response/tokens"]
        metrics["throughput/generate_tokens_per_s"] = tokens / tally.generate_s if tally.generate_s else 0.0
        return metrics

    def _response_metrics(self, samples: Sequence[Trajectory]) -> dict[str, float]:
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


def _scores(groups: Sequence[Group]) -> torch.Tensor:
    """float32 [N]: the reward rule's scores of the groups' episodes (what dynamic sampling filters on)."""
    return torch.tensor([r for grp in groups for r in grp.scores], dtype=torch.float32)
