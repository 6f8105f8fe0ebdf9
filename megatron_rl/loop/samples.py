"""The sample builder: a step's episodes and rewards (and, with `algorithm.kl_in_reward`, the
reference's KL) into what the actor trains on.

Each step's data is built here, in verl's order (rewards, old log-probs, the reference, advantages):

- `SampleBuilder.build` (rank 0, once the step's groups are chosen): one sequence per segment of each
  episode (`segments_of`: the trajectory itself, or an agent's segments), its tokens (prompt then
  trajectory), its loss mask (`loss_mask`), the engine's log-probs and routed experts (R3), and each
  sequence's episode reward, weight versions and episode index;
- the advantages (`advantages_of`), the one function that computes them, over the whole step's batch:
  `algorithm.advantage_estimator` of the episodes' rewards (`outcome_advantages`: grpo, rloo,
  reinforce_plus_plus(_baseline)), or per turn and so per token (`algorithm.turn_credit`, the turns of
  an episode counted across its segments). The builder computes them with the sequences
  when they need no trainer forward; with `algorithm.kl_in_reward` they wait for the reference's
  log-probs, and with `algorithm.advantage_estimator = gae` for the critic's values: the step computes
  them once, on every rank, after those forwards (`step_advantages`: `kl_penalized_advantages` of
  R - beta * KL, or `gae_advantages`). They are never computed twice. With a teacher (`distill`), each
  generated token's advantage also holds its distillation term (`distill_advantage`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.algorithms import (
    compute_gae_advantage_return,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
    group_advantages,
    overlong_filter_mask,
    per_turn_advantages,
)
from megatron_rl.config import AlgorithmConfig, Config
from megatron_rl.envs import Trajectory, segments_of
from megatron_rl.loop.async_rollout import trained_versions
from megatron_rl.loop.scoring import Group


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


def advantages_after_forwards(alg: AlgorithmConfig) -> bool:
    """Whether the step's advantages wait for the trainer's forwards (`step_advantages`): the reference's KL in
    the reward (`algorithm.kl_in_reward`) or the critic's values (`algorithm.advantage_estimator = gae`)."""
    return alg.kl_in_reward or alg.advantage_estimator == "gae"


def loss_mask(sequence: Trajectory, overlong_filter: bool) -> torch.Tensor:
    """bool [r]: the response tokens of `sequence` the loss sees: its generated tokens (observation
    tokens are not trained on), none of them when it was truncated and `algorithm.overlong_filter` is set."""
    generated = torch.tensor(sequence.loss_mask, dtype=torch.bool).view(1, -1)
    return overlong_filter_mask(generated, torch.tensor([overlong_filter and sequence.truncated]))[0]


def distill_advantage(sequence: Trajectory) -> torch.Tensor:
    """float32 [r]: on-policy distillation's advantage of each output token of `sequence`,
    -(log pi_student(y_t) - log pi_teacher(y_t)), pi_student being the engine's sampling log-prob of y_t
    and pi_teacher the teacher's (`Trajectory.teacher_logprobs`); 0 on observation tokens (never scored).

    The gradient: with A_t held constant, the objective's surrogate at ratio r_t = 1 (on-policy) has the
    gradient -sum_t W_t A_t grad log pi_theta(y_t) (W_t its aggregation weight; clipping and importance
    weights as the objective's spec), i.e. a descent on the sampled estimate of the reverse KL:
    grad KL(pi_theta || pi_teacher) = E_{y ~ pi_theta}[(log pi_theta(y) - log pi_teacher(y)) grad log pi_theta(y)]
    (the term E[grad log pi_theta] is 0). tests/test_distill.py pins both on a hand-computed case."""
    if sequence.teacher_logprobs is None or len(sequence.teacher_logprobs) != len(sequence.output_ids):
        given = None if sequence.teacher_logprobs is None else len(sequence.teacher_logprobs)
        raise RuntimeError(
            f"distill: sample {sequence.rid!r} has {given} teacher log-probs for {len(sequence.output_ids)} output "
            "tokens; a sample the teacher did not score is never trained on"
        )
    teacher = torch.tensor(sequence.teacher_logprobs, dtype=torch.float32)
    student = torch.tensor(sequence.logprobs, dtype=torch.float32)
    generated = torch.tensor(sequence.loss_mask, dtype=torch.bool)
    return torch.where(generated, teacher - student, torch.zeros(()))


def advantages_of(
    cfg: Config,
    rewards: torch.Tensor,
    episodes: Sequence[Trajectory] | None = None,
    masks: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """The advantage of every sequence of `episodes` (`segments_of`, in order), `rewards` [E] being the
    episodes' (shaped, or KL-penalised), the groups of `rollout.n_samples_per_prompt` episodes
    contiguous. `algorithm.turn_credit`: outcome = `outcome_advantages` of the episodes' rewards
    (`algorithm.advantage_estimator`); per_turn (GRPO's form only) = [r_i] per token, each token the
    advantage of its turn (`megatron_rl.algorithms.turn_credit`). Without `episodes` (outcome credit
    only): one advantage per reward. `masks`: the loss mask of every sequence (`loss_mask`), which the
    estimators that whiten over the step's tokens need. With a teacher (`distill`), each sequence's is [r_i]: the
    reward advantage (none with `algorithm.name = opd`) plus `distill.kl_coef` x `distill_advantage`."""
    if not cfg.distill.enabled:
        return _reward_advantages(cfg, rewards, episodes, masks)
    if episodes is None:
        raise ValueError("distill: the advantages need the episodes (their teacher log-probs)")
    sequences = [seq for episode in episodes for seq in segments_of(episode)]
    distilled = [cfg.distill.kl_coef * distill_advantage(seq) for seq in sequences]
    if cfg.algorithm.name == "opd":
        return distilled
    return [a + d for a, d in zip(_reward_advantages(cfg, rewards, episodes, masks), distilled, strict=True)]


def _reward_advantages(
    cfg: Config,
    rewards: torch.Tensor,
    episodes: Sequence[Trajectory] | None,
    masks: Sequence[torch.Tensor] | None,
) -> list[torch.Tensor]:
    alg, group_size = cfg.algorithm, cfg.rollout.n_samples_per_prompt
    if alg.turn_credit == "outcome":
        if episodes is not None and len(episodes) != rewards.shape[0]:
            raise ValueError(f"advantages_of: {len(episodes)} episodes for {rewards.shape[0]} rewards")
        owner = (
            range(rewards.shape[0]) if episodes is None else [k for k, e in enumerate(episodes) for _ in segments_of(e)]
        )
        return outcome_advantages(cfg, rewards, owner, masks)
    if episodes is None:
        raise ValueError("algorithm.turn_credit = 'per_turn': the advantages need the episodes' turns")
    sequences = [segments_of(episode) for episode in episodes]
    per_turn = per_turn_advantages(
        [[r for seq in seqs for r in seq.turn_rewards] for seqs in sequences],
        rewards,
        group_size,
        discount=alg.turn_discount,
        norm_std=alg.adv_norm_std,
        eps=alg.adv_eps,
    )
    out = []
    for seqs, adv in zip(sequences, per_turn, strict=True):
        first_turn = 0
        for seq in seqs:
            out.append(adv[torch.tensor(seq.turn_of_token, dtype=torch.long) + first_turn])
            first_turn += seq.turns
    return out


def outcome_advantages(
    cfg: Config, rewards: torch.Tensor, owner: Sequence[int], masks: Sequence[torch.Tensor] | None
) -> list[torch.Tensor]:
    """`algorithm.advantage_estimator` of the episodes' outcome rewards `rewards` [E] (groups of
    `rollout.n_samples_per_prompt` contiguous), for every sequence i of episode `owner[i]` (an episode's
    sequences in order). grpo, rloo and reinforce_plus_plus_baseline: one 0-dim advantage per episode,
    given to each of its sequences; reinforce_plus_plus: [r_i] per token. The batch-whitened two
    (reinforce_plus_plus, _baseline) see each episode as one response, its sequences' loss masks
    (`masks[i]`, bool [r_i]) end to end and its reward on its last trained token, and whiten over all
    the step's trained tokens (`megatron_rl.algorithms.estimators`)."""
    alg, group_size = cfg.algorithm, cfg.rollout.n_samples_per_prompt
    estimator = alg.advantage_estimator
    if estimator == "grpo":
        adv = group_advantages(rewards, group_size, norm_std=alg.adv_norm_std, eps=alg.adv_eps).unbind(0)
        return [adv[k] for k in owner]
    count = rewards.shape[0]
    if rewards.dim() != 1 or group_size < 1 or count % group_size != 0:
        raise ValueError(
            f"algorithm.advantage_estimator = '{estimator}': rewards of shape {tuple(rewards.shape)} do not "
            f"split into groups of rollout.n_samples_per_prompt = {group_size}"
        )
    index = torch.arange(count) // group_size
    if estimator == "rloo":
        per_episode = compute_rloo_outcome_advantage(rewards.float().unsqueeze(-1), torch.ones(count, 1), index)
        return [per_episode[0][k, 0] for k in owner]
    if masks is None or len(masks) != len(owner):
        raise ValueError(
            f"algorithm.advantage_estimator = '{estimator}' whitens over the step's trained tokens: it needs the "
            f"loss mask of each of the {len(owner)} sequences, got {None if masks is None else len(masks)}"
        )
    token_rewards, response_mask, spans = episode_rows(rewards, owner, masks)
    if not bool(response_mask.any()):  # nothing trains this step: no token would read an advantage
        return [torch.zeros(()) if estimator != "reinforce_plus_plus" else torch.zeros(len(m)) for m in masks]
    if estimator == "reinforce_plus_plus_baseline":
        adv, _ = compute_reinforce_plus_plus_baseline_outcome_advantage(token_rewards, response_mask, index)
        # constant over an episode's trained tokens: its sum over them / their count (0 for none)
        per_episode = (adv.sum(dim=-1) / response_mask.sum(dim=-1).clamp(min=1)).unbind(0)
        return [per_episode[k] for k in owner]
    adv, _ = compute_reinforce_plus_plus_outcome_advantage(token_rewards, response_mask, gamma=alg.gamma)
    return [adv[k, start:end] for k, (start, end) in zip(owner, spans, strict=True)]


def episode_rows(
    rewards: torch.Tensor, owner: Sequence[int], masks: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """verl's layout of the episodes: token_level_rewards and response_mask, each [E, L] (right-padded,
    L >= 1), one row per episode, its sequences' masks end to end and its reward on the row's last
    trained token, or, in a row without one (filtered out of the loss), on its last token, where it still
    counts in its group's mean (as in verl, whose reward sits on the last response token) but no token
    trains on it; and each sequence's (start, end) in its episode's row."""
    rows: list[list[torch.Tensor]] = [[] for _ in range(rewards.shape[0])]
    spans = []
    for k, mask in zip(owner, masks, strict=True):
        start = sum(len(m) for m in rows[k])
        rows[k].append(mask.bool().reshape(-1))
        spans.append((start, start + len(rows[k][-1])))
    joined = [torch.cat(r) if r else torch.zeros(0, dtype=torch.bool) for r in rows]
    response_mask = torch.zeros(len(joined), max([1, *(len(r) for r in joined)]), dtype=torch.bool)
    token_rewards = torch.zeros(response_mask.shape, dtype=torch.float32)
    for k, row in enumerate(joined):
        response_mask[k, : len(row)] = row
        trained = torch.nonzero(row).flatten()
        last = int(trained[-1]) if trained.numel() else max(len(row) - 1, 0)
        token_rewards[k, last] = float(rewards[k])
    return token_rewards, response_mask, spans


def _episode_owner(rewards: torch.Tensor, episodes: torch.Tensor | None) -> tuple[list[int], torch.Tensor]:
    """(the episode of each sequence, each episode's reward) from per-sequence `rewards` [N] and `episodes`
    [N] (`StepBatch.episodes`; None: sequence i is episode i)."""
    if episodes is None:
        return list(range(rewards.shape[0])), rewards.to(torch.float32)
    if episodes.shape != rewards.shape:
        raise ValueError(f"episodes has shape {tuple(episodes.shape)}, rewards has {tuple(rewards.shape)}")
    owner = episodes.to(torch.long).tolist()
    count = max(owner) + 1 if owner else 0
    index = torch.tensor(owner, dtype=torch.long)
    return owner, torch.zeros(count).index_copy_(0, index, rewards.to(torch.float32))


def kl_penalized_advantages(
    cfg: Config,
    rewards: torch.Tensor,
    kl_sums: torch.Tensor,
    episodes: torch.Tensor | None = None,
    masks: Sequence[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """`algorithm.kl_in_reward`: the advantages (`outcome_advantages`) of R_i - beta * KL_i, KL_i a response's
    summed per-token KL to the reference (verl's `use_kl_in_reward` with an outcome estimator, whose
    summed token rewards this is). `rewards`, `kl_sums` [N]: per sequence; `episodes` [N]
    (`StepBatch.episodes`): the episode of each sequence, whose KL is the sum over its sequences, and
    each of them gets the episode's advantage; `masks` [N]: the sequences' loss masks (`advantages_of`)."""
    if kl_sums.shape != rewards.shape:
        raise ValueError(f"kl_sums has shape {tuple(kl_sums.shape)}, rewards has {tuple(rewards.shape)}")
    owner, rewards = _episode_owner(rewards, episodes)  # a sequence carries its episode's reward
    kl_sums = kl_sums.to(torch.float32)
    if episodes is not None:
        kl_sums = torch.zeros(rewards.shape[0]).index_add_(0, torch.tensor(owner, dtype=torch.long), kl_sums)
    penalty = cfg.algorithm.kl_coef * kl_sums
    metrics = {
        "reward/kl_penalty_mean": float(penalty.mean()),
        "reward/kl_penalized_mean": float((rewards - penalty).mean()),
    }
    return outcome_advantages(cfg, rewards - penalty, owner, masks), metrics


def _rows(
    per_sequence: Sequence[torch.Tensor], owner: Sequence[int], spans: Sequence[tuple[int, int]], shape: torch.Size
) -> torch.Tensor:
    """[E, L] float32: each sequence's [r_i] values at its span of its episode's row (`episode_rows`)."""
    rows = torch.zeros(shape, dtype=torch.float32)
    for k, (start, end), values in zip(owner, spans, per_sequence, strict=True):
        rows[k, start:end] = values.to(torch.float32).reshape(-1)
    return rows


def gae_advantages(
    cfg: Config,
    rewards: torch.Tensor,
    values: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
    episodes: torch.Tensor | None = None,
    kl: Sequence[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, float]]:
    """`algorithm.advantage_estimator = gae`: (advantages, returns, metrics), float32 [r_i] per sequence, from
    verl's `compute_gae_advantage_return` (`algorithm.gamma`, `algorithm.lam`) over the whole step's batch.

    `rewards` [N]: each sequence's episode reward (shaped); `values`: the critic's V_old [r_i] of each
    sequence; `masks`: their loss masks; `episodes` [N] (`StepBatch.episodes`): an agent episode's sequences
    are one response, end to end (`episode_rows`). The token-level rewards, as verl's: the episode's reward on
    its last trained token, and with `kl` (`algorithm.kl_in_reward`: each sequence's per-token KL to the
    reference, [r_i]) minus beta x KL on every trained token (verl's `apply_kl_penalty`). Masked tokens
    (observations, the overlong filter's) take no reward, value or TD error: GAE carries its running terms
    through them. The advantages are whitened over the step's trained tokens; the returns (A + V, before
    whitening) are the critic's targets."""
    for name, given in (("values", values), ("masks", masks), ("kl", kl)):
        if given is not None and len(given) != rewards.shape[0]:
            raise ValueError(f"gae_advantages: {len(given)} {name} for {rewards.shape[0]} sequences")
    owner, episode_rewards = _episode_owner(rewards, episodes)
    token_rewards, response_mask, spans = episode_rows(episode_rewards, owner, masks)
    value_rows = _rows(values, owner, spans, response_mask.shape)
    metrics: dict[str, float] = {}
    if kl is not None:
        penalty = cfg.algorithm.kl_coef * _rows(kl, owner, spans, response_mask.shape) * response_mask
        token_rewards = token_rewards - penalty
        metrics = {
            "reward/kl_penalty_mean": float(penalty.sum(dim=-1).mean()),
            "reward/kl_penalized_mean": float(token_rewards.sum(dim=-1).mean()),
        }
    if not bool(response_mask.any()):  # nothing trains this step: no token reads an advantage or a return
        zeros = [torch.zeros(len(m)) for m in masks]
        return zeros, [v.to(torch.float32) for v in values], metrics
    alg = cfg.algorithm
    adv, returns = compute_gae_advantage_return(token_rewards, value_rows, response_mask, alg.gamma, alg.lam)
    advantages = [adv[k, start:end] for k, (start, end) in zip(owner, spans, strict=True)]
    return advantages, [returns[k, start:end] for k, (start, end) in zip(owner, spans, strict=True)], metrics


def step_advantages(
    cfg: Config,
    rewards: torch.Tensor,
    masks: Sequence[torch.Tensor],
    episodes: torch.Tensor | None = None,
    kl: Sequence[torch.Tensor] | None = None,
    values: Sequence[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, dict[str, float]]:
    """The advantages that wait for the trainer's forwards (`advantages_after_forwards`), computed once on
    every rank from the whole step batch: (advantages, the critic's returns or None, metrics). `kl`: each
    sequence's per-token KL to the reference ([r_i], with `algorithm.kl_in_reward`); `values`: the critic's
    V_old (with gae)."""
    alg = cfg.algorithm
    if alg.kl_in_reward and kl is None:
        raise ValueError("algorithm.kl_in_reward: the advantages need the reference's KL of every sequence")
    if alg.advantage_estimator == "gae":
        if values is None:
            raise ValueError("algorithm.advantage_estimator = 'gae': the advantages need the critic's values")
        return gae_advantages(cfg, rewards, values, masks, episodes, kl if alg.kl_in_reward else None)
    kl_sums = torch.stack([k.to(torch.float64).sum() for k in kl]) if kl else torch.zeros(0)
    advantages, metrics = kl_penalized_advantages(cfg, rewards, kl_sums, episodes, masks)
    return advantages, None, metrics


class SampleBuilder:
    """Builds a step's `StepBatch` from its chosen groups (see the module doc)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    def build(self, groups: Sequence[Group], metrics: dict[str, float]) -> StepBatch:
        """The actor batch of `groups`, one sequence per segment of each episode, with `metrics` and
        the batch's own (`reward/train_mean`; agents: `env/trained_sequences_per_episode`)."""
        alg, ro = self.cfg.algorithm, self.cfg.rollout
        episodes = [e for g in groups for e in g.episodes]
        rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32)
        owner = [k for k, e in enumerate(episodes) for _ in segments_of(e)]
        sequences = [seq for e in episodes for seq in segments_of(e)]
        masks = [loss_mask(seq, alg.overlong_filter) for seq in sequences]
        routed = None
        if ro.return_routed_experts:
            missing = [i for i, seq in enumerate(sequences) if seq.routed_experts is None]
            if missing:
                raise RuntimeError(
                    f"rollout.return_routed_experts: the engine returned no routed experts for {len(missing)} "
                    f"responses (first: {missing[0]}); does the server run with --enable-return-routed-experts?"
                )
            routed = [torch.tensor(seq.routed_experts, dtype=torch.int32) for seq in sequences]
        batch = ActorBatch(
            tokens=[torch.tensor(seq.prompt_ids + seq.output_ids, dtype=torch.long) for seq in sequences],
            prompt_lengths=[len(seq.prompt_ids) for seq in sequences],
            response_mask=None if all(bool(m.all()) for m in masks) else masks,
            advantages=None if advantages_after_forwards(alg) else advantages_of(self.cfg, rewards, episodes, masks),
            rollout_log_probs=[torch.tensor(seq.logprobs, dtype=torch.float32) for seq in sequences],
            routed_experts=routed,
        )
        metrics = {**metrics, "reward/train_mean": sum(r for g in groups for r in g.rewards) / len(episodes)}
        if self.cfg.env.type == "agent":
            metrics["env/trained_sequences_per_episode"] = len(sequences) / len(episodes)
        several = len(sequences) > len(episodes)
        return StepBatch(
            batch,
            metrics,
            rewards[owner] if several else rewards,
            [trained_versions(seq) for seq in sequences],
            torch.tensor(owner, dtype=torch.int64) if several else None,
        )
