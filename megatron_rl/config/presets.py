"""The objectives' presets: `algorithm.name` picks one, and its published defaults fill the `algorithm`
section beneath what the YAML file and the overrides give (docs/configuration.md's preset table)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megatron_rl.config.errors import ConfigError

if TYPE_CHECKING:
    from megatron_rl.config.schema import AlgorithmConfig

# The objectives (`algorithm.name`) with their published defaults, as docs/configuration.md's preset table and the
# loss table of docs/architecture.md list them; anything not named keeps the AlgorithmConfig default.
PRESETS: dict[str, dict[str, Any]] = {
    "grpo": dict(
        ratio_level="token",
        gate="clip",
        clip_eps_low=0.2,
        clip_eps_high=0.2,
        loss_agg_mode="seq-mean-token-mean",
        kl_coef=0.0,  # beta 0 unless set: DeepSeekMath's 0.04 is algorithm.kl_coef=0.04
        kl_estimator="k3",
    ),
    "dapo": dict(
        ratio_level="token",
        gate="clip",
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        loss_agg_mode="token-mean",
        kl_coef=0.0,
        dynamic_sampling=True,
        soft_overlong_punishment=True,
    ),
    "gspo": dict(
        ratio_level="sequence",
        gate="clip",
        clip_eps_low=3e-4,
        clip_eps_high=4e-4,
        loss_agg_mode="seq-mean-token-mean",
        kl_coef=0.0,
    ),
    "gspo_token": dict(
        ratio_level="sequence_token",
        gate="clip",
        clip_eps_low=3e-4,
        clip_eps_high=4e-4,
        loss_agg_mode="seq-mean-token-mean",
        kl_coef=0.0,
    ),
    "sapo": dict(
        ratio_level="token",
        gate="soft",
        sapo_tau_pos=1.0,
        sapo_tau_neg=1.05,
        loss_agg_mode="seq-mean-token-mean",
        kl_coef=0.0,
    ),
    # PPO with a critic (verl 0.9.1's ppo_trainer.yaml): the token-level clip, GAE (gamma = lambda = 1) of the
    # critic's values, no KL; critic.* keeps verl's critic defaults (lr 1e-5, cliprange_value 0.5, no warm-up)
    "ppo": dict(
        ratio_level="token",
        gate="clip",
        clip_eps_low=0.2,
        clip_eps_high=0.2,
        loss_agg_mode="token-mean",
        kl_coef=0.0,
        advantage_estimator="gae",
        gamma=1.0,
        lam=1.0,
    ),
    # on-policy distillation: the teacher's per-token advantage alone (distill.*; docs/training.md)
    "opd": dict(
        ratio_level="token",
        gate="clip",
        clip_eps_low=0.2,
        clip_eps_high=0.2,
        loss_agg_mode="token-mean",
        kl_coef=0.0,
    ),
}


def preset(name: str) -> AlgorithmConfig:
    """The `algorithm` section with the published defaults of objective `name`."""
    from megatron_rl.config.schema import AlgorithmConfig  # the schema types algorithm.name by PRESETS' names

    if name not in PRESETS:
        raise ConfigError(f"algorithm.name: unknown objective {name!r}; allowed: {sorted(PRESETS)}")
    return AlgorithmConfig(name=name, **PRESETS[name])
