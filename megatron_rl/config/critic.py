"""The `critic` section: PPO's value model (`megatron_rl.critic`), its start, learning rate and value clipping."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config.fields import described as _f


@dataclass
class CriticConfig:
    """The critic: the policy's backbone with a scalar value head, trained on the returns (docs/training.md)."""

    enabled: bool = _f(False, "train a critic, PPO's value model; critic.hf_path implies it")
    hf_path: str | None = _f(
        None,
        "a token-classification folder to start the critic from (transformers' AutoModelForTokenClassification "
        "with num_labels = 1, verl's critic format; the policy's architecture); null = the policy's backbone "
        "(model.hf_path) with a fresh value head drawn from train.seed",
    )
    lr: float = _f(1e-5, "the critic's learning rate", gt=0)
    cliprange_value: float = _f(
        0.5,
        "value clipping c: each token's loss is the larger of (V - R)^2 and (clip(V, V_old - c, V_old + c) - R)^2, "
        "V_old the values of the rollout batch before the update",
        gt=0,
    )
    warmup_steps: int = _f(
        0, "steps at the start that train only the critic, the policy's update skipped (verl's critic_warmup)", ge=0
    )
