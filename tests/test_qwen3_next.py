"""Hybrid linear attention in one process: Qwen3-Next (`qwen3_next`) and Qwen3.5's text model (`qwen3_5_moe`).

config.json -> `model` and back, every refusal naming its field; the mapping's table against what transformers
writes and HF -> Megatron -> HF bit for bit (Qwen3-Next's per-key-head [q, k, v, z] and [b, a] rows, Qwen3.5's
separate projections, the gated q_proj); the Megatron model on one rank against transformers' on tiny random models
of 2 DeltaNet layers, a full one and a DeltaNet one, 70 tokens (two chunks of the delta rule): right-padded and
packed (the state and the convolution restarting at each sequence) equal, both equal transformers' within its own
float noise, and the export bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from presets import QWEN3_NEXT_80B
from safetensors.torch import load_file

from megatron_rl.config import ConfigError, LoraConfig
from megatron_rl.models.hf_config import ConversionError, hf_config_from_model, model_config_from_hf
from megatron_rl.models.hf_mapping import HFMapping
from megatron_rl.models.import_hf import open_hf_checkpoint

from mrl_configs import layout, megatron_names, save_random_hf_model, with_key
from mrl_replay import r2_record_and_replay, r3_replay_config

FAMILIES = ("qwen3_next", "qwen3_5_moe")
_LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
# Odd shapes: 2 key heads of 8 grouping 4 value heads of 6, a kernel of 3, GQA of 4 heads over 2 groups of 12 with
# half of each head rotated; 5 experts, top-2, a shared expert of 14; Qwen3-Next's first layer dense.
_TINY = dict(
    vocab_size=96, hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
    linear_conv_kernel_dim=3, num_experts=5, num_experts_per_tok=2, moe_intermediate_size=20,
    shared_expert_intermediate_size=14, layer_types=_LAYERS,
    rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5),
)  # fmt: skip


def _hf_config(family: str, **fields: Any) -> Any:
    if family == "qwen3_next":
        return transformers.Qwen3NextConfig(intermediate_size=40, mlp_only_layers=[0], **_TINY, **fields)
    return transformers.Qwen3_5MoeTextConfig(**_TINY, **fields)


def _model_of(folder: Path) -> Any:
    return model_config_from_hf(json.loads((folder / "config.json").read_text()), params_dtype="fp32")


def test_hub_config_and_its_layer_pattern() -> None:
    model = model_config_from_hf(QWEN3_NEXT_80B)
    linear = model.linear_attention
    assert (model.family, model.num_layers, model.num_experts, model.moe_shared_expert_size) == (
        "qwen3_next", 48, 512, 512
    )  # fmt: skip
    assert (linear.full_attention_interval, linear.num_key_heads, linear.num_value_heads, model.rotary_percent) == (
        4, 16, 32, 0.25
    )  # fmt: skip
    assert model_config_from_hf(hf_config_from_model(model)) == model
    from megatron_rl.models.builder import transformer_config

    config = transformer_config(model, layout(ep=8))
    assert config.linear_attention_freq[:8] == [1, 1, 1, 0, 1, 1, 1, 0] and config.attention_output_gate
    assert config.moe_shared_expert_gate and config.experimental_attention_variant == "gated_delta_net"
    from megatron_rl.models.families import parameter_counts

    dense, experts = parameter_counts(model)
    assert abs((dense + experts) / 1e9 - 79.7) < 0.5, (dense, experts)  # the published 80B (MTP not counted)


@pytest.mark.parametrize(
    ("path", "value", "needle"),
    [
        ("layer_types", ["linear_attention", "full_attention"] * 24, "full_attention_interval = 4 contradicts"),
        ("layer_types", ["full_attention", "linear_attention"] * 24, "every n-th layer full attention"),
        ("linear_num_value_heads", 24, "must be a multiple of model.linear_attention.num_key_heads (16)"),
        ("use_sliding_window", True, "use_sliding_window = true is not supported"),
        ("mlp_only_layers", [3], "only leading dense layers"),
        ("attention_bias", True, "attention_bias = true is not supported for qwen3_next"),
        ("partial_rotary_factor", 0.3, "is not an even number of rotated dimensions"),
        ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling.factor is not handled by the qwen3_next"),
        ("rope_scaling", {"rope_type": "linear"}, "rope_scaling rope_type = 'linear' is not supported"),
        ("rope_scaling", {"mrope_section": [8, 8]}, "rope_scaling.mrope_section = [8, 8] is not a list of 3"),
        ("linear_gate_norm", True, "linear_gate_norm is not handled by the qwen3_next mapping"),
        ("architectures", ["Qwen3_5MoeForConditionalGeneration"], "Qwen3.5's vision-language model"),
    ],
)
def test_refusals_name_the_field(path: str, value: Any, needle: str) -> None:
    with pytest.raises(ConversionError) as err:
        model_config_from_hf(with_key(QWEN3_NEXT_80B, path, value))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_settings_only_the_families_have() -> None:
    """The DeltaNet section belongs to these families; CP (no state passed over CP ranks), a TP size that does not
    divide the key heads, and LoRA (no adapters on DeltaNet's projections) are refused by name for them."""
    from megatron_rl.models.attention_choice import check_attention_backend
    from megatron_rl.models.families import check_family
    from megatron_rl.models.lora_targets import check_target_modules

    from mrl_configs import tiny_sigmoid_model

    other = tiny_sigmoid_model("deepseek_v3")
    linear = dataclasses.replace(other.linear_attention, full_attention_interval=2)
    with pytest.raises(ConfigError, match=r"has no model.linear_attention.full_attention_interval \(only qwen3_next"):
        check_family(dataclasses.replace(other, linear_attention=linear))
    model = model_config_from_hf(QWEN3_NEXT_80B)
    with pytest.raises(ConfigError, match="parallel.context_parallel_size = 2: model.family = 'qwen3_next' has Gat"):
        check_attention_backend(model, layout(cp=2), transformer_engine=False)
    with pytest.raises(
        ConfigError, match=r"tensor_model_parallel_size \(32\) must divide model.linear_attention.num_k"
    ):
        check_attention_backend(model, layout(tp=32), transformer_engine=False)  # 16 key heads, 32 value heads
    check_attention_backend(model, layout(tp=2, ep=8, pp=2), transformer_engine=False)
    with pytest.raises(ConfigError, match="LoRA is not available for model.family = 'qwen3_next'"):
        check_target_modules(dataclasses.replace(model, lora=LoraConfig(rank=4)))


@pytest.mark.parametrize("family", FAMILIES)
def test_config_round_trip_and_table_match_what_transformers_writes(tmp_path: Path, family: str) -> None:
    folder = save_random_hf_model(tmp_path / "hf", _hf_config(family), seed=3)
    model = _model_of(folder)
    assert model.linear_attention.full_attention_interval == 3 and model.first_k_dense_layers == (
        family == "qwen3_next"
    )
    assert model_config_from_hf(hf_config_from_model(model), params_dtype="fp32") == model
    mapping = HFMapping(model)
    original = load_file(folder / "model.safetensors")
    assert {n: tuple(t.shape) for n, t in original.items()} == mapping.checkpoint_shapes()
    ckpt = open_hf_checkpoint(str(folder), model)
    for name in megatron_names(mapping):
        hf_names = mapping.hf_names(name)
        shape = list(ckpt.shapes[hf_names[0]])
        shape[0] = sum(ckpt.shapes[n][0] for n in hf_names)
        if name.endswith(("word_embeddings.weight", "output_layer.weight")):
            shape[0] = 128  # Megatron's padded vocabulary
        megatron = mapping.to_megatron(name, ckpt.read, shape)
        if name.endswith("self_attention.in_proj.weight"):  # [q, k, v, z, b, a]: Qwen3.5's rows in that order
            b_rows = megatron[2 * 16 + 2 * 24 : 2 * 16 + 2 * 24 + 4]
            split = "in_proj_b.weight" if family == "qwen3_5_moe" else "in_proj_ba.weight"
            head0 = ckpt.read(hf_names[0].replace("in_proj_qkvz.weight", split).replace("in_proj_qkv.weight", split))
            assert torch.equal(b_rows[:2], head0[:2])  # key head 0's value heads' b come first either way
        for hf_name, tensor in mapping.to_hf(name, megatron):
            assert torch.equal(ckpt.read(hf_name), tensor), hf_name


@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_forward_padded_and_packed_equals_transformers(tmp_path: Path, family: str) -> None:
    """One rank, local spec, fp32: two right-padded rows of 70 tokens (two chunks of 64) and the same two sequences
    (70 and 45 tokens) packed in one row give the same log-probs (the pack's DeltaNet state and convolution restart at
    the second sequence: without that its log-probs move by > 0.1); both are transformers' within 1e-5 or, where
    larger, twice its own float noise (its log-probs under a 1e-7 relative change of the embeddings: the chunked rule's
    exponent of the decay gate's cumulative sums and the per-head norm amplify an ulp of rounding ~1e2 fold,
    docs/training.md#hybrid-linear-attention-qwen3-next-qwen35); the export is the checkpoint bit for bit."""
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.export import save_hf_folder
    from megatron_rl.models.import_hf import load_hf_weights
    from megatron_rl.parallel import init_distributed

    from mrl_configs import launch_of_one
    from mrl_multiproc.model_helpers import forward_logits, pack_rows

    folder = save_random_hf_model(tmp_path / "hf", _hf_config(family), seed=3)
    model = _model_of(folder)
    ids = torch.randint(0, model.vocab_size, (2, 70), generator=torch.Generator().manual_seed(1))
    lengths = (70, 45)
    out = tmp_path / "out"
    out.mkdir()
    with launch_of_one():
        init_distributed(layout(), model)
        chunks = build_model(model, layout(), use_transformer_engine=False)
        load_hf_weights(chunks, model, open_hf_checkpoint(str(folder), model))
        logp = forward_logits(chunks, ids, model.vocab_size).log_softmax(-1)
        packed = forward_logits(chunks, ids, model.vocab_size, packed=lengths)[0].log_softmax(-1)
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        with torch.no_grad():  # the same pack as one sequence: no cu_seqlens
            unreset = chunks[0](pack_rows(ids, lengths)[None], positions, None)[0, :, : model.vocab_size]
        save_hf_folder(chunks, model, out, hf_config_from_model(model))
    assert (packed[:70] - logp[0]).abs().max() <= 1e-5
    assert (packed[70:] - logp[1, :45]).abs().max() <= 1e-5
    assert (unreset.float().log_softmax(-1)[70:] - logp[1, :45]).abs().max() > 0.1
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        embeds = reference.model.embed_tokens(ids)
        expected = reference(inputs_embeds=embeds).logits.float().log_softmax(-1)
        noisy = embeds * (1 + 1e-7 * torch.randn(embeds.shape, generator=torch.Generator().manual_seed(2)))
        noise = (reference(inputs_embeds=noisy).logits.float().log_softmax(-1) - expected).abs().max().item()
    gap = (logp - expected).abs().max().item()
    assert gap <= max(1e-5, 2 * noise) and noise < 1e-3, (gap, noise)
    original, exported = load_file(folder / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("family", FAMILIES)
def test_local_engine_serves_it_and_the_trainer_scores_its_tokens(tmp_path: Path, family: str) -> None:
    """The local engine serves the family through transformers (a recurrent state and convolution window per row for
    the DeltaNet layers), its weight-update names are the checkpoint's, its routed experts SGLang's layout; sequences
    of 10 to 22 tokens (a shared prompt among them): the engine's log-probs are transformers' plain forward's, and the
    trainer's (one rank) the engine's, right-padded, packed, recording the routing (R2: the engine's) and replaying
    it, and replaying the engine's (R3), within 1e-5 or twice transformers' own float noise (see the forward test);
    one RL step moves DeltaNet's weights. At rms_norm_eps 1e-3, which bounds the gated norm's part of that noise
    (docs/training.md#hybrid-linear-attention-qwen3-next-qwen35; Qwen3.5's engine, decoding token by token, is 7.3e-5
    from transformers' chunked forward at the default 1e-6; here 6e-6)."""
    import numpy as np

    from megatron_rl.actor.batch import ActorBatch
    from megatron_rl.actor.micro_batches import TokenBudget
    from megatron_rl.rollout.local.generator import Generator, GenRequest
    from megatron_rl.rollout.local.model import load_model
    from megatron_rl.rollout.local.weights import CheckpointLayout

    from mrl_configs import actor_log_probs, actor_of_one

    folder = save_random_hf_model(tmp_path / "hf", _hf_config(family, rms_norm_eps=1e-3), seed=3)
    served, info = load_model(str(folder))
    assert (info.linear_layers, info.conv_shape, info.state_shape) == ((0, 1, 3), (56, 3), (4, 8, 6))
    assert set(CheckpointLayout(served, info.family).targets) == set(load_file(folder / "model.safetensors"))
    gen = Generator(served, info, max_running=3, max_prefill_tokens=64, seed=5)
    prompts = ([5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17], [5, 6, 7, 8])
    reqs = [
        GenRequest(rid=str(i), input_ids=p, max_new_tokens=6 + 3 * i, return_logprob=True, return_routed_experts=True)
        for i, p in enumerate(prompts)
    ]
    for req in reqs:
        gen.add(req)
    while gen.has_work:
        gen.step()
    tokens = [torch.tensor(r.input_ids + r.output_ids) for r in reqs]
    assert [len(t) for t in tokens] == [10, 11, 19, 19]
    routed = [torch.from_numpy(np.concatenate(r.routed)) for r in reqs]
    reference = []
    with torch.no_grad():
        for prompt, ids in zip(prompts, tokens, strict=True):
            logits = served(ids[None]).logits[0].log_softmax(-1)
            reference.append(logits[len(prompt) - 1 : -1].gather(1, ids[len(prompt) :, None])[:, 0])
        embeds = served.model.embed_tokens(tokens[2][None])
        noisy = embeds * (1 + 1e-7 * torch.randn(embeds.shape, generator=torch.Generator().manual_seed(2)))
        noise = served(inputs_embeds=noisy).logits.log_softmax(-1) - served(inputs_embeds=embeds).logits.log_softmax(-1)
    tolerance = max(1e-5, 2 * noise.abs().max().item())
    assert all(e.shape == (len(t) - 1, 4, 2) for e, t in zip(routed, tokens, strict=True))
    cfg = r3_replay_config(folder)
    batch = ActorBatch(
        tokens=tokens, prompt_lengths=[len(p) for p in prompts], advantages=[torch.tensor(1.0) for _ in prompts]
    )
    engine = [torch.tensor(r.output_logprobs) for r in reqs]
    with actor_of_one(cfg) as actor:
        packed = actor_log_probs(actor, batch, TokenBudget(64, packed=True)).log_probs
        padded = actor_log_probs(actor, batch, TokenBudget(64)).log_probs
        first_moe = 1 if family == "qwen3_next" else 0  # Qwen3-Next's first layer dense: its rows unused
        recorded, r2 = r2_record_and_replay(actor, batch, routed, moe_layers=slice(first_moe, None))
        replayed = actor_log_probs(
            actor, batch.with_fields(routed_experts=routed), TokenBudget(40, packed=True), "replay"
        ).log_probs
        before = actor.full_params()
        actor.train(batch.with_fields(old_log_probs=padded, routed_experts=routed))
        after = actor.full_params()
    assert not torch.equal(before["decoder.layers.0.self_attention.in_proj.weight"], after[
        "decoder.layers.0.self_attention.in_proj.weight"])  # fmt: skip
    gaps = {
        (name, against): max((g - e).abs().max().item() for g, e in zip(got, want, strict=True))
        for name, got in (
            ("padded", padded),
            ("packed", packed),
            ("R2 record, packed", recorded),
            ("R2 replay, padded", r2),
            ("R3 replay, packed", replayed),
        )  # fmt: skip
        for against, want in (("engine", engine), ("transformers", reference))
    }
    gaps["engine", "transformers"] = max((g - e).abs().max().item() for g, e in zip(engine, reference, strict=True))
    assert max(gaps.values()) <= tolerance, (gaps, tolerance)
