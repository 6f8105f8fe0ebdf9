"""The cluster flags as pure functions of the platform (`models.fusion_choice`, `actor.optimizer.ddp_config`,
`fuse_adam`): Transformer Engine with CUDA against the CPU, no GPU needed; then, on one rank in this process, one
GRPO update with DDP's overlapped gradient reduce and parameter gather, and with torch's fused Adam, equal to the
plain one within 1e-6 (fp32)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rl.config import Config, ConfigError, ParallelConfig, RolloutConfig, TrainConfig, preset
from megatron_rl.config.model_extras import FusionConfig
from megatron_rl.models.fusion_choice import CPU, FUSIONS, Platform, fusion_blockers, fusion_fields

from mrl_configs import actor_of_one, layout, seeded_batch, tiny_gpt_oss_model, tiny_model, tiny_sigmoid_model

TE_CUDA = Platform(cuda=True, transformer_engine="2.8.0")
LOCAL_CUDA = Platform(cuda=True)
TOL = 1e-6


def _on(fields: dict[str, bool]) -> set[str]:
    return {name for name, on in fields.items() if on}


def test_transformer_engine_on_cuda_runs_every_fusion_the_model_supports() -> None:
    moe, dense = tiny_model("qwen3_moe"), tiny_model("qwen3", num_experts=None)
    assert _on(fusion_fields(moe, TE_CUDA, routing_replay=False)) == set(FUSIONS)
    replay = fusion_blockers(moe, TE_CUDA, routing_replay=True)  # the actor's MoE: routing replay is built
    assert list(replay) == ["moe_router_fusion"] and "bypasses Megatron's RouterReplay" in replay["moe_router_fusion"]
    assert _on(fusion_fields(dense, TE_CUDA, routing_replay=False)) == set(FUSIONS) - {
        "moe_permute_fusion",
        "moe_router_fusion",
    }
    old_te = fusion_blockers(moe, Platform(cuda=True, transformer_engine="2.5.1+abc"), routing_replay=False)
    assert old_te == {"moe_router_fusion": "it needs Transformer Engine >= 2.7, this is 2.5.1+abc"}
    yarn = fusion_blockers(tiny_sigmoid_model("deepseek_v3"), TE_CUDA, routing_replay=False)
    assert "experimental and training-only" in yarn["apply_rope_fusion"]
    gpt_oss = fusion_blockers(tiny_gpt_oss_model(), TE_CUDA, routing_replay=False)
    assert "model.family = 'gpt_oss': its gate is no plain SiLU" in gpt_oss["bias_activation_fusion"]
    gemma = fusion_blockers(tiny_model("gemma2", num_experts=None), LOCAL_CUDA, routing_replay=False)
    assert "model.family = 'gemma2': its gate is no plain SiLU" in gemma["bias_activation_fusion"]
    assert "no yarn cos/sin factor" in gpt_oss["apply_rope_fusion"]


def test_the_cpu_and_the_local_specs_keep_the_transformer_config() -> None:
    from megatron_rl.models.builder import transformer_config

    moe = tiny_model("qwen3_moe")
    assert _on(fusion_fields(moe, CPU, routing_replay=False)) == set()
    assert _on(fusion_fields(moe, LOCAL_CUDA, routing_replay=False)) == {"bias_activation_fusion"}
    assert "local specs run here" in fusion_blockers(moe, LOCAL_CUDA, routing_replay=False)["moe_permute_fusion"]
    cpu = transformer_config(moe, layout())
    assert not any(getattr(cpu, name) for name in FUSIONS)  # what the CPU always ran: equality tests unchanged
    cuda = transformer_config(moe, layout(), platform=LOCAL_CUDA)  # constructible without TE: Megatron's own kernel
    assert _on({name: getattr(cuda, name) for name in FUSIONS}) == {"bias_activation_fusion"}
    forced_off = dataclasses.replace(moe, fusions=FusionConfig(apply_rope_fusion=False, moe_permute_fusion=False))
    assert _on(fusion_fields(forced_off, TE_CUDA, routing_replay=False)) == set(FUSIONS) - {
        "apply_rope_fusion",
        "moe_permute_fusion",
    }


@pytest.mark.parametrize(
    ("name", "platform", "culprit"),
    [
        ("apply_rope_fusion", CPU, "needs Transformer Engine's specs"),
        ("bias_activation_fusion", CPU, "needs CUDA"),
        ("moe_router_fusion", TE_CUDA, "bypasses Megatron's RouterReplay"),
    ],
)
def test_forcing_a_fusion_that_cannot_run_is_one_line(name: str, platform: Platform, culprit: str) -> None:
    model = dataclasses.replace(tiny_model("qwen3_moe"), fusions=FusionConfig(**{name: True}))
    with pytest.raises(ConfigError, match=f"model.fusions.{name} = true: .*{culprit}") as err:
        fusion_fields(model, platform, routing_replay=True)
    assert "\n" not in str(err.value)


def test_ddp_overlaps_with_nccl_and_the_distributed_optimizer() -> None:
    from megatron_rl.actor.optimizer import ddp_config

    def overlaps(backend: str, **fields: object) -> tuple[bool, bool]:
        ddp = ddp_config(dataclasses.replace(ParallelConfig(), **fields), backend)
        return ddp.overlap_grad_reduce, ddp.overlap_param_gather

    assert overlaps("nccl") == (True, True)
    assert overlaps("nccl", use_distributed_optimizer=False) == (True, False)  # no shards to gather
    assert overlaps("nccl", overlap_grad_reduce=False, overlap_param_gather=False) == (False, False)
    assert overlaps("gloo") == (False, False)
    assert overlaps("gloo", overlap_grad_reduce=True, overlap_param_gather=True) == (True, True)


def test_param_gather_without_the_distributed_optimizer_is_refused() -> None:
    from megatron_rl.config import check_rules

    cfg = Config(
        parallel=dataclasses.replace(ParallelConfig(), overlap_param_gather=True, use_distributed_optimizer=False)
    )
    with pytest.raises(ConfigError, match="parallel.overlap_param_gather = true needs parallel.use_distributed_opt"):
        check_rules(cfg)


def _update(parallel: ParallelConfig, fused_adam: bool) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    from megatron_rl.actor.optimizer import fuse_adam

    cfg = Config(
        model=tiny_model("qwen3_moe"),
        parallel=parallel,
        rollout=RolloutConfig(temperature=0.7, max_new_tokens=24),
        algorithm=preset("grpo"),
        train=TrainConfig(updates_per_step=2, max_tokens_per_micro_batch=24, lr=3e-3, adam_eps=1e-3),
    )
    with actor_of_one(cfg) as actor:
        if fused_adam:
            assert fuse_adam(actor.state.optimizer) > 0
        batch = seeded_batch(cfg.model.vocab_size, (22, 7, 15, 11, 19, 9), (5, 3, 6, 2, 4, 3))
        old = actor.compute_log_probs(batch).log_probs
        gen = torch.Generator().manual_seed(3)
        history = actor.train(
            batch.with_fields(old_log_probs=[x + 0.2 * torch.randn(x.shape, generator=gen) for x in old])
        )
        return history[-1], actor.full_params()


def test_overlapped_ddp_and_fused_adam_give_the_same_update(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three micro-batches per update, two updates: DDP's per-parameter hooks fire for every weight (the output
    layer's gradient, written into DDP's buffer by the log-prob head, through its placeholder), and torch's fused
    Adam kernel runs (counted)."""
    import torch.optim.adam as adam

    plain = _update(layout(), fused_adam=False)
    overlapped = _update(dataclasses.replace(layout(), overlap_grad_reduce=True, overlap_param_gather=True), False)
    calls = []
    fused = adam._fused_adam
    monkeypatch.setattr(adam, "_fused_adam", lambda *a, **k: calls.append(1) or fused(*a, **k))
    fused_run = _update(layout(), fused_adam=True)
    assert calls
    (want, params) = plain
    assert want["grad_norm"] > 1e-3
    for got, got_params in (overlapped, fused_run):
        for key in ("loss", "grad_norm"):
            assert abs(got[key] - want[key]) <= TOL * max(1.0, abs(want[key])), (key, got[key], want[key])
        worst = max((float((got_params[k] - params[k]).abs().max()), k) for k in params)
        assert worst[0] <= TOL, worst
