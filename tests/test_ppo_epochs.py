"""`train.ppo_epochs`: passes over each step's batch, on the tiny MoE policy in this process (a world of one).

Two actors from the same seed: A trains with ppo_epochs = 2, B with ppo_epochs = 1 and is given the same
batch (the same old log-probs) twice. Hand-checkable: A's first pass sees ratio 1 (the old log-probs are
its own); its second pass is B's second call bit for bit (the old log-probs stay those of before the first
pass), and its ratio and clip fractions are those computed by hand from B's log-probs after one update.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.config import Config, RolloutConfig, TrainConfig, optimizer_steps, preset, warmup_steps

from mrl_configs import launch_of_one, layout, seeded_batch, tiny_model

LENGTHS = (12, 7, 15, 9)
PROMPTS = (5, 3, 6, 2)
CLIP = 0.2  # grpo's clip_eps_low and clip_eps_high


def _config(ppo_epochs: int) -> Config:
    return Config(
        model=tiny_model("qwen3_moe"),
        parallel=layout(),
        rollout=RolloutConfig(temperature=1.0, max_new_tokens=16),
        algorithm=preset("grpo"),
        train=TrainConfig(
            steps=4, updates_per_step=1, ppo_epochs=ppo_epochs, max_tokens_per_micro_batch=64, lr=1e-4, seed=3
        ),
    )


@pytest.fixture(scope="module")
def actors() -> Iterator[tuple[object, object]]:
    from megatron_rl.actor.actor import MegatronActor

    with launch_of_one():
        a, b = MegatronActor(_config(2)), MegatronActor(_config(1))
        try:
            yield a, b
        finally:
            a.close()
            b.close()


def _params(actor) -> dict[str, torch.Tensor]:  # noqa: ANN001
    return {k: v.clone() for k, v in actor.full_params().items()}


def test_the_second_pass_trains_against_the_old_log_probs_of_before_the_first(actors) -> None:  # noqa: ANN001
    a, b = actors
    assert _params(a).keys() == _params(b).keys()
    assert all(torch.equal(x, y) for x, y in zip(_params(a).values(), _params(b).values(), strict=True))
    plain = seeded_batch(a.cfg.model.vocab_size, LENGTHS, PROMPTS)
    old = a.compute_log_probs(plain).log_probs
    batch: ActorBatch = plain.with_fields(old_log_probs=old)

    history = a.train(batch)
    assert len(history) == 2 and a.step == 2  # 1 mini-batch x 2 passes: two optimizer steps
    first, second = history
    assert abs(first["ratio_mean"] - 1.0) < 1e-6 and first["ratio_max"] - first["ratio_min"] < 1e-5
    assert first["clip_low_frac"] == first["clip_high_frac"] == 0.0

    once = b.train(batch)  # B after one update is A at the start of its second pass
    moved = b.compute_log_probs(plain).log_probs
    masks = [batch.loss_mask(i) for i in range(len(batch))]
    ratios = torch.cat([torch.exp(n.double() - o.double())[m] for n, o, m in zip(moved, old, masks, strict=True)])
    signs = torch.cat([torch.full((int(m.sum()),), float(batch.advantages[i])) for i, m in enumerate(masks)])
    by_hand = {
        "ratio_mean": float(ratios.mean()),
        "clip_high_frac": float(((signs > 0) & (ratios > 1 + CLIP)).double().mean()),
        "clip_low_frac": float(((signs < 0) & (ratios < 1 - CLIP)).double().mean()),
    }
    assert abs(by_hand["ratio_mean"] - 1.0) > 0.01  # the policy has moved: the ratio departs from 1 (1.035 here)
    assert by_hand["clip_high_frac"] + by_hand["clip_low_frac"] > 0  # and the clip fraction rises from 0 (2 of 27)
    for key, value in by_hand.items():
        assert second[key] == pytest.approx(value, abs=1e-5), key

    again = b.train(batch)  # the same batch, the same old log-probs: A's second pass, bit for bit
    assert once[0] == first and again[0] == second
    assert all(torch.equal(x, y) for x, y in zip(_params(a).values(), _params(b).values(), strict=True))


def test_the_learning_rate_schedule_spans_every_pass() -> None:
    train = dataclasses.replace(_config(3).train, steps=5, updates_per_step=2, lr_warmup_ratio=0.25)
    assert optimizer_steps(train) == 30 and warmup_steps(train) == 7  # floor(0.25 x 5 x 2 x 3)
