"""Activation recompute (`model.recompute`, `model.recompute_modules`, `models.recompute_choice`) on one rank in this
process, fp32: one GRPO update, on the MoE policies replaying recorded routing (R2: an MoE layer recomputed reruns its
router in REPLAY_BACKWARD), with each module set the local specs recompute, against the same update without recompute on the
same weights: loss, gradient norm and every parameter after it within 1e-6. Then the refusals, each one line naming
the key."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from megatron_rl.config import Config, ConfigError, ModelConfig, RolloutConfig, TrainConfig, load_config, preset
from megatron_rl.models.recompute_choice import check_recompute, recompute_fields

from mrl_configs import actor_of_one, layout, seeded_batch, tiny_model, tiny_sigmoid_model

LENGTHS = (22, 7, 15, 11, 19, 9)
PROMPTS = (5, 3, 6, 2, 4, 3)
TOL = 1e-6  # relative to the largest value compared (at least 1)

# per model: the runs compared with the one without recompute (recompute, modules, attention backend)
RUNS = {  # full recompute: tests/test_actor_distributed.py (`recompute_replay` scenario)
    "gqa": [("selective", ["core_attn", "mlp", "moe"], "local"), ("selective", ["core_attn"], "sdpa")],
    "mla": [("selective", ["core_attn", "shared_experts", "moe"], "local")],
    "gemma": [("selective", ["core_attn", "mlp"], "local")],  # dense, Gemma's own layer (sandwich norms, soft-capping)
}
MODELS = {
    "gqa": lambda: tiny_model("qwen3_moe"),
    "mla": lambda: tiny_sigmoid_model("deepseek_v3", "split"),
    "gemma": lambda: tiny_model("gemma2", num_experts=None),
}


def _config(model: ModelConfig) -> Config:
    return Config(
        model=model,
        parallel=layout(),
        rollout=RolloutConfig(temperature=0.7, max_new_tokens=24),
        algorithm=dataclasses.replace(preset("grpo"), routing_replay="r2" if model.num_experts else "none"),
        train=TrainConfig(updates_per_step=1, max_tokens_per_micro_batch=48, lr=3e-3, adam_eps=1e-3, grad_clip=0.5),
    )


def _checkpointed(layers: list[torch.nn.Module]) -> set[str]:
    """The selective-recompute modules Megatron's layers were built to checkpoint."""
    flags = {
        "core_attn": lambda layer: layer.self_attention.checkpoint_core_attention,
        "mlp": lambda layer: layer.recompute_mlp,
        "moe": lambda layer: getattr(layer.mlp, "moe_layer_recompute", False),
        "shared_experts": lambda layer: getattr(layer.mlp, "shared_experts_recompute", False),
    }
    return {name for name, flag in flags.items() if any(flag(layer) for layer in layers)}


def _update(model: ModelConfig) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One update on old log-probs off the policy's own (so the ratio and clipping move): metrics, parameters."""
    with actor_of_one(_config(model)) as actor:
        layers = list(actor.chunks[0].decoder.layers)
        assert _checkpointed(layers) == (set(model.recompute_modules) if model.recompute == "selective" else set())
        assert (actor.chunks[0].config.recompute_granularity == "full") == (model.recompute == "full")
        batch = seeded_batch(model.vocab_size, LENGTHS, PROMPTS)
        recorded = actor.compute_log_probs(batch, record_routing=model.num_experts is not None)
        gen = torch.Generator().manual_seed(3)
        (metrics,) = actor.train(
            batch.with_fields(
                old_log_probs=[lp + 0.2 * torch.randn(lp.shape, generator=gen) for lp in recorded.log_probs],
                routed_experts=recorded.routed_experts,
            )
        )
        return metrics, actor.full_params()


@pytest.fixture(scope="module", params=sorted(MODELS))
def updates(request: pytest.FixtureRequest) -> Iterator[tuple[str, object, list]]:
    model = MODELS[request.param]()
    plain = _update(model)
    runs = [
        (run, _update(dataclasses.replace(model, recompute=run[0], recompute_modules=run[1], attention_backend=run[2])))
        for run in RUNS[request.param]
    ]
    yield request.param, plain, runs


def test_recompute_changes_no_update(updates: tuple[str, object, list]) -> None:
    _, (want, params), runs = updates
    assert want["grad_norm"] > 1e-3
    for run, (got, got_params) in runs:
        for key in ("loss", "grad_norm"):
            assert abs(got[key] - want[key]) <= TOL * max(1.0, abs(want[key])), (run, key, got[key], want[key])
        assert got_params.keys() == params.keys()
        worst = max((float((got_params[k] - params[k]).abs().max()), k) for k in params)
        assert worst[0] <= TOL, (run, worst)


def test_the_fields_megatron_gets() -> None:
    model = tiny_model("qwen3_moe")
    assert recompute_fields(model) == {}
    full = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    assert recompute_fields(dataclasses.replace(model, recompute=True)) == full
    assert recompute_fields(dataclasses.replace(model, recompute="full")) == full
    selective = dataclasses.replace(model, recompute="selective", recompute_modules=["moe", "core_attn", "moe"])
    assert recompute_fields(selective) == dict(
        recompute_granularity="selective", recompute_modules=["moe", "core_attn"]
    )
    moe_act = dataclasses.replace(model, recompute="selective", recompute_modules=["moe_act"])
    assert recompute_fields(moe_act, transformer_engine=True, te_grouped_experts=True)["recompute_modules"] == [
        "moe_act"
    ]
    norms = dataclasses.replace(model, recompute="selective", recompute_modules=["layernorm"])
    assert recompute_fields(norms, transformer_engine=True)["recompute_modules"] == ["layernorm"]


def test_the_keys_take_their_values() -> None:
    cfg = load_config(overrides=["model.recompute=selective", "model.recompute_modules=[core_attn,moe]"])
    assert cfg.model.recompute == "selective" and list(cfg.model.recompute_modules) == ["core_attn", "moe"]
    assert load_config(overrides=[]).model.recompute is False
    assert load_config(overrides=["model.recompute=true"]).model.recompute is True
    with pytest.raises(ConfigError, match="model.recompute"):
        load_config(overrides=["model.recompute=partial"])


@pytest.mark.parametrize(
    ("model", "modules", "culprit"),
    [
        ("gqa", ["moe_act"], "moe_act cannot be recomputed here: only Transformer Engine's grouped experts"),
        ("gqa", ["layernorm"], "layernorm cannot be recomputed here: .*needs Transformer Engine"),
        ("gqa", ["shared_experts"], "shared_experts cannot be recomputed here: the MoE layers have no shared expert"),
        ("gqa", ["mla_up_proj"], "mla_up_proj cannot be recomputed here: model.family = 'qwen3_moe' has no multi"),
        ("gqa", ["attention"], r"unknown \['attention'\]; allowed: core_attn"),
        ("gqa", [], r"model.recompute_modules = \[\] with model.recompute = selective recomputes nothing"),
        ("dense", ["moe"], "moe cannot be recomputed here: the model is dense"),
        ("all_moe", ["mlp"], "mlp cannot be recomputed here: every layer is an MoE layer"),
    ],
)
def test_modules_the_local_specs_cannot_recompute_are_refused(model: str, modules: list, culprit: str) -> None:
    base = {
        "gqa": tiny_model("qwen3_moe"),
        "dense": tiny_model("qwen3", num_experts=None),
        "all_moe": tiny_model("qwen3_moe", first_k_dense_layers=0),
    }[model]
    cfg = dataclasses.replace(base, recompute="selective", recompute_modules=modules)
    with pytest.raises(ConfigError, match=f"model.recompute_modules{'' if modules == [] else ':'}") as err:
        check_recompute(cfg)
    if modules == ["moe_act"]:  # Transformer Engine's specs with the loop of experts: still refused
        with pytest.raises(ConfigError, match="only Transformer Engine's grouped experts recompute"):
            check_recompute(cfg, transformer_engine=True)
        check_recompute(cfg, transformer_engine=True, te_grouped_experts=True)
    assert "\n" not in str(err.value)
    assert err.match(culprit)
