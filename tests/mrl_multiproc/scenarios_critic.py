"""PPO's critic (`megatron_rl.critic.MegatronCritic`) across layouts, in tests/test_actor_distributed.py's launches.

World size 1 records the critic's values of the tiny policy's batch and two updates of the clipped value loss (V_old
off the values, so that clipping acts; the metrics and the values after them). TP 2 with sequence parallelism (the
1-wide values gathered over TP, the head's gradients summed over it), PP 2 (the head on the last stage, 1F1B) and
EP 2 (the experts' gradients over the expert-data-parallel group, the samples over 2 DP ranks) reproduce them, with
packed micro-batches: values within 1e-5, the updates' loss, clip fraction and gradient norm within 1e-5 relative,
and the values after them within 1e-5.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_rl.config import Config, ParallelConfig, TrainConfig, preset, validate
from megatron_rl.config.critic import CriticConfig

from mrl_configs import layout
from mrl_multiproc.scenarios_actor import LOGPROB_TOL, actor_config, assert_close, load_ref, make_batch, save_ref


def critic_config(parallel: ParallelConfig, packed: bool) -> Config:
    """The actor scenarios' tiny policy and schedule, PPO's critic at lr 3e-3 and a value clip of 0.1."""
    cfg = actor_config(parallel)
    train: TrainConfig = dataclasses.replace(cfg.train, micro_batch_tokens=40 if packed else 0)
    cfg = dataclasses.replace(
        cfg, algorithm=preset("ppo"), critic=CriticConfig(enabled=True, lr=3e-3, cliprange_value=0.1), train=train
    )
    validate(cfg)
    return cfg


def critic_run(parallel: ParallelConfig, packed: bool) -> dict[str, object]:
    """The values of `make_batch`, two updates towards returns of both signs from V_old 0.2-noisy around the
    values, and the values after them."""
    from megatron_rl.critic.critic import MegatronCritic
    from megatron_rl.parallel import init_distributed

    cfg = critic_config(parallel, packed)
    init_distributed(cfg.parallel, cfg.model, seed=cfg.train.seed)
    critic = MegatronCritic(cfg)
    batch = make_batch(cfg.model.vocab_size)
    values = critic.compute_values(batch)
    gen = torch.Generator().manual_seed(4)
    old = [v + 0.2 * torch.randn(v.shape, generator=gen) for v in values]
    returns = [torch.randn(v.shape, generator=gen) for v in values]
    history = critic.train(batch.with_fields(old_values=old, returns=returns))
    return {"values": values, "history": history, "after": critic.compute_values(batch)}


def w1_critic_reference(ctx) -> None:  # noqa: ANN001
    """The references; the updates clipped some tokens and moved the values."""
    result = critic_run(layout(), packed=False)
    assert any(h["vf_clipfrac"] > 0 for h in result["history"]), result["history"]
    assert max(float((a - b).abs().max()) for a, b in zip(result["after"], result["values"], strict=True)) > 1e-3
    save_ref(ctx, "critic", result)


def check_critic_layout(ctx, parallel: ParallelConfig) -> None:  # noqa: ANN001
    want = load_ref(ctx, "critic")
    got = critic_run(parallel, packed=True)
    what = f"critic, layout {parallel}, packed"
    assert_close(got["values"], want["values"], LOGPROB_TOL, f"values, {what}")
    for have, expected in zip(got["history"], want["history"], strict=True):
        for key in ("vf_loss", "vf_clipfrac", "vpred_mean", "grad_norm"):
            if abs(have[key] - expected[key]) > 1e-5 * max(1.0, abs(expected[key])):
                raise AssertionError(f"{what}, metric {key}: {have[key]} vs reference {expected[key]}")
    assert_close(got["after"], want["after"], LOGPROB_TOL, f"values after 2 updates, {what}")


def w2_critic_tp2_sp(ctx) -> None:  # noqa: ANN001
    check_critic_layout(ctx, layout(tp=2, sp=True))


def w2_critic_pp2(ctx) -> None:  # noqa: ANN001
    check_critic_layout(ctx, layout(pp=2))


def w2_critic_ep2(ctx) -> None:  # noqa: ANN001
    check_critic_layout(ctx, layout(ep=2))
