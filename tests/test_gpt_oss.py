"""gpt-oss in one process: its config.json (the Hub's spelling and transformers 5's) -> `model` and
TransformerConfig, every refusal naming its field (the MXFP4 release's quantization_config among them), the way
back; the name/shape table against what `transformers` writes; HF -> Megatron -> HF bit for bit through the
exporter (the stacked, transposed, interleaved experts); and the Megatron model on one rank against transformers'
GptOss: fp32 log-probs within 1e-5, right-padded and packed, on a tiny random model with non-default options
(attention sinks that weigh, a sliding window of 5 in 2 of 4 layers, shorter than the sequences, yarn RoPE not
rounded, biased top-3 routing of 6 biased experts, a SwiGLU clamped at 1 with gain 1.3); the local engine serving
it, with R3 replaying its routing."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file

from megatron_rl.config import ConfigError, LoraConfig, ParallelConfig
from megatron_rl.models.builder import GatedSigmoid, transformer_config
from megatron_rl.models.hf_config import ConversionError, hf_config_from_model, model_config_from_hf
from megatron_rl.models.hf_mapping import HFMapping
from megatron_rl.models.import_hf import open_hf_checkpoint

from mrl_configs import (
    actor_log_probs,
    hf_config,
    layout,
    megatron_names,
    save_random_hf_model,
    tiny_gpt_oss_model,
    with_key,
)
from mrl_replay import r2_record_and_replay, r3_replay_config

# openai/gpt-oss-120b's config.json without its quantization_config (the MXFP4 release; a bf16 copy's keys).
GPT_OSS_120B: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 18, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "num_local_experts": 128, "output_router_logits": False, "pad_token_id": 199999,
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
    "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False}, "rope_theta": 150000,
    "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
    "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088, "torch_dtype": "bfloat16",
}  # fmt: skip


def _tiny_folder(folder: Path) -> Path:
    return save_random_hf_model(folder, hf_config("gpt_oss"), seed=3)


MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}


def test_hub_config() -> None:
    m = model_config_from_hf(GPT_OSS_120B)
    assert (m.family, m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.kv_channels) == (
        "gpt_oss", 36, 2880, 64, 8, 64
    )  # fmt: skip
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.add_qkv_bias, m.qk_layernorm) == (
        128, 4, 2880, True, False
    )  # fmt: skip
    assert (m.sliding_window, m.sliding_window_pattern, m.swiglu_alpha, m.swiglu_limit) == (128, 2, 1.702, 7.0)
    assert (m.rope_scaling, m.rope_theta, m.yarn_factor, m.yarn_original_max_position_embeddings) == (
        "yarn", 150000.0, 32.0, 4096
    )  # fmt: skip
    assert not m.yarn_truncate and m.params_dtype == "bf16"
    config = transformer_config(m, ParallelConfig(expert_model_parallel_size=8, expert_tensor_parallel_size=1))
    assert (config.softmax_type, config.window_size, config.window_attn_skip_freq) == ("learnable", (127, 0), 2)
    assert (config.add_bias_linear, config.glu_linear_offset, config.activation_func_clamp_value) == (True, 1.0, 7.0)
    assert config.activation_func == GatedSigmoid(1.702) and not config.moe_router_pre_softmax
    assert (config.yarn_rotary_scaling_factor, config.yarn_correction_range_round_to_int) == (32.0, False)
    x = torch.tensor([-2.0, 0.5, 3.0])
    assert torch.equal(config.activation_func(x), x * torch.sigmoid(x * 1.702))


@pytest.mark.parametrize(
    ("path", "value", "needle"),
    [
        ("quantization_config", MXFP4, "quantization_config (quant_method 'mxfp4') is not supported"),
        ("attention_bias", False, "attention_bias = false is not supported"),
        ("layer_types", ["full_attention", "sliding_attention"] * 18, "layer_types = ['full_attention', 'sliding"),
        ("layer_types", ["sliding_attention"] * 35, "is not a list of 36 of"),
        ("rope_scaling.mscale", 1.0, "rope_scaling.mscale is not handled by the gpt_oss mapping"),
        ("rope_scaling.rope_type", "linear", "rope_scaling rope_type = 'linear' is not supported"),
        ("experts_per_token", 8, "experts_per_token = 8 contradicts num_experts_per_tok"),
        ("swiglu_limit", "7", "swiglu_limit = '7' is not a finite number"),
        ("sliding_window", 0, "sliding_window = 0 is not an integer >= 1"),
        ("sliding_window", None, "sliding_window = null with sliding layers in layer_types"),
        ("use_sliding_window", True, "use_sliding_window is not handled by the gpt_oss mapping"),
    ],
)
def test_refusals_name_the_field(path: str, value: Any, needle: str) -> None:
    with pytest.raises(ConversionError) as err:
        model_config_from_hf(with_key(GPT_OSS_120B, path, value))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_layer_patterns_and_refused_settings() -> None:
    """Every third layer full, every layer sliding, none; what only gpt-oss has is refused for other families, and
    what the local specs cannot run for gpt-oss (SDPA, context parallelism, grouped or expert-TP-split experts)."""
    from megatron_rl.models.attention_choice import check_attention_backend
    from megatron_rl.models.experts_choice import check_grouped_experts
    from megatron_rl.models.families import check_family
    from megatron_rl.models.lora_targets import check_target_modules

    from mrl_configs import tiny_model

    third = ["sliding_attention", "sliding_attention", "full_attention"] * 12
    m = model_config_from_hf(with_key(GPT_OSS_120B, "layer_types", third))
    assert (m.sliding_window, m.sliding_window_pattern) == (128, 3)
    assert hf_config_from_model(m)["layer_types"] == third
    every = model_config_from_hf(with_key(GPT_OSS_120B, "layer_types", ["sliding_attention"] * 36))
    assert every.sliding_window_pattern == 37
    assert hf_config_from_model(every)["layer_types"] == ["sliding_attention"] * 36
    full = model_config_from_hf(with_key(GPT_OSS_120B, "layer_types", ["full_attention"] * 36))
    assert full.sliding_window is None and set(hf_config_from_model(full)["layer_types"]) == {"full_attention"}
    for key, value in (("sliding_window", 4), ("swiglu_alpha", 1.702), ("swiglu_limit", 7.0)):
        with pytest.raises(ConfigError, match=rf"'mixtral' has no model.{key} \(only gpt_oss"):
            check_family(tiny_model("mixtral", **{key: value}))
    gpt_oss = tiny_gpt_oss_model()
    refusals = [
        (dict(model=dataclasses.replace(gpt_oss, attention_backend="sdpa"), parallel=layout()), "sdpa"),
        (dict(model=gpt_oss, parallel=layout(cp=2)), "parallel.context_parallel_size = 2"),
    ]
    for kwargs, needle in refusals:
        with pytest.raises(ConfigError, match="has attention sinks and sliding-window layers") as err:
            check_attention_backend(**kwargs, transformer_engine=False)
        assert needle in str(err.value)
    with pytest.raises(ConfigError, match=r"expert_tensor_parallel_size = 2 \(null means TP\)"):
        check_grouped_experts(gpt_oss, layout(tp=2), transformer_engine=False)
    grouped = dataclasses.replace(gpt_oss, moe_grouped_gemm=True)
    for te in (False, True):
        with pytest.raises(ConfigError, match="the grouped experts take no biases"):
            check_grouped_experts(grouped, layout(tp=2, etp=1), transformer_engine=te)
    lora = dataclasses.replace(gpt_oss, lora=LoraConfig(rank=4))
    with pytest.raises(ConfigError, match="LoRA is not available for model.family = 'gpt_oss'"):
        check_target_modules(lora)


def test_config_round_trip_and_table_match_what_transformers_writes(tmp_path: Path) -> None:
    """transformers 5's config.json (rope_parameters) gives the model and comes back; save_pretrained's names and
    shapes (the stacked experts) are the mapping's table; every per-expert slice converts to Megatron and back bit
    for bit."""
    folder = _tiny_folder(tmp_path / "hf")
    saved = json.loads((folder / "config.json").read_text())
    model = model_config_from_hf(saved, params_dtype="fp32")
    assert model == tiny_gpt_oss_model()
    assert model_config_from_hf(hf_config_from_model(model)) == model
    again = transformers.GptOssConfig(**{k: v for k, v in hf_config_from_model(model).items() if k != "model_type"})
    assert again.layer_types == saved["layer_types"] and again.rope_parameters == saved["rope_parameters"]
    mapping = HFMapping(model)
    original = load_file(folder / "model.safetensors")
    assert {n: tuple(t.shape) for n, t in original.items()} == mapping.checkpoint_shapes()
    assert mapping.checkpoint_shapes()["model.layers.1.mlp.experts.gate_up_proj"] == (6, 48, 40)
    ckpt = open_hf_checkpoint(str(folder), model)
    assert ckpt.shapes == mapping.expected_hf_shapes()
    fc1 = mapping.to_megatron("decoder.layers.1.mlp.experts.local_experts.4.linear_fc1.weight", ckpt.read, (40, 48))
    stored = original["model.layers.1.mlp.experts.gate_up_proj"][4]  # [hidden, gate 0, up 0, gate 1, ...]
    assert torch.equal(fc1[:20], stored[:, 0::2].T) and torch.equal(fc1[20:], stored[:, 1::2].T)
    for name in megatron_names(mapping):
        hf_names = mapping.hf_names(name)
        shape = list(ckpt.shapes[hf_names[0]])
        if mapping._match(name)[0].kind in ("transpose", "interleaved_t"):
            shape = shape[::-1]
        elif len(hf_names) > 1:
            shape[0] = sum(ckpt.shapes[n][0] for n in hf_names)
        if name.endswith(("word_embeddings.weight", "output_layer.weight")):
            shape[0] = 384  # Megatron's padded vocabulary
        for hf_name, tensor in mapping.to_hf(name, mapping.to_megatron(name, ckpt.read, shape)):
            assert torch.equal(ckpt.read(hf_name), tensor), hf_name


def _hf_variant(folder: Path, **config: Any) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", **config).eval()


def test_megatron_forward_equals_transformers_and_exports_the_checkpoint(tmp_path: Path) -> None:
    """One rank, local spec, fp32, right-padded rows: log-probs within 1e-5 of transformers' eager GptOss, which
    changes by far more without the window, the sinks' values or the clamp (each does matter); the exporter writes
    the checkpoint back bit for bit (the experts stacked again)."""
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.export import save_hf_folder
    from megatron_rl.models.import_hf import load_hf_weights
    from megatron_rl.parallel import init_distributed

    from mrl_configs import launch_of_one
    from mrl_multiproc.model_helpers import forward_logits

    folder = _tiny_folder(tmp_path / "hf")
    model = model_config_from_hf(json.loads((folder / "config.json").read_text()), params_dtype="fp32")
    ids = torch.randint(0, model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    out = tmp_path / "out"
    out.mkdir()
    with launch_of_one():
        init_distributed(layout(), model)
        chunks = build_model(model, layout(), use_transformer_engine=False)
        load_hf_weights(chunks, model, open_hf_checkpoint(str(folder), model))
        logp = forward_logits(chunks, ids, model.vocab_size).log_softmax(-1)
        save_hf_folder(chunks, model, out, hf_config_from_model(model))
    original, exported = load_file(folder / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    with torch.no_grad():
        expected = _hf_variant(folder)(input_ids=ids).logits.log_softmax(-1)
        gap = (logp - expected).abs().max().item()
        assert gap <= 1e-5, gap
        sinkless = _hf_variant(folder)
        for layer in sinkless.model.layers:
            layer.self_attn.sinks.zero_()
        variants = {
            "no window": _hf_variant(folder, sliding_window=64),
            "sinks at 0": sinkless,
            "no clamp": _hf_variant(folder, swiglu_limit=100.0),
            "silu gate": _hf_variant(folder, swiglu_alpha=1.0),
        }
        for what, variant in variants.items():
            moved = (variant(input_ids=ids).logits.log_softmax(-1) - expected).abs().max().item()
            assert moved > 1e-2, (what, moved)


def test_local_engine_serves_it_and_packed_r3_equals_transformers(tmp_path: Path) -> None:
    """The local engine loads gpt-oss through transformers (eager attention, a mask per layer type), its
    weight-update names are the checkpoint's (the stacked experts), and the routed experts it returns (SGLang's
    layout [tokens - 1, layers, top_k]) are its routers' own choice. Sequences of 10 to 18 tokens (the window is 5):
    the trainer (one rank, the actor loading the folder) gives the sampled tokens the engine's log-probs within 1e-5
    and transformers' (a plain forward of each sequence) within 1e-5, right-padded on its own routing, packed
    recording it (R2: the routing recorded is the engine's) and replaying the recorded (right-padded) and the
    engine's (R3, packed); replaying other experts moves them by far more."""

    import numpy as np

    from megatron_rl.actor.batch import ActorBatch
    from megatron_rl.actor.micro_batches import TokenBudget
    from megatron_rl.rollout.local.generator import Generator, GenRequest
    from megatron_rl.rollout.local.model import load_model
    from megatron_rl.rollout.local.weights import CheckpointLayout

    from mrl_configs import actor_of_one

    folder = _tiny_folder(tmp_path / "hf")
    served, info = load_model(str(folder))
    assert (info.family, info.moe_layers, info.num_experts, info.top_k, info.sliding_window) == (
        "gpt_oss", (0, 1, 2, 3), 6, 3, 5
    )  # fmt: skip
    assert set(CheckpointLayout(served, info.family).targets) == set(load_file(folder / "model.safetensors"))
    gen = Generator(served, info, max_running=3, max_prefill_tokens=64, seed=5)
    prompts = ([5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16])
    reqs = [
        GenRequest(rid=str(i), input_ids=p, max_new_tokens=6 + 3 * i, temperature=1.0, top_p=1.0, top_k=-1,
                   return_logprob=True, return_routed_experts=True)
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    for req in reqs:
        gen.add(req)
    while gen.has_work:
        gen.step()
    tokens = [torch.tensor(r.input_ids + r.output_ids) for r in reqs]
    assert [len(t) for t in tokens] == [10, 11, 18]
    routed = [torch.from_numpy(np.concatenate(r.routed)) for r in reqs]
    reference, chosen = [], []
    layers = served.model.layers
    hooks = [layer.mlp.router.register_forward_hook(lambda m, a, o: chosen.append(o[2])) for layer in layers]
    for prompt, ids, experts in zip(prompts, tokens, routed, strict=True):
        chosen.clear()
        with torch.no_grad():
            logits = served(ids[None]).logits[0].log_softmax(-1)
        reference.append(logits[len(prompt) - 1 : -1].gather(1, ids[len(prompt) :, None])[:, 0])
        assert experts.shape == (len(ids) - 1, 4, 3)
        for layer in range(4):
            assert torch.equal(experts[:, layer].sort(-1).values, chosen[layer][:-1].sort(-1).values), layer
    for hook in hooks:
        hook.remove()
    cfg = r3_replay_config(folder)
    batch = ActorBatch(
        tokens=tokens, prompt_lengths=[len(p) for p in prompts], advantages=[torch.tensor(1.0) for _ in prompts]
    )
    engine = [torch.tensor(r.output_logprobs) for r in reqs]
    with actor_of_one(cfg) as actor:
        own = actor_log_probs(actor, batch, TokenBudget(64)).log_probs
        recorded, r2 = r2_record_and_replay(actor, batch, routed)
        replayed = actor_log_probs(
            actor, batch.with_fields(routed_experts=routed), TokenBudget(40, packed=True), "replay"
        )
        shifted = [(r + 1) % 6 for r in routed]
        other = actor_log_probs(actor, batch.with_fields(routed_experts=shifted), TokenBudget(64), "replay").log_probs
    runs = (("own routing, padded", own), ("R2 record, packed", recorded), ("R2 replay, padded", r2),
            ("R3 replay, packed", replayed.log_probs))  # fmt: skip
    for name, got in runs:
        for against, want in (("engine", engine), ("transformers", reference)):
            gap = max((g - e).abs().max().item() for g, e in zip(got, want, strict=True))
            assert gap <= 1e-5, (name, against, gap)
    assert max((g - e).abs().max().item() for g, e in zip(other, engine, strict=True)) > 1e-2
