"""The sample builder (`loop.samples`) by hand: tokens, loss mask, advantages and KL-in-reward of a
small step with a multi-turn episode, a truncated one and an agent episode of two segments."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.config import load_config
from megatron_rl.data import Prompt, RowLocation
from megatron_rl.envs.trajectory import RoutedExperts, Trajectory, append_generated, append_observation
from megatron_rl.loop.samples import SampleBuilder, StepBatch, kl_penalized_advantages, step_advantages
from megatron_rl.loop.scoring import Group
from megatron_rl.rollout.types import Sample
from megatron_rl.trainer import reference_kl


def episode(prompt: list[int], turns: list[tuple[list[int], list[float], str]], observations=()) -> Trajectory:
    """An episode built as the episode runner builds it: each turn's engine sample appended, then the
    observation after it (if any)."""
    traj, routed = Trajectory(list(prompt), [], [], "stop"), RoutedExperts()
    for t, (ids, logprobs, finish) in enumerate(turns):
        append_generated(traj, Sample(list(prompt), ids, logprobs, finish, weight_version="3"), t, routed)
        if t < len(observations):
            append_observation(traj, observations[t], t)
    return traj


def step_groups() -> list[Group]:
    # group 1: A calls a tool (turn reward 0.2), sees a 3-token observation and answers (reward 1);
    # B runs out of tokens on its first turn (finish "length", reward 0)
    a = episode([1, 2], [([10, 11], [-0.1, -0.2], "stop"), ([12], [-0.3], "stop")], [[50, 51, 52]])
    a.turn_rewards[0] = 0.2
    b = episode([1, 2], [([20, 21, 22], [-0.1, -0.1, -0.1], "length")])
    # group 2: C, an agent episode whose history was rewritten: an earlier segment S1, then C (reward 1);
    # D answers at once (reward 0)
    s1 = episode([3], [([30], [-0.5], "stop")])
    c = episode([3, 30, 40], [([31, 32], [-0.1, -0.1], "stop")])
    c.earlier_segments = [s1]
    d = episode([3], [([33], [-0.2], "stop")])
    prompt = [Prompt(k, (1, 2), "p", "1", {}, RowLocation("t.jsonl", "line", k + 1)) for k in range(2)]
    return [Group(prompt[0], [a, b], [1.0, 0.0], [1.0, 0.0]), Group(prompt[1], [c, d], [1.0, 0.0], [1.0, 0.0])]


def build(**over: object) -> StepBatch:
    base = {"rollout.n_samples_per_prompt": 2, "train.prompts_per_step": 2, "algorithm.adv_norm_std": False}
    cfg = load_config(None, [f"{k}={v}" for k, v in {**base, **over}.items()])
    return SampleBuilder(cfg).build(step_groups(), {"step": 1.0})


def floats(values: list[torch.Tensor]) -> list[list[float]]:
    return [v.reshape(-1).tolist() for v in values]


def close(got: list[list[float]], want: list[list[float]]) -> bool:
    """Equal shapes, and every value within 1e-6."""
    return [len(g) for g in got] == [len(w) for w in want] and all(
        g == pytest.approx(w, abs=1e-6) for g, w in zip(got, want, strict=True)
    )


def test_the_builder_gives_tokens_masks_and_outcome_advantages_by_hand() -> None:
    plan = build()
    batch = plan.batch
    # one sequence per segment, in episode order: A, B, S1, C, D
    assert [t.tolist() for t in batch.tokens] == [
        [1, 2, 10, 11, 50, 51, 52, 12],
        [1, 2, 20, 21, 22],
        [3, 30],
        [3, 30, 40, 31, 32],
        [3, 33],
    ]
    assert batch.prompt_lengths == [2, 2, 1, 3, 1]
    # the observation tokens of A are out of the loss; the truncated B is trained (no overlong filter)
    assert [m.tolist() for m in batch.response_mask] == [
        [True, True, False, False, False, True],
        [True, True, True],
        [True],
        [True, True],
        [True],
    ]
    assert floats(batch.rollout_log_probs)[0] == pytest.approx([-0.1, -0.2, 0.0, 0.0, 0.0, -0.3])
    # outcome credit, mean-only: rewards [1, 0] in each group -> +-0.5; S1 gets its episode C's
    assert floats(batch.advantages) == [[0.5], [-0.5], [0.5], [0.5], [-0.5]]
    assert plan.rewards.tolist() == [1.0, 0.0, 1.0, 1.0, 0.0] and plan.episodes.tolist() == [0, 1, 2, 2, 3]
    assert plan.versions == [[3, 3, 3], [3, 3, 3], [3], [3, 3], [3]]
    assert plan.metrics == {"step": 1.0, "reward/train_mean": 0.5}
    batch.validate(vocab_size=64, num_layers=1, top_k=1, num_experts=None)


def test_the_overlong_filter_takes_the_truncated_episode_out_of_the_loss() -> None:
    masks = [m.tolist() for m in build(**{"algorithm.overlong_filter": True}).batch.response_mask]
    assert masks[1] == [False, False, False]
    assert masks[0] == [True, True, False, False, False, True] and all(all(m) for m in masks[2:])


def test_per_turn_credit_discounts_turn_rewards_and_counts_turns_across_segments() -> None:
    batch = build(**{"algorithm.turn_credit": "per_turn", "algorithm.turn_discount": 0.5}).batch
    # returns: A [0.2 + 0.5 * 1, 1] = [0.7, 1]; B [0]; C over its segments S1, C: [0.5 * 1, 1] = [0.5, 1]; D [0]
    # turn 0 against the group's turn 0 (mean-only): A 0.35, B -0.35, C 0.25, D -0.25; turn 1 is reached
    # by A (and C) alone: 0. A's observation tokens follow turn 0 and carry its advantage (masked anyway);
    # C's own tokens are the episode's turn 1 (S1 was turn 0)
    assert close(floats(batch.advantages), [[0.35] * 5 + [0.0], [-0.35] * 3, [0.25], [0.0, 0.0], [-0.25]])


def test_kl_in_reward_advantages_wait_for_the_reference_and_penalise_each_episode_once() -> None:
    cfg_over = {"algorithm.kl_in_reward": True, "algorithm.kl_coef": 0.5, "algorithm.kl_estimator": "k1"}
    plan = build(**cfg_over)
    batch = plan.batch
    assert batch.advantages is None  # not before the reference forward: they are computed once, after it
    # the reference's log-probs; A's observation tokens are far from it but out of the loss mask
    ref = [
        torch.tensor([-0.2, -0.3, -5.0, -5.0, -5.0, -0.5]),
        torch.tensor([-0.1, -0.1, -0.1]),
        torch.tensor([-0.7]),
        torch.tensor([-0.4, -0.4]),
        torch.tensor([-0.2]),
    ]
    masks = [batch.loss_mask(i) for i in range(len(batch))]
    kl, _ = reference_kl(batch.rollout_log_probs, ref, masks, "k1", 20.0)
    kl_sums = torch.stack([k.sum() for k in kl])
    assert kl_sums.tolist() == pytest.approx([0.4, 0.0, 0.2, 0.6, 0.0])
    cfg = load_config(
        None,
        [
            f"{k}={v}"
            for k, v in {"rollout.n_samples_per_prompt": 2, "algorithm.adv_norm_std": False, **cfg_over}.items()
        ],
    )
    advantages, metrics = kl_penalized_advantages(cfg, plan.rewards, kl_sums, plan.episodes)
    # episodes' KL: A 0.4, B 0, C 0.2 + 0.6 = 0.8, D 0; R - 0.5 KL: [0.8, 0] and [0.6, 0] -> +-0.4, +-0.3
    assert close(floats(advantages), [[0.4], [-0.4], [0.3], [0.3], [-0.3]])
    # the trainer's call, from the per-token KL: the same advantages and no returns (no critic)
    same, returns, same_metrics = step_advantages(cfg, plan.rewards, masks, plan.episodes, kl)
    assert close(floats(same), floats(advantages)) and returns is None and same_metrics == metrics
    assert metrics["reward/kl_penalty_mean"] == pytest.approx(0.5 * 1.2 / 4)
    assert metrics["reward/kl_penalized_mean"] == pytest.approx(1.4 / 4)


def test_the_advantage_estimator_key_selects_rloo_and_the_reinforce_plus_plus_pair() -> None:
    # the step's episodes: A (reward 1) and B (0); C (1: its segments S1 and C) and D (0). Trained tokens
    # (the loss masks above): A 3 (its observation is not), B 3, C 3 over S1 + C, D 1
    rloo = build(**{"algorithm.advantage_estimator": "rloo", "algorithm.adv_norm_std": True}).batch
    # rewards minus the other response's: +-1 in both groups; S1 gets its episode C's
    assert floats(rloo.advantages) == [[1.0], [-1.0], [1.0], [1.0], [-1.0]]
    baseline = build(
        **{"algorithm.advantage_estimator": "reinforce_plus_plus_baseline", "algorithm.adv_norm_std": True}
    )
    # minus the group mean: +-0.5, on 3, 3, 3, 1 tokens: mean (1.5 - 1.5 + 1.5 - 0.5) / 10 = 0.1, squared
    # deviations 6 * 0.4^2 + 4 * 0.6^2 = 2.4, unbiased variance 2.4 / 9 -> 0.4 / 0.5164 and -0.6 / 0.5164
    p, q = 0.774597, -1.161895
    assert close(floats(baseline.batch.advantages), [[p], [q], [p], [p], [q]])
    plus = build(
        **{
            "algorithm.advantage_estimator": "reinforce_plus_plus",
            "algorithm.adv_norm_std": True,
            "algorithm.gamma": 0.5,
        }
    ).batch
    # per trained token, gamma 0.5, the reward on the episode's last trained token: A 0.25, 0.5, (obs 0 0 0), 1;
    # B 0 0 0; C's row S1 + C: 0.25 | 0.5, 1; D 0. Mean 3.5 / 10 = 0.35, squared deviations 2 * (0.1^2 +
    # 0.15^2 + 0.65^2) + 4 * 0.35^2 = 1.4, unbiased variance 1.4 / 9 -> (G - 0.35) / 0.394405; observations 0
    a, b, c, z = -0.253546, 0.380319, 1.648051, -0.887412
    assert close(floats(plus.advantages), [[a, b, 0, 0, 0, c], [z, z, z], [a], [b, c], [z]])
    plus.validate(vocab_size=64, num_layers=1, top_k=1, num_experts=None)


def test_kl_in_reward_takes_the_loss_masks_for_the_batch_whitened_baseline() -> None:
    over = {
        "algorithm.kl_in_reward": True,
        "algorithm.kl_coef": 0.5,
        "algorithm.kl_estimator": "k1",
        "algorithm.adv_norm_std": True,
        "rollout.n_samples_per_prompt": 2,
    }
    plan = build(**over)
    masks = [plan.batch.loss_mask(i) for i in range(len(plan.batch))]
    kl_sums = torch.tensor([0.4, 0.0, 0.2, 0.6, 0.0])  # the previous test's reference; episodes' KL 0.4, 0, 0.8, 0
    rloo_cfg = load_config(None, [f"{k}={v}" for k, v in {**over, "algorithm.advantage_estimator": "rloo"}.items()])
    advantages, _ = kl_penalized_advantages(rloo_cfg, plan.rewards, kl_sums, plan.episodes)
    # R - 0.5 KL: [0.8, 0] and [0.6, 0]; leave-one-out: +-0.8, +-0.6
    assert close(floats(advantages), [[0.8], [-0.8], [0.6], [0.6], [-0.6]])
    name = "reinforce_plus_plus_baseline"
    cfg = load_config(None, [f"{k}={v}" for k, v in {**over, "algorithm.advantage_estimator": name}.items()])
    with pytest.raises(ValueError, match=r"'reinforce_plus_plus_baseline' whitens .* the 5 sequences, got None"):
        kl_penalized_advantages(cfg, plan.rewards, kl_sums, plan.episodes)
    advantages, _ = kl_penalized_advantages(cfg, plan.rewards, kl_sums, plan.episodes, masks)
    # minus the group mean: 0.4, -0.4, 0.3, -0.3 on 3, 3, 3, 1 tokens: mean 0.6 / 10 = 0.06, squared deviations
    # 3 * (0.34^2 + 0.46^2 + 0.24^2) + 0.36^2 = 1.284, unbiased variance 1.284 / 9 -> (a - 0.06) / 0.377712
    p, q, r, s = 0.900156, -1.217858, 0.635404, -0.953106
    assert close(floats(advantages), [[p], [q], [r], [r], [s]])


def test_a_response_filtered_out_of_the_loss_still_counts_in_its_group_baseline() -> None:
    # B (truncated, out of the loss with the overlong filter) now has reward 1 and A 0: group 1's mean is
    # 0.5 with B's reward, so A's advantage is -0.5 (it would be 0 were B's reward lost with its tokens)
    groups = step_groups()
    groups[0] = Group(groups[0].prompt, groups[0].episodes, [0.0, 1.0], [0.0, 1.0])
    over = {"algorithm.advantage_estimator": "reinforce_plus_plus_baseline", "algorithm.overlong_filter": True}
    base = {"rollout.n_samples_per_prompt": 2, "train.prompts_per_step": 2, **over}
    cfg = load_config(None, [f"{k}={v}" for k, v in base.items()])
    batch = SampleBuilder(cfg).build(groups, {}).batch
    # trained: A -0.5 on 3 tokens, C 0.5 on 3 (S1 + C), D -0.5 on 1; B none. Mean (-1.5 + 1.5 - 0.5) / 7
    # = -1/14; squared deviations 3 * (3/7)^2 + 3 * (4/7)^2 + (3/7)^2 = 84/49, unbiased variance 84/49 / 6
    # = 2/7 -> A, D: (-3/7) / sqrt(2/7) = -0.801784; C: (4/7) / sqrt(2/7) = 1.069045; B: (0.5 + 1/14) /
    # sqrt(2/7) on no token, so 0
    a, c = -0.801784, 1.069045
    assert close(floats(batch.advantages), [[a], [0.0], [c], [c], [a]])
