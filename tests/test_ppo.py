"""PPO with a critic, without Megatron: GAE of the critic's values against hand-computed cases (masked observation
tokens, an agent episode of two sequences, the KL in the reward with gamma and lambda), the step's order with
stand-in models (old log-probs, the reference, the critic's values, the advantages, the critic's update, the
actor's update) and the critic's warm-up, which skips the policy's update; the resume of a run whose checkpoint
has no critic. (The critic's Megatron model: tests/test_critic.py; its layouts: tests/mrl_multiproc/
scenarios_critic.py; a resumed PPO run against the uninterrupted one: tests/test_trainer.py.)"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.actor.forward import LogProbResult
from megatron_rl.config import Config, ConfigError, load_config
from megatron_rl.loop.samples import StepBatch, advantages_after_forwards, gae_advantages, step_advantages


def ppo_cfg(**over: object) -> Config:
    base = {"algorithm.name": "ppo", "model.hf_path": "unused", "data.train_path": "unused", "train.steps": 4}
    base.update(over)
    return load_config(None, [f"{k}={v}" for k, v in base.items()])


def whitened(raw: list[float], trained: list[bool]) -> list[float]:
    """verl's masked_whiten of `raw` over the `trained` entries (every entry whitened, masked ones too)."""
    kept = [a for a, t in zip(raw, trained, strict=True) if t]
    mean = sum(kept) / len(kept)
    var = sum((a - mean) ** 2 for a in kept) / (len(kept) - 1)
    return [(a - mean) / math.sqrt(var + 1e-8) for a in raw]


def flat(tensors: list[torch.Tensor]) -> list[float]:
    return [float(x) for t in tensors for x in t.reshape(-1)]


def test_ppo_implies_the_critic_and_waits_for_its_values() -> None:
    cfg = ppo_cfg()
    assert cfg.critic.enabled and cfg.algorithm.advantage_estimator == "gae"
    assert advantages_after_forwards(cfg.algorithm)
    assert not advantages_after_forwards(ppo_cfg(**{"algorithm.name": "grpo", "critic.enabled": False}).algorithm)


def test_gae_with_lambda_and_gamma_1_is_the_monte_carlo_return_minus_the_value() -> None:
    """Episode 0: 3 tokens, the middle one an observation (masked), reward 1; episode 1: 2 tokens, reward 0.
    The masked token takes no value (its 9.0 is never read) and carries the running advantage through."""
    cfg = ppo_cfg()
    values = [torch.tensor([0.5, 9.0, 0.25]), torch.tensor([0.2, 0.4])]
    masks = [torch.tensor([True, False, True]), torch.tensor([True, True])]
    adv, returns, metrics = gae_advantages(cfg, torch.tensor([1.0, 0.0]), values, masks)
    # episode 0: G = 1 on both trained tokens: A = 1 - 0.5, (carried 0.75), 1 - 0.25; episode 1: G = 0: -0.2, -0.4
    raw = [0.5, 0.75, 0.75, -0.2, -0.4]
    assert flat(adv) == pytest.approx(whitened(raw, [True, False, True, True, True]), abs=1e-6)
    assert flat(returns) == pytest.approx([1.0, 0.75 + 9.0, 1.0, 0.0, 0.0], abs=1e-6)  # A + V, before whitening
    assert metrics == {}  # no KL in the reward


def test_gae_with_the_kl_in_the_reward_gamma_and_lambda() -> None:
    """r_t = -beta KL_t on each trained token, plus the reward on the last (verl's apply_kl_penalty), beta 0.5,
    gamma 0.9, lambda 0.5. Episode A: V 0.2, 0.4, KL 0.1, 0.3, R 1: r = -0.05, 0.85; delta_1 = 0.85 - 0.4 = 0.45,
    delta_0 = -0.05 + 0.9 * 0.4 - 0.2 = 0.11, A_0 = 0.11 + 0.45 * 0.45 = 0.3125. Episode B: V 0, KL 0.2, R 0: -0.1."""
    cfg = ppo_cfg(**{"algorithm.gamma": 0.9, "algorithm.lam": 0.5, "algorithm.kl_coef": 0.5,
                     "algorithm.kl_in_reward": True})  # fmt: skip
    values = [torch.tensor([0.2, 0.4]), torch.tensor([0.0])]
    masks = [torch.ones(2, dtype=torch.bool), torch.ones(1, dtype=torch.bool)]
    kl = [torch.tensor([0.1, 0.3], dtype=torch.float64), torch.tensor([0.2], dtype=torch.float64)]
    adv, returns, metrics = step_advantages(cfg, torch.tensor([1.0, 0.0]), masks, None, kl, values)
    assert flat(adv) == pytest.approx(whitened([0.3125, 0.45, -0.1], [True] * 3), abs=1e-6)
    assert flat(returns) == pytest.approx([0.5125, 0.85, -0.1], abs=1e-6)
    # the penalty of each episode, beta x its summed KL: 0.2 and 0.1; its penalised reward 0.8 and -0.1
    assert metrics == pytest.approx({"reward/kl_penalty_mean": 0.15, "reward/kl_penalized_mean": 0.35})


def test_an_agent_episode_of_two_sequences_is_one_gae_row() -> None:
    """Episode 0 is sequences 0 and 1 (the first token of the second an observation), reward 1, end to end: the
    last value of sequence 0 bootstraps from the first trained one of sequence 1. Episode 1: sequence 2, reward 0."""
    cfg = ppo_cfg()
    values = [torch.tensor([0.1, 0.2]), torch.tensor([5.0, 0.3]), torch.tensor([0.5, 0.5])]
    masks = [torch.tensor([True, True]), torch.tensor([False, True]), torch.tensor([True, True])]
    rewards = torch.tensor([1.0, 1.0, 0.0])  # each sequence carries its episode's reward
    adv, returns, _ = gae_advantages(cfg, rewards, values, masks, episodes=torch.tensor([0, 0, 1]))
    raw = [0.9, 0.8, 0.7, 0.7, -0.5, -0.5]
    assert [len(a) for a in adv] == [2, 2, 2]
    assert flat(adv) == pytest.approx(whitened(raw, [True, True, False, True, True, True]), abs=1e-6)
    assert flat(returns) == pytest.approx([1.0, 1.0, 5.7, 1.0, 0.0, 0.0], abs=1e-6)


def test_a_step_with_no_trained_token_gets_zero_advantages() -> None:
    values, masks = [torch.tensor([0.5, 0.5])], [torch.zeros(2, dtype=torch.bool)]
    adv, returns, _ = gae_advantages(ppo_cfg(), torch.tensor([1.0]), values, masks)
    assert flat(adv) == [0.0, 0.0] and flat(returns) == [0.5, 0.5]


# ---- the step's order and the warm-up, with stand-in models ----


class StandInActor:
    """The policy: its old log-probs are the engine's (no gap); records what it trains on."""

    def __init__(self) -> None:
        self.trained: list[ActorBatch] = []

    def compute_log_probs(self, batch: ActorBatch, **_: Any) -> LogProbResult:
        return LogProbResult(list(batch.rollout_log_probs), [torch.zeros_like(lp) for lp in batch.rollout_log_probs])

    def train(self, batch: ActorBatch) -> list[dict[str, float]]:
        self.trained.append(batch)
        return [{"loss": 0.1, "pg_loss": 0.1}]


class StandInCritic:
    """The critic: values from a table; records what it trains on."""

    def __init__(self, values: list[torch.Tensor]) -> None:
        self.values = values
        self.trained: list[ActorBatch] = []

    def compute_values(self, batch: ActorBatch) -> list[torch.Tensor]:
        return self.values

    def train(self, batch: ActorBatch) -> list[dict[str, float]]:
        self.trained.append(batch)
        return [{"vf_loss": 0.25, "vf_clipfrac": 0.5, "vpred_mean": 0.3}, {"vf_loss": 0.15, "vf_clipfrac": 0.0,
                                                                            "vpred_mean": 0.4}]  # fmt: skip


def _trainer(cfg: Config, values: list[torch.Tensor]) -> Any:
    from megatron_rl.trainer import Trainer

    return Trainer(cfg, None, StandInActor(), None, None, None, None, StandInCritic(values))  # type: ignore[arg-type]


def test_the_critic_warms_up_alone_then_both_train_on_gae() -> None:
    """critic.warmup_steps = 1: at step 1 the critic trains on the GAE returns of its values and the policy is not
    updated; at step 2 both train, the actor on the whitened GAE advantages. The explained variance is verl's, of
    the returns by the values over the trained tokens."""
    cfg = ppo_cfg(**{"critic.warmup_steps": 1})
    values = [torch.tensor([0.5, 9.0, 0.25]), torch.tensor([0.2, 0.4])]  # the hand case above
    masks = [torch.tensor([True, False, True]), torch.tensor([True, True])]
    batch = ActorBatch(
        tokens=[torch.arange(6), torch.arange(4)],
        prompt_lengths=[3, 2],
        response_mask=masks,
        rollout_log_probs=[torch.full((3,), -0.5), torch.full((2,), -0.5)],
    )
    trainer = _trainer(cfg, values)
    out = trainer._update(StepBatch(batch, {}, torch.tensor([1.0, 0.0])), 1)
    assert trainer.actor.trained == [] and out["critic/warmup"] == 1.0 and "actor/pg_loss" not in out
    (seen,) = trainer.critic.trained
    assert flat(seen.old_values) == flat(values) and flat(seen.returns) == pytest.approx([1.0, 9.75, 1.0, 0.0, 0.0])
    assert flat(seen.advantages) == pytest.approx(whitened([0.5, 0.75, 0.75, -0.2, -0.4], [1, 0, 1, 1, 1]), abs=1e-6)
    # the critic's updates, averaged; its explained variance over the 4 trained tokens: returns 1, 1, 0, 0 (variance
    # 1/3) by values 0.5, 0.25, 0.2, 0.4: errors 0.5, 0.75, -0.2, -0.4 (mean 0.1625, unbiased variance 0.906875 / 3)
    assert out["critic/vf_loss"] == pytest.approx(0.2) and out["critic/vf_clipfrac"] == pytest.approx(0.25)
    assert out["critic/updates"] == 2.0 and out["critic/values_mean"] == pytest.approx(1.35 / 4)
    assert out["critic/vf_explained_var"] == pytest.approx(
        1 - (0.906875 / 3) / (1 / 3 + 1e-5), abs=1e-7
    )  # float32 values
    out = trainer._update(StepBatch(batch, {}, torch.tensor([1.0, 0.0])), 2)
    assert "critic/warmup" not in out and out["actor/pg_loss"] == 0.1 and len(trainer.critic.trained) == 2
    (policy,) = trainer.actor.trained
    assert flat(policy.advantages) == flat(seen.advantages) and flat(policy.old_log_probs) == [-0.5] * 5


def test_a_checkpoint_without_a_critic_is_not_resumed_with_one(tmp_path: Path) -> None:
    from megatron_rl.run_folder import CRITIC_DIR, RunFolder

    class Loaded:
        def __init__(self) -> None:
            self.paths: list[Path] = []

        def save(self, path: Path) -> dict[str, str]:
            raise NotImplementedError

        def load(self, path: Path) -> dict[str, Any]:
            self.paths.append(path)
            return {}

    folder = RunFolder.__new__(RunFolder)  # only where it resumes from matters here
    folder.resume_from = None
    model = Loaded()
    folder.resume_model(model, CRITIC_DIR, "critic.enabled")  # a fresh run: nothing to load
    folder.resume_from = tmp_path / "step_000002"
    (folder.resume_from / "actor").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"^critic.enabled = true, but the checkpoint .*step_000002 holds no critic/"):
        folder.resume_model(model, CRITIC_DIR, "critic.enabled")
    (folder.resume_from / CRITIC_DIR).mkdir()
    folder.resume_model(model, CRITIC_DIR, "critic.enabled")
    assert model.paths == [folder.resume_from / CRITIC_DIR]
