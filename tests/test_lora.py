"""LoRA on the actor, in this process (a world of one): the tiny MoE policy of the multi-process
scenarios with adapters on every family module (attention q/k/v/o, the dense first layer's MLP and the
routed experts).

Hand-checkable numbers: with B = 0 (PEFT's start) the model is the base bit for bit; the merged weight
of every HF tensor is W + (alpha / r) B A with PEFT's A and B; only the adapters train; the trainable
count is r (in + out) summed over the adapted modules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.config import Config, LoraConfig, RolloutConfig, TrainConfig, preset

from mrl_configs import actor_of_one, layout, seeded_batch, tiny_model

RANK, ALPHA = 4, 8.0
LENGTHS = (12, 7, 15, 9)
PROMPTS = (5, 3, 6, 2)


def _config() -> Config:
    model = dataclasses.replace(tiny_model("qwen3_moe"), lora=LoraConfig(rank=RANK, alpha=ALPHA))
    return Config(
        model=model,
        parallel=layout(),
        rollout=RolloutConfig(temperature=1.0, max_new_tokens=16),
        algorithm=preset("grpo"),
        train=TrainConfig(updates_per_step=1, max_tokens_per_micro_batch=64, lr=1e-2, seed=3),
    )


@pytest.fixture(scope="module")
def actor() -> Iterator[object]:
    with actor_of_one(_config()) as actor:
        yield actor


def _batch(vocab: int) -> ActorBatch:
    return seeded_batch(vocab, LENGTHS, PROMPTS)


def _random_adapters(actor, scale: float = 0.3) -> dict[str, torch.Tensor]:  # noqa: ANN001
    from megatron_rl.models.lora import gather_adapters

    gen = torch.Generator().manual_seed(7)
    return {k: scale * torch.randn(v.shape, generator=gen) for k, v in gather_adapters(actor.lora).items()}


def _log_probs(actor, batch: ActorBatch) -> list[torch.Tensor]:  # noqa: ANN001
    return actor.compute_log_probs(batch).log_probs


def test_b_zero_gives_the_base_and_the_reference_is_the_adapters_off(actor) -> None:  # noqa: ANN001
    from megatron_rl.models.lora import adapters_disabled, gather_adapters, load_adapters

    start = gather_adapters(actor.lora)
    b_keys = [k for k in start if k.endswith("lora_B.weight")]
    assert b_keys and all(start[k].abs().max() == 0 for k in b_keys)  # PEFT's start: B = 0
    a = start["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    assert a.shape == (RANK, 64) and 0 < a.abs().max() <= 1 / 8  # U(-1/sqrt(in), 1/sqrt(in)), in = 64
    batch = _batch(actor.cfg.model.vocab_size)
    with_adapters = _log_probs(actor, batch)
    with adapters_disabled(actor.lora):
        base = _log_probs(actor, batch)
    assert all(torch.equal(x, y) for x, y in zip(with_adapters, base, strict=True))
    try:
        load_adapters(actor.lora, _random_adapters(actor))
        changed = _log_probs(actor, batch)
        assert max((x - y).abs().max().item() for x, y in zip(changed, base, strict=True)) > 1e-2
        with adapters_disabled(actor.lora):
            again = _log_probs(actor, batch)
        assert all(torch.equal(x, y) for x, y in zip(again, base, strict=True))  # same module, adapters off
    finally:
        load_adapters(actor.lora, start)


def test_merged_weights_are_w_plus_scaled_b_a_and_restore_exactly(actor) -> None:  # noqa: ANN001
    from megatron_rl.models.export import export_hf_weights
    from megatron_rl.models.lora import gather_adapters, load_adapters, merged_weights

    start = gather_adapters(actor.lora)
    adapters = _random_adapters(actor)
    load_adapters(actor.lora, adapters)
    try:
        model = actor.cfg.model

        def hf() -> dict[str, torch.Tensor]:
            return {n: t.clone() for b in export_hf_weights(actor.chunks, model) for n, t in b}

        base = hf()
        batch = _batch(model.vocab_size)
        adapted = _log_probs(actor, batch)
        with merged_weights(actor.lora):
            merged = hf()
            merged_lp = _log_probs(actor, batch)
        assert all(torch.equal(base[n], t) for n, t in hf().items())  # restored bit for bit
        scale = ALPHA / RANK
        adapted_modules = 0
        for name, weight in base.items():
            module = name.removesuffix(".weight")
            key = f"base_model.model.{module}.lora_"
            if key + "A.weight" not in adapters:
                assert torch.equal(merged[name], weight), name
                continue
            adapted_modules += 1
            expected = weight + scale * adapters[key + "B.weight"] @ adapters[key + "A.weight"]
            torch.testing.assert_close(merged[name], expected, rtol=0, atol=1e-6)
        # 4 layers x q, k, v, o; the dense layer's gate, up, down; 3 MoE layers x 4 experts x 3
        assert adapted_modules == 4 * 4 + 3 + 3 * 4 * 3
        gap = max((x - y).abs().max().item() for x, y in zip(adapted, merged_lp, strict=True))
        assert gap < 1e-4, gap  # the merged base computes what base + adapters do
    finally:
        load_adapters(actor.lora, start)


def test_only_the_adapters_train_and_are_counted(actor) -> None:  # noqa: ANN001
    from megatron_rl.actor.adapters import count_trainable
    from megatron_rl.models.lora import gather_adapters, load_adapters

    model = actor.cfg.model
    h, f, m, heads, groups, d = 64, 96, 32, 4, 2, 16
    per_layer_attn = RANK * ((h + heads * d) + 2 * (h + groups * d) + (heads * d + h))
    dense_mlp = RANK * (2 * (h + f) + (f + h))
    experts = 3 * 4 * RANK * (2 * (h + m) + (m + h))
    expected = 4 * per_layer_attn + dense_mlp + experts
    assert count_trainable(actor.lora, actor.chunks, actor.cfg) == expected
    trainable = [p for c in actor.chunks for p in c.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == expected
    optimizer_params = [p for g in actor.state.optimizer.param_groups for p in g["params"]]
    assert sum(p.numel() for p in optimizer_params) == expected  # optimizer state for the adapters only
    start = gather_adapters(actor.lora)
    load_adapters(actor.lora, _random_adapters(actor, 0.05))
    try:
        before = actor.full_params()
        adapters_before = gather_adapters(actor.lora)
        batch = _batch(model.vocab_size)
        old = _log_probs(actor, batch)
        actor.train(batch.with_fields(old_log_probs=old))
        after = actor.full_params()
        assert all(torch.equal(before[n], after[n]) for n in before)  # the base is frozen
        moved = [k for k, v in gather_adapters(actor.lora).items() if not torch.equal(v, adapters_before[k])]
        assert len(moved) == len(adapters_before)  # every A and B got a step
    finally:
        load_adapters(actor.lora, start)


def test_the_kl_reference_is_the_base_without_a_second_copy(actor) -> None:  # noqa: ANN001
    """With adapters that change the policy, the reference's log-probs are those of a separately built
    frozen base (`FrozenPolicy`, the pre-LoRA reference), and it holds no parameters of its own."""
    from megatron_rl.actor.adapters import AdaptersOffReference, start_reference
    from megatron_rl.actor.policy import FrozenPolicy
    from megatron_rl.models.lora import gather_adapters, load_adapters

    reference = start_reference(actor.cfg, actor)
    assert isinstance(reference, AdaptersOffReference) and reference.actor is actor
    start = gather_adapters(actor.lora)
    load_adapters(actor.lora, _random_adapters(actor))
    frozen = FrozenPolicy.start(dataclasses.replace(actor.cfg, model=tiny_model("qwen3_moe")))
    try:
        batch = _batch(actor.cfg.model.vocab_size)
        ours = reference.compute_log_probs(batch).log_probs
        theirs = frozen.compute_log_probs(batch).log_probs
        assert all(torch.equal(x, y) for x, y in zip(ours, theirs, strict=True))
        policy = _log_probs(actor, batch)
        assert max((x - y).abs().max().item() for x, y in zip(policy, ours, strict=True)) > 1e-2
    finally:
        frozen.close()
        load_adapters(actor.lora, start)


def test_checkpoint_holds_the_adapters_and_their_optimizer_and_resumes_exactly(actor, tmp_path) -> None:  # noqa: ANN001
    """A LoRA checkpoint stores no base tensor; loading it and repeating an update gives the same adapters
    bit for bit; one of another base is refused."""
    from megatron.core import dist_checkpointing

    from megatron_rl.models.hf_config import ConversionError
    from megatron_rl.models.lora import gather_adapters, load_adapters

    start = gather_adapters(actor.lora)
    load_adapters(actor.lora, _random_adapters(actor, 0.05))
    try:
        batch = _batch(actor.cfg.model.vocab_size)
        old = _log_probs(actor, batch)
        actor.train(batch.with_fields(old_log_probs=old))  # Adam moments exist: they must be saved too
        actor.save(tmp_path / "ckpt")
        keys = set(dist_checkpointing.load_tensors_metadata(str(tmp_path / "ckpt")))
        model_keys = {k for k in keys if not k.startswith("optimizer.")}
        assert model_keys and all(k.startswith("lora.base_model.model.") for k in model_keys), sorted(model_keys)[:3]
        assert len(model_keys) == len(start)
        saved_base = actor.full_params()
        actor.train(batch.with_fields(old_log_probs=old))
        first = gather_adapters(actor.lora)
        load_adapters(actor.lora, start)  # anything: the checkpoint must bring the adapters back
        info = actor.load(tmp_path / "ckpt")
        assert info["optimizer_loaded"] and info["step"] == actor.step
        actor.train(batch.with_fields(old_log_probs=old))
        again = gather_adapters(actor.lora)
        assert all(torch.equal(first[k], again[k]) for k in first)  # resumed exactly
        assert all(torch.equal(saved_base[n], t) for n, t in actor.full_params().items())
        other = {**actor.lora_base, "base_sha256": "0" * 64}
        from megatron_rl.models.lora_checkpoint import load_adapter_weights

        with pytest.raises(ConversionError, match="the adapters were trained with base_sha256"):
            load_adapter_weights(actor.state.model, tmp_path / "ckpt", other)
        _check_another_alpha_and_no_lora_are_refused(actor, tmp_path / "ckpt")
    finally:
        load_adapters(actor.lora, start)


def _check_another_alpha_and_no_lora_are_refused(actor, ckpt) -> None:  # noqa: ANN001
    """Another alpha (a 4x scale of the learned update) is refused as another rank is; a run without
    LoRA is told the checkpoint holds adapters, not that a base tensor is missing; nothing is loaded."""
    from megatron_rl.actor.checkpoint import load_checkpoint
    from megatron_rl.models.hf_config import ConversionError
    from megatron_rl.models.lora import gather_adapters
    from megatron_rl.models.lora_checkpoint import load_adapter_weights

    before = gather_adapters(actor.lora)
    alpha = actor.lora_base["alpha"]
    with pytest.raises(ConversionError, match=rf"trained with alpha = {alpha!r} .*this run has {4 * alpha!r}"):
        load_adapter_weights(actor.state.model, ckpt, {**actor.lora_base, "alpha": 4 * alpha})
    rank, targets = actor.lora_base["rank"], actor.lora_base["target_modules"]
    with pytest.raises(ConversionError) as err:
        load_checkpoint(actor.state, ckpt, lora=None)
    assert str(err.value).startswith(f"{ckpt}: the checkpoint holds LoRA adapters (rank {rank}, alpha {alpha}, ")
    assert f"targets {targets}" in str(err.value) and "this run has none (model.lora.rank = 0)" in str(err.value)
    after = gather_adapters(actor.lora)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_adapter_sync_to_the_local_engine_without_peft_is_refused_and_auto_merges(monkeypatch) -> None:  # noqa: ANN001
    import importlib.metadata

    from megatron_rl.config import Config, ConfigError
    from megatron_rl.models import lora_targets

    model = dataclasses.replace(tiny_model("qwen3_moe"), lora=LoraConfig(rank=4, target_modules=["q_proj"]))
    lora_targets.check_local_engine_adapters(model)  # peft is installed here
    assert lora_targets.resolve_lora_sync(Config(model=model)).rollout.lora_sync == "adapter"
    version = importlib.metadata.version

    def without_peft(name: str) -> str:
        if name == "peft":
            raise importlib.metadata.PackageNotFoundError(name)
        return version(name)

    monkeypatch.setattr(importlib.metadata, "version", without_peft)
    with pytest.raises(ConfigError, match=r"peft, which is not installed .*megatron-rl\[lora\].*lora_sync = 'merged'"):
        lora_targets.check_local_engine_adapters(model)
    assert lora_targets.resolve_lora_sync(Config(model=model)).rollout.lora_sync == "merged"


def test_lora_on_a_family_without_adapter_targets_is_refused_naming_the_family() -> None:
    from megatron_rl.config import ConfigError
    from megatron_rl.models.lora_targets import check_target_modules

    model = dataclasses.replace(tiny_model("qwen3_moe"), family="deepseek_v3", lora=LoraConfig(rank=4))
    with pytest.raises(ConfigError, match=r"LoRA is not available for model.family = 'deepseek_v3' yet; families"):
        check_target_modules(model)
