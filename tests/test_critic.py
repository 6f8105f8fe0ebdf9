"""The critic's value model on one rank in this process, fp32: its per-token values equal those of transformers'
`AutoModelForTokenClassification` (num_labels = 1, verl's critic format) with the same weights within 1e-5, loaded
from such a folder (`critic.hf_path`) or built from the policy's causal-LM folder with a fresh seeded head; the
folders a value model cannot start from are refused in one line naming the key or the tensor. `MegatronCritic`, as
the trainer runs it: its values at the log-probs' target positions, padded and packed, the first update by hand, a
checkpoint round trip. (TP 2 with sequence parallelism and PP 2: tests/mrl_multiproc/model_scenarios.py's
`values_tp2_sp_pp2`; the critic's updates across layouts: tests/mrl_multiproc/scenarios_critic.py.)"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from megatron_rl.config import ConfigError, ModelConfig
from megatron_rl.models.hf_config import ConversionError, model_config_from_hf

from mrl_configs import hf_config, hf_config_json, launch_of_one, layout, seeded_batch, tiny_model

TOL = 1e-5
SEED = 7


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """O(1) activations (as tests/mrl_configs.py's save_random_hf_model), and a head far from 0."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        values = torch.randn(param.shape, generator=gen)
        if param.dim() == 1:
            values = 1.0 + 0.1 * values if name.endswith("norm.weight") else 0.5 * values
        else:
            values /= math.sqrt(param.shape[-1])
        param.copy_(values)


def _token_classifier(folder: Path, seed: int = 1, **overrides: object) -> Path:
    config = hf_config("qwen3_moe", "split", **{"num_labels": 1, **overrides})
    hf = transformers.AutoModelForTokenClassification.from_config(config)
    _randomize(hf, seed)
    hf.save_pretrained(folder)
    return folder


def _model() -> ModelConfig:
    return model_config_from_hf(hf_config_json("qwen3_moe"), params_dtype="fp32")


def _ids(model: ModelConfig) -> torch.Tensor:
    return torch.randint(0, model.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))


def _values(model: ModelConfig, hf_path: str | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The value model's [B, T] values of `_ids` and its head's parameters."""
    from megatron_rl.critic.value_model import build_value_model, value_initializer
    from megatron_rl.parallel import init_distributed

    initialize = value_initializer(model, SEED, hf_path=hf_path)  # headers checked before any process group
    ids = _ids(model)
    with launch_of_one():
        init_distributed(layout(), model)
        chunks = build_value_model(model, layout())
        initialize(chunks)
        chunks[0].eval()
        with torch.no_grad():
            positions = torch.arange(ids.shape[1]).expand_as(ids)
            values = chunks[0](ids, positions, None)
        head = {k: v.detach().clone() for k, v in chunks[0].output_layer.named_parameters()}
    assert values.shape == (*ids.shape, 1)
    return values[..., 0], head


def _hf_values(folder: Path, head: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    hf = transformers.AutoModelForTokenClassification.from_pretrained(
        folder, num_labels=1, attn_implementation="eager"
    ).float()
    if head is not None:
        with torch.no_grad():
            hf.score.weight.copy_(head["weight"])
            hf.score.bias.copy_(head["bias"])
    with torch.no_grad():
        return hf.eval()(input_ids=_ids(_model())).logits[..., 0]


def test_values_equal_transformers_token_classifier(tmp_path: Path) -> None:
    folder = _token_classifier(tmp_path / "critic")
    values, head = _values(_model(), str(folder))
    expected = _hf_values(folder)
    assert float(head["bias"].abs()) > 0.1  # the folder's score.bias was loaded, not left at 0
    assert float((values - expected).abs().max()) <= TOL
    assert float(expected.std()) > 0.1  # values that vary by token: a misplaced weight would show


def test_a_fresh_head_on_the_policy_backbone(tmp_path: Path) -> None:
    """From the policy's causal-LM folder: its backbone (lm_head not read), and a head from the seed alone
    with weights of scale 1/(H+1) and a zero bias; transformers with that backbone and head agree."""
    policy = tmp_path / "policy"
    torch.manual_seed(0)
    causal = transformers.AutoModelForCausalLM.from_config(hf_config("qwen3_moe", "split"))
    _randomize(causal, 3)
    causal.save_pretrained(policy)
    model = _model()
    values, head = _values(dataclasses.replace(model, hf_path=str(policy)), None)
    again = torch.randn(head["weight"].shape, generator=_seeded()) / (model.hidden_size + 1)
    assert torch.equal(head["weight"], again) and float(head["bias"]) == 0.0
    assert float((values - _hf_values(policy, head)).abs().max()) <= TOL


def _seeded() -> torch.Generator:
    from megatron_rl.models.init import seeded_generator

    return seeded_generator(SEED, "output_layer.weight")


def test_folders_a_value_model_cannot_start_from_are_refused(tmp_path: Path) -> None:
    from megatron_rl.critic.value_model import value_initializer

    model = _model()
    causal = tmp_path / "causal"
    transformers.AutoModelForCausalLM.from_config(hf_config("qwen3_moe", "split")).save_pretrained(causal)
    with pytest.raises(ConversionError, match=r"critic.hf_path\): architectures = \['Qwen3MoeForCausalLM'\]; a value"):
        value_initializer(model, SEED, hf_path=str(causal))
    two = _token_classifier(tmp_path / "two", num_labels=2)
    with pytest.raises(ConversionError, match=r"tensor 'score.weight' has shape \[2, 64\] .* expects \[1, 64\]"):
        value_initializer(model, SEED, hf_path=str(two))
    wide = _token_classifier(tmp_path / "wide", hidden_size=96)
    with pytest.raises(ConfigError, match=r"^model.hidden_size = 64, but .*wide/config.json \(critic.hf_path\)"):
        value_initializer(model, SEED, hf_path=str(wide))
    unbiased = _token_classifier(tmp_path / "unbiased")
    config = json.loads((unbiased / "config.json").read_text())
    (unbiased / "config.json").write_text(json.dumps({**config, "token_classification_bias": False}))
    with pytest.raises(ConversionError, match=r"unexpected tensor 'score.bias'"):
        value_initializer(model, SEED, hf_path=str(unbiased))


def test_the_critic_section_refuses_contradictions_naming_the_keys() -> None:
    from megatron_rl.config import load_config

    assert load_config(None, ["algorithm.name=ppo", "critic.hf_path=/some/critic"]).critic.enabled  # implied
    assert load_config(None, ["algorithm.name=ppo"]).critic.enabled  # gae implies the critic
    refused = {
        "critic.hf_path=/c critic.enabled=false": "critic.hf_path = '/c' is read only with critic.enabled = true, "
        "but critic.enabled = false",
        "critic.warmup_steps=2": "critic.warmup_steps = 2 trains the critic alone first, but critic.enabled = false",
        "algorithm.name=ppo critic.warmup_steps=5 train.steps=5": r"critic.warmup_steps \(5\) must be below "
        r"train.steps \(5\): the policy would never be updated",
        "critic.cliprange_value=0": r"critic.cliprange_value = 0.0 is out of range; allowed: float > 0",
    }
    for overrides, needle in refused.items():
        with pytest.raises(ConfigError, match=f"^{needle}") as err:
            load_config(None, overrides.split())
        assert "\n" not in str(err.value)


# ---- the critic as the trainer runs it (`MegatronCritic`): values, updates, checkpoints ----

LENGTHS, PROMPTS = (12, 7, 15, 9), (5, 3, 6, 2)


def _critic_config(**train: object) -> Any:
    from megatron_rl.config import Config, RolloutConfig, TrainConfig, preset
    from megatron_rl.config.critic import CriticConfig

    return Config(
        model=tiny_model("qwen3_moe"),
        parallel=layout(),
        rollout=RolloutConfig(temperature=1.0, max_new_tokens=16),
        algorithm=preset("ppo"),
        critic=CriticConfig(enabled=True, lr=1e-2, cliprange_value=0.2),
        train=TrainConfig(**{"updates_per_step": 2, "max_tokens_per_micro_batch": 24, "lr": 1e-3, "seed": 3, **train}),
    )


def _critic(cfg: Any) -> Any:
    from megatron_rl.critic.critic import MegatronCritic
    from megatron_rl.parallel import init_distributed

    init_distributed(cfg.parallel, cfg.model, seed=cfg.train.seed)
    return MegatronCritic(cfg)


def test_the_critic_reads_values_trains_and_resumes(tmp_path: Path) -> None:
    """Its values are the value model's at the log-probs' target positions (padded and packed micro-batches
    alike); the first update, with V_old the current values, is 0.5 x the squared error over its mini-batch with
    nothing clipped; packed updates equal padded ones; a checkpoint restores the values and the step."""
    from megatron_rl.critic.critic import critic_train_config

    batch = seeded_batch(_critic_config().model.vocab_size, LENGTHS, PROMPTS)
    returns = [torch.linspace(-1.0, 1.0, n - p) for n, p in zip(LENGTHS, PROMPTS, strict=True)]
    runs = {}
    with launch_of_one():
        for name, train in (("padded", {}), ("packed", {"micro_batch_tokens": 20})):
            critic = _critic(_critic_config(**train))
            values = critic.compute_values(batch)
            model = critic.chunks[0]
            with torch.no_grad():
                direct = [
                    model(t.view(1, -1), torch.arange(len(t)).view(1, -1), None)[0, p - 1 : len(t) - 1, 0]
                    for t, p in zip(batch.tokens, PROMPTS, strict=True)
                ]
            assert max(float((v - d).abs().max()) for v, d in zip(values, direct, strict=True)) <= TOL
            history = critic.train(batch.with_fields(old_values=values, returns=returns))
            runs[name] = (values, history, critic.compute_values(batch))
            if name == "padded":
                critic.save(tmp_path / "critic")
                resumed = _critic(_critic_config())
                assert resumed.load(tmp_path / "critic")["optimizer_loaded"] and resumed.step == critic.step == 2
                assert all(torch.equal(a, b) for a, b in zip(resumed.compute_values(batch), runs[name][2], strict=True))
            from megatron_rl.parallel import destroy_distributed

            destroy_distributed(process_group=False)
    values, history, after = runs["padded"]
    first = [0, 1]  # the first mini-batch: samples 0 and 1 (consecutive, as the actor's)
    errors = torch.cat([values[i] - returns[i] for i in first])
    assert history[0]["vf_loss"] == pytest.approx(0.5 * float((errors**2).mean()), rel=1e-5)
    assert history[0]["vf_clipfrac"] == 0.0 and history[0]["lr"] == pytest.approx(1e-2)
    assert history[0]["vpred_mean"] == pytest.approx(float(torch.cat([values[i] for i in first]).mean()), abs=1e-6)
    before = sum(float(((v - r) ** 2).sum()) for v, r in zip(values, returns, strict=True))
    assert sum(float(((v - r) ** 2).sum()) for v, r in zip(after, returns, strict=True)) < before  # it learned
    packed_values, packed_history, packed_after = runs["packed"]
    assert max(float((a - b).abs().max()) for a, b in zip(packed_values, values, strict=True)) <= TOL
    for got, want in zip(packed_history, history, strict=True):
        for key in ("vf_loss", "vf_clipfrac", "vpred_mean", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    # the critic's schedule is the actor's at critic.lr, its floor scaled alike
    scaled = critic_train_config(_critic_config(min_lr=1e-4))
    assert (scaled.lr, scaled.min_lr) == (1e-2, pytest.approx(1e-3))
