"""Gemma 2 and Gemma 3 (text) in one process: published config.json files (the Hub's spellings and transformers
5's) -> `model` and TransformerConfig, parameter counts against transformers' own, every refusal naming its
field; the way back through transformers and the name/shape table against what it writes; on one rank, HF ->
Megatron log-probs equal transformers' eager ones (fp32, <= 1e-5) and Megatron -> HF gives every tensor back bit
for bit, on tiny random models where each Gemma switch moves the log-probs by far more (a window of 5 in the
sliding layers, shorter than the sequences; query_pre_attn_scalar unlike head_dim; Gemma 2's soft-capping that
bites; Gemma 3's sliding layers' own RoPE base and linear scaling of the full layers); the local engine serving
them (a mask per layer type, Gemma 2's eager attention, the final soft-capping), and the actor's log-probs,
right-padded and packed, equal to the engine's and to transformers'. (TP2 and PP2: tests/test_convert_distributed.py.)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from megatron_rl.config import ConfigError, ParallelConfig
from megatron_rl.models.hf_config import ConversionError, hf_config_from_model, model_config_from_hf

from mrl_configs import GEMMA_FAMILIES, actor_log_probs, hf_config, layout, save_random_hf_model, with_key

_BOOKKEEPING = {"attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True, "torch_dtype": "bfloat16",
                "bos_token_id": 2, "pad_token_id": 0, "cache_implementation": "hybrid"}  # fmt: skip
GEMMA2_2B: dict[str, Any] = {
    **_BOOKKEEPING, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attention_bias": False,
    "attn_logit_softcapping": 50.0, "eos_token_id": [1, 107], "final_logit_softcapping": 30.0, "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304,
    "intermediate_size": 9216, "max_position_embeddings": 8192, "num_attention_heads": 8, "num_hidden_layers": 26,
    "num_key_value_heads": 4, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
    "sliding_window": 4096, "transformers_version": "4.42.4", "vocab_size": 256000,
}  # fmt: skip
GEMMA2_27B: dict[str, Any] = {
    **GEMMA2_2B, "hidden_size": 4608, "intermediate_size": 36864, "num_attention_heads": 32, "num_hidden_layers": 46,
    "num_key_value_heads": 16, "head_dim": 128, "query_pre_attn_scalar": 144,
}  # fmt: skip
GEMMA3_1B: dict[str, Any] = {
    **_BOOKKEEPING, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
    "attn_logit_softcapping": None, "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
    "max_position_embeddings": 32768, "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6, "transformers_version": "4.50.0.dev0",
    "vocab_size": 262144,
}  # fmt: skip
# gemma-3-27b's text_config as a Gemma3ForCausalLM: linear RoPE scaling on the full layers, another scalar.
GEMMA3_27B_TEXT: dict[str, Any] = {
    **GEMMA3_1B, "hidden_size": 5376, "intermediate_size": 21504, "num_attention_heads": 32, "num_hidden_layers": 62,
    "num_key_value_heads": 16, "head_dim": 128, "query_pre_attn_scalar": 168, "sliding_window": 1024,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "max_position_embeddings": 131072, "vocab_size": 262208,
}  # fmt: skip
# gemma-3-270m: transformers 4.55's spelling (layer_types, _sliding_window_pattern, use_bidirectional_attention).
GEMMA3_270M: dict[str, Any] = {
    **{k: v for k, v in GEMMA3_1B.items() if k != "sliding_window_pattern"}, "_sliding_window_pattern": 6,
    "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3, "use_bidirectional_attention": False,
}  # fmt: skip


def test_published_configs_and_transformer_configs() -> None:
    from megatron_rl.models.builder import transformer_config
    from megatron_rl.models.gemma import gelu_tanh

    g2 = model_config_from_hf(GEMMA2_27B)
    assert (g2.family, g2.num_layers, g2.hidden_size, g2.num_attention_heads, g2.num_query_groups, g2.kv_channels) == (
        "gemma2", 46, 4608, 32, 16, 128
    )  # fmt: skip
    assert (g2.query_pre_attn_scalar, g2.attn_logit_softcapping, g2.final_logit_softcapping) == (144, 50.0, 30.0)
    assert (g2.sliding_window, g2.sliding_window_pattern, g2.rope_theta, g2.tie_word_embeddings) == (4096, 2, 1e4, True)
    assert (g2.qk_layernorm, g2.rope_local_theta, g2.rope_scaling, g2.params_dtype) == (False, None, "none", "bf16")
    config = transformer_config(g2, ParallelConfig(tensor_model_parallel_size=8))
    assert (config.window_size, config.window_attn_skip_freq, config.activation_func) == ((4095, 0), 2, gelu_tanh)
    assert config.softmax_scale == 144**-0.5 and config.gated_linear_unit
    x = torch.tensor([-3.0, -0.5, 0.7, 2.0])
    assert torch.equal(
        config.activation_func(x), 0.5 * x * (1 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x**3)))
    )
    one = model_config_from_hf(GEMMA3_1B)
    assert (one.family, one.kv_channels, one.num_query_groups, one.qk_layernorm) == ("gemma3_text", 256, 1, True)
    assert (one.rope_theta, one.rope_local_theta, one.rope_scaling) == (1e6, 1e4, "none")
    assert (one.sliding_window, one.sliding_window_pattern, one.attn_logit_softcapping) == (512, 6, None)
    big = model_config_from_hf(GEMMA3_27B_TEXT)
    assert (big.rope_scaling, big.rope_linear_factor, big.query_pre_attn_scalar, big.sliding_window) == (
        "linear", 8.0, 168, 1024
    )  # fmt: skip
    config = transformer_config(big, ParallelConfig(tensor_model_parallel_size=8))
    assert (config.window_size, config.window_attn_skip_freq, config.softmax_scale) == ((1023, 0), 6, 168**-0.5)
    small = model_config_from_hf(GEMMA3_270M)
    assert (small.num_layers, small.sliding_window_pattern, small.sliding_window) == (18, 6, 512)
    assert hf_config_from_model(small)["layer_types"] == GEMMA3_270M["layer_types"]


@pytest.mark.parametrize("published", [GEMMA2_2B, GEMMA3_1B])
def test_parameter_counts_are_transformers(published: dict[str, Any]) -> None:
    """`parameter_counts` (the planner's) counts what transformers builds: four norms per layer, tied embeddings."""
    from megatron_rl.models.families import parameter_counts

    config = transformers.AutoConfig.for_model(
        published["model_type"], **{k: v for k, v in published.items() if k not in ("model_type", "torch_dtype")}
    )
    with torch.device("meta"):
        built = transformers.AutoModelForCausalLM.from_config(config)
    assert parameter_counts(model_config_from_hf(published)) == (sum(p.numel() for p in built.parameters()), 0)


@pytest.mark.parametrize(
    ("base", "path", "value", "needle"),
    [
        (GEMMA2_2B, "attention_bias", True, "attention_bias = true is not supported"),
        (GEMMA2_2B, "hidden_activation", "gelu", "hidden_activation = 'gelu' is not supported (gelu_pytorch_tanh"),
        (GEMMA2_2B, "hidden_act", "gelu", "hidden_act = 'gelu' contradicts hidden_activation"),
        (GEMMA3_270M, "use_bidirectional_attention", True, "use_bidirectional_attention = true is not supported"),
        (GEMMA3_1B, "attn_logit_softcapping", 50.0, "attn_logit_softcapping = 50.0 is not supported for gemma3_text"),
        (GEMMA3_1B, "rope_scaling", {"rope_type": "yarn", "factor": 8.0}, "rope_type = 'yarn' is not supported"),
        (GEMMA3_1B, "rope_scaling", {"rope_type": "linear", "factor": 8.0, "low_freq_factor": 1.0},
         "rope_scaling.low_freq_factor is not handled"),
        (GEMMA2_2B, "rope_scaling", {"rope_type": "linear", "factor": 2.0},
         "rope_scaling rope_type = 'linear' is not supported (default)"),
        (GEMMA2_2B, "rope_local_base_freq", 1e4, "rope_local_base_freq is not handled by the gemma2 mapping"),
        (GEMMA3_1B, "rope_parameters", {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                        "sliding_attention": {"rope_type": "linear", "factor": 2.0}},
         "rope_parameters.sliding_attention rope_type = 'linear' is not supported (default)"),
        (GEMMA3_1B, "rope_parameters", {"rope_type": "default", "rope_theta": 1e6},
         "rope_parameters.rope_theta is not a layer type"),
        (GEMMA3_270M, "layer_types", ["full_attention"] + ["sliding_attention"] * 17, "layer_types = ['full_attention'"),
        (GEMMA3_270M, "layer_types", ["sliding_attention"] * 17, "is not a list of 18 of"),
        (GEMMA3_270M, "_sliding_window_pattern", 4, "_sliding_window_pattern = 4 contradicts layer_types"),
        (GEMMA2_2B, "sliding_window", None, "sliding_window = null, but layer_types has sliding_attention layers"),
        (GEMMA2_2B, "quantization_config", {"quant_method": "fp8"}, "quantization_config is not handled by the gemma2"),
        (GEMMA2_2B, "query_pre_attn_scalar", 0, "query_pre_attn_scalar = 0 is not an integer >= 1"),
        (GEMMA3_1B, "architectures", ["Gemma3ForConditionalGeneration"],
         "Gemma 3's vision-language model (a SigLIP vision tower and projector"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(base: dict[str, Any], path: str, value: Any, needle: str) -> None:
    with pytest.raises(ConversionError) as err:
        model_config_from_hf(with_key(base, path, value))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_gemma_switches_belong_to_gemma_and_need_local_attention() -> None:
    """What only Gemma has is refused for other families (and Gemma 3's for Gemma 2); sliding windows and
    soft-capping refuse SDPA and context parallelism; Gemma builds on the local specs where Transformer Engine is;
    LoRA is not mapped for Gemma yet."""
    from megatron_rl.models.attention_choice import check_attention_backend, transformer_engine_layers, use_sdpa
    from megatron_rl.models.families import check_family
    from megatron_rl.models.lora_targets import check_target_modules

    from mrl_configs import tiny_model

    for key, value, family, owners in (
        ("sliding_window", 4, "llama", "gpt_oss, gemma2, gemma3_text"),
        ("final_logit_softcapping", 30.0, "qwen3", "gemma2, gemma3_text"),
        ("attn_logit_softcapping", 50.0, "gemma3_text", "gemma2"),
        ("rope_local_theta", 1e4, "gemma2", "gemma3_text"),
    ):
        with pytest.raises(ConfigError, match=rf"'{family}' has no model.{key} \(only {owners}\)"):
            check_family(tiny_model(family, **{key: value}))
    with pytest.raises(ConfigError, match=r"has no model.rope_scaling = 'linear' \(only gemma3_text\)"):
        check_family(tiny_model("mistral", rope_scaling="linear"))
    g2 = tiny_model("gemma2", attn_logit_softcapping=50.0)
    for model, parallel, needle in (
        (dataclasses.replace(g2, attention_backend="sdpa"), layout(), "model.attention_backend = sdpa"),
        (g2, layout(cp=2), "parallel.context_parallel_size = 2: model.family = 'gemma2' has attention logit"),
        (tiny_model("gemma3_text", sliding_window=4), layout(cp=2), "has sliding-window layers"),
    ):
        with pytest.raises(ConfigError, match="which only Megatron's local attention computes") as err:
            check_attention_backend(model, parallel, transformer_engine=False)
        assert needle in str(err.value)
    assert not use_sdpa(g2, layout(), cuda=True) and use_sdpa(tiny_model("gemma3_text"), layout(), cuda=True)
    local = dataclasses.replace(g2, attention_backend="local")
    assert not transformer_engine_layers(local, available=True) and transformer_engine_layers(
        tiny_model("llama"), available=True
    )
    check_attention_backend(local, layout(), transformer_engine=transformer_engine_layers(local, available=True))
    with pytest.raises(ConfigError, match="LoRA is not available for model.family = 'gemma2'"):
        check_target_modules(dataclasses.replace(g2, lora=g2.lora.__class__(rank=4)))


@pytest.mark.parametrize("family", GEMMA_FAMILIES)
def test_config_round_trip_and_table_match_what_transformers_writes(tmp_path: Path, family: str) -> None:
    """save_pretrained's config.json (transformers 5's spelling) gives the model and comes back through
    transformers; its checkpoint holds exactly the mapping's names and shapes (the four norms of a layer)."""
    from safetensors.torch import load_file

    from megatron_rl.models.hf_mapping import HFMapping
    from megatron_rl.models.import_hf import open_hf_checkpoint

    folder = save_random_hf_model(tmp_path / "hf", hf_config(family, "split"), seed=5)
    saved = json.loads((folder / "config.json").read_text())
    model = model_config_from_hf(saved)
    hf = hf_config_from_model(model)
    assert model_config_from_hf(hf) == model
    again = transformers.AutoConfig.for_model(family, **{k: v for k, v in hf.items() if k != "model_type"})
    for key in ("layer_types", "rope_parameters", "sliding_window", "query_pre_attn_scalar", "head_dim",
                "final_logit_softcapping", "attn_logit_softcapping", "tie_word_embeddings"):  # fmt: skip
        assert getattr(again, key) == saved[key], key
    mapping = HFMapping(model)
    stored = {name: tuple(t.shape) for name, t in load_file(folder / "model.safetensors").items()}
    assert stored == mapping.expected_hf_shapes()
    assert mapping.hf_names("decoder.layers.2.mlp.post_layernorm.weight") == (
        "model.layers.2.post_feedforward_layernorm.weight",
    )
    open_hf_checkpoint(str(folder), model)  # every check passes


@pytest.mark.parametrize("family", GEMMA_FAMILIES)
def test_without_sliding_layers_the_export_still_runs_in_transformers(family: str) -> None:
    """layer_types all full: no window (model.sliding_window null); the exported config.json still carries one,
    which transformers' Gemma needs to build its (unused) sliding mask."""
    from mrl_configs import hf_config_json

    model = model_config_from_hf(hf_config_json(family, "small", layer_types=["full_attention"] * 2))
    assert model.sliding_window is None
    hf = hf_config_from_model(model)
    assert hf["layer_types"] == ["full_attention"] * 2 and model_config_from_hf(hf) == model
    config = transformers.AutoConfig.for_model(family, **{k: v for k, v in hf.items() if k != "model_type"})
    with torch.no_grad():
        logits = transformers.AutoModelForCausalLM.from_config(config)(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 128)


def _variant(folder: Path, **config: Any) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", **config).eval()


# transformers variants of the tiny models, each without one Gemma switch: each must move the log-probs
_VARIANTS: dict[str, dict[str, dict[str, Any]]] = {
    "gemma2": {
        "no window": dict(sliding_window=64),
        "head_dim scale": dict(query_pre_attn_scalar=24),
        "no attention soft-capping": dict(attn_logit_softcapping=None),
        "no final soft-capping": dict(final_logit_softcapping=None),
    },
    "gemma3_text": {
        "no window": dict(sliding_window=64),
        "head_dim scale": dict(query_pre_attn_scalar=16),
        "one RoPE base": dict(rope_parameters=dict(full_attention=dict(rope_type="linear", factor=4.0, rope_theta=5e5),
                                                   sliding_attention=dict(rope_type="default", rope_theta=5e5))),
        "no linear scaling": dict(rope_parameters=dict(full_attention=dict(rope_type="default", rope_theta=5e5),
                                                       sliding_attention=dict(rope_type="default", rope_theta=100.0))),
    },
}  # fmt: skip


@pytest.mark.parametrize("family", GEMMA_FAMILIES)
def test_convert_forward_and_back_on_one_rank(tmp_path: Path, family: str) -> None:
    """HF -> Megatron checkpoint -> logits (local specs, fp32): log-probs within 1e-5 of transformers' eager
    ones, which each Gemma switch moves by more than 1e-2; Megatron -> HF: the original tensors bit for bit."""
    from megatron_rl.commands.convert import hf_to_megatron, megatron_to_hf

    from mrl_configs import launch_of_one
    from mrl_multiproc.scenarios_convert import assert_same_tensors, megatron_logits, sample_ids

    src = save_random_hf_model(tmp_path / "hf", hf_config(family, "split"), seed=5)
    with launch_of_one():
        hf_to_megatron(src, tmp_path / "mg")
        logp = megatron_logits(tmp_path / "mg", ParallelConfig())[0].log_softmax(-1)  # right-padded
        megatron_to_hf(tmp_path / "mg", tmp_path / "back")
    assert_same_tensors(tmp_path / "back", src)
    with torch.no_grad():
        expected = _variant(src)(input_ids=sample_ids()).logits.log_softmax(-1)
        assert (logp - expected).abs().max().item() <= 1e-5
        for what, change in _VARIANTS[family].items():
            moved = (_variant(src, **change)(input_ids=sample_ids()).logits.log_softmax(-1) - expected).abs().max()
            assert moved.item() > 1e-2, (what, moved.item())


@pytest.mark.parametrize("family", GEMMA_FAMILIES)
def test_gradients_equal_transformers(tmp_path: Path, family: str) -> None:
    """Training: the gradient of the sampled tokens' log-probs at temperature 0.8 (the decoder's hidden states
    through the actor's chunked, soft-capped log-prob head) w.r.t. every weight, mapped to its HF name, equals
    transformers' autograd gradient within 1e-4 of its largest entry (measured: 2e-6 and 4e-6)."""
    from megatron_rl.actor.forward import hidden_states_out
    from megatron_rl.actor.logprobs import vocab_parallel_logprobs_from_hidden
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.gemma import final_logit_softcap
    from megatron_rl.models.hf_mapping import HFMapping
    from megatron_rl.models.import_hf import load_hf_weights, open_hf_checkpoint
    from megatron_rl.models.init import iter_param_shards
    from megatron_rl.parallel import init_distributed

    from mrl_configs import launch_of_one

    src = save_random_hf_model(tmp_path / "hf", hf_config(family, "split"), seed=5)
    model = model_config_from_hf(json.loads((src / "config.json").read_text()), params_dtype="fp32")
    ids = torch.randint(0, model.vocab_size, (2, 14), generator=torch.Generator().manual_seed(2))
    reference = transformers.AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager").train()
    logits = reference(input_ids=ids).logits[:, :-1] / 0.8
    logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).sum().backward()
    expected = {name: p.grad for name, p in reference.named_parameters()}
    with launch_of_one():
        init_distributed(layout(), model)
        chunks = build_model(model, layout())
        load_hf_weights(chunks, model, open_hf_checkpoint(str(src), model))
        gpt = chunks[0].train()
        with hidden_states_out(gpt):
            hidden = gpt(ids, torch.arange(14).expand(2, -1), None)[:-1]
        weight = gpt.shared_embedding_or_output_weight() if model.tie_word_embeddings else gpt.output_layer.weight
        out = vocab_parallel_logprobs_from_hidden(
            hidden, weight, ids[:, 1:].t(), 0.8, vocab_size=model.vocab_size, softcap=final_logit_softcap(gpt)
        )
        out.logprobs.sum().backward()
        mapping, compared = HFMapping(model), set()
        for shard in iter_param_shards(chunks, model):
            for name, grad in mapping.to_hf(shard.global_name, shard.param.grad):
                want = expected[name]
                assert (grad - want).abs().max() <= 1e-4 * want.abs().max(), name
                compared.add(name)
    assert compared == set(expected)


@pytest.mark.parametrize("family", GEMMA_FAMILIES)
def test_local_engine_serves_it_and_the_actor_gives_its_log_probs(tmp_path: Path, family: str) -> None:
    """The local engine loads Gemma through transformers (Gemma 2's eager attention, a mask per layer type with the
    window, the final soft-capping on its logits), takes every tensor the trainer exports by name, and samples sequences of 10 to 18 tokens (the window is 5) whose
    log-probs are a plain transformers forward's; the actor (one rank, loading the folder) gives the sampled tokens
    the engine's log-probs and transformers' within 1e-5 at temperature 0.8, right-padded and packed."""
    from megatron_rl.actor.batch import ActorBatch
    from megatron_rl.actor.micro_batches import TokenBudget
    from megatron_rl.config import Config, RolloutConfig, TrainConfig
    from megatron_rl.models.hf_mapping import HFMapping
    from megatron_rl.rollout.local.generator import Generator, GenRequest
    from megatron_rl.rollout.local.model import load_model
    from megatron_rl.rollout.local.weights import CheckpointLayout

    from mrl_configs import actor_of_one

    folder = save_random_hf_model(tmp_path / "hf", hf_config(family, "split"), seed=3)
    served, info = load_model(str(folder))
    model = model_config_from_hf(json.loads((folder / "config.json").read_text()), hf_path=str(folder))
    exported = HFMapping(model).expected_hf_shapes()  # what a weight update names
    targets = CheckpointLayout(served, family).targets
    assert {name: tuple(targets[name].shape) for name in exported} == exported
    softcap = 4.0 if family == "gemma2" else None
    assert (info.family, info.sliding_window, info.final_logit_softcapping) == (family, 5, softcap)
    assert served.config._attn_implementation == ("eager" if family == "gemma2" else "sdpa")
    gen = Generator(served, info, max_running=3, max_prefill_tokens=64, seed=5)
    prompts = ([5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16])
    reqs = [
        GenRequest(rid=str(i), input_ids=p, max_new_tokens=6 + 3 * i, temperature=0.8, return_logprob=True)
        for i, p in enumerate(prompts)
    ]
    for req in reqs:
        gen.add(req)
    while gen.has_work:
        gen.step()
    tokens = [torch.tensor(r.input_ids + r.output_ids) for r in reqs]
    assert [len(t) for t in tokens] == [10, 11, 18]
    eager = _variant(folder)
    reference = []
    for prompt, ids in zip(prompts, tokens, strict=True):
        with torch.no_grad():
            logp = (eager(ids[None]).logits[0] / 0.8).log_softmax(-1)
        reference.append(logp[len(prompt) - 1 : -1].gather(1, ids[len(prompt) :, None])[:, 0])
    engine = [torch.tensor(r.output_logprobs) for r in reqs]
    for got, want in zip(engine, reference, strict=True):
        assert (got - want).abs().max().item() <= 1e-5
    cfg = Config(
        model=dataclasses.replace(model, params_dtype="fp32"),
        parallel=layout(),
        rollout=RolloutConfig(temperature=0.8),
        train=TrainConfig(max_tokens_per_micro_batch=64, logprob_chunk_tokens=16),
    )
    batch = ActorBatch(
        tokens=tokens, prompt_lengths=[len(p) for p in prompts], advantages=[torch.tensor(1.0) for _ in prompts]
    )
    with actor_of_one(cfg) as actor:
        padded = actor_log_probs(actor, batch, TokenBudget(64)).log_probs
        packed = actor_log_probs(actor, batch, TokenBudget(40, packed=True)).log_probs
    for name, got in (("padded", padded), ("packed", packed)):
        for against, want in (("engine", engine), ("transformers", reference)):
            gap = max((g - e).abs().max().item() for g, e in zip(got, want, strict=True))
            assert gap <= 1e-5, (name, against, gap)
