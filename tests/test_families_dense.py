"""Llama (3.1's llama3 RoPE scaling) and Mistral in one process: published config.json files -> `model`,
every refusal naming its field, the way back through transformers (Gemma: tests/test_gemma.py),
and on one rank in this process: HF -> Megatron log-probs equal transformers' (fp32, <= 1e-5) and
Megatron -> HF gives every tensor back bit for bit. (TP2/PP2: tests/test_convert_distributed.py.)"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from megatron_rl.config import ConfigError, ParallelConfig
from megatron_rl.models.hf_config import ConversionError, hf_config_from_model, model_config_from_hf

from mrl_configs import DENSE_FAMILIES, hf_config, hf_config_json, launch_of_one, save_random_hf_model

_BOOKKEEPING = {"attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True, "torch_dtype": "bfloat16"}
LLAMA_31_8B: dict[str, Any] = {
    **_BOOKKEEPING, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "transformers_version": "4.43.0.dev0", "vocab_size": 128256,
}  # fmt: skip
LLAMA_32_1B: dict[str, Any] = {
    **LLAMA_31_8B, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "head_dim": 64,
    "tie_word_embeddings": True, "rope_scaling": {**LLAMA_31_8B["rope_scaling"], "factor": 32.0},
}  # fmt: skip
MISTRAL_7B_V03: dict[str, Any] = {
    **_BOOKKEEPING, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    "transformers_version": "4.42.0.dev0", "vocab_size": 32768,
}  # fmt: skip
MISTRAL_NEMO: dict[str, Any] = {
    **MISTRAL_7B_V03, "hidden_size": 5120, "head_dim": 128, "num_hidden_layers": 40, "max_position_embeddings": 1024000,
    "vocab_size": 131072,
}  # fmt: skip


def test_published_configs() -> None:
    llama = model_config_from_hf(LLAMA_31_8B)
    assert (llama.family, llama.num_layers, llama.hidden_size, llama.ffn_hidden_size) == ("llama", 32, 4096, 14336)
    assert (llama.num_attention_heads, llama.num_query_groups, llama.kv_channels, llama.vocab_size) == (
        32,
        8,
        None,
        128256,
    )
    assert (llama.rope_theta, llama.rope_scaling, llama.llama3_factor) == (500000.0, "llama3", 8.0)
    assert (llama.norm_epsilon, llama.params_dtype, llama.qk_layernorm, llama.add_qkv_bias) == (
        1e-5,
        "bf16",
        False,
        False,
    )
    small = model_config_from_hf(LLAMA_32_1B)
    assert (small.kv_channels, small.tie_word_embeddings, small.llama3_factor) == (None, True, 32.0)
    plain = {**LLAMA_31_8B, "rope_scaling": None, "max_position_embeddings": 8192}  # Llama 3 8B
    assert model_config_from_hf(plain).rope_scaling == "none"
    mistral = model_config_from_hf(MISTRAL_7B_V03)
    assert (mistral.family, mistral.rope_theta, mistral.rope_scaling, mistral.num_experts) == (
        "mistral",
        1e6,
        "none",
        None,
    )
    nemo = model_config_from_hf(MISTRAL_NEMO)
    assert (nemo.kv_channels, nemo.hidden_size, nemo.num_attention_heads) == (128, 5120, 32)  # 32 x 128 != 5120


def _with(base: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(base)
    *parents, key = path.split(".")
    node = out
    for parent in parents:
        node = node[parent]
    node[key] = value
    return out


@pytest.mark.parametrize(
    ("base", "path", "value", "needle"),
    [
        (LLAMA_31_8B, "rope_scaling.low_freq_factor", 2.0,
         "rope_scaling.low_freq_factor = 2: Megatron-Core's llama3 RoPE scaling fixes it to 1"),
        (LLAMA_31_8B, "rope_scaling.high_freq_factor", 8.0, "rope_scaling.high_freq_factor = 8"),
        (LLAMA_31_8B, "rope_scaling.original_max_position_embeddings", 4096,
         "original_max_position_embeddings = 4096: Megatron-Core's llama3"),
        (LLAMA_31_8B, "rope_scaling.rope_type", "dynamic", "rope_scaling rope_type = 'dynamic' is not supported"),
        (LLAMA_31_8B, "rope_scaling", {"rope_type": "default", "factor": 2.0},
         "rope_scaling.factor is not handled with rope_type 'default'"),
        (LLAMA_31_8B, "rope_scaling", {"rope_type": "yarn"}, "rope_type = 'yarn' is not supported (default or llama3)"),
        (LLAMA_31_8B, "rope_scaling.extra", 1, "rope_scaling.extra is not handled"),
        (MISTRAL_7B_V03, "rope_scaling", LLAMA_31_8B["rope_scaling"], "'llama3' is only supported for llama"),
        (LLAMA_31_8B, "attention_bias", True, "attention_bias = true is not supported for llama"),
        (LLAMA_31_8B, "mlp_bias", True, "mlp_bias = true is not supported for llama"),
        (LLAMA_31_8B, "hidden_act", "gelu", "hidden_act = 'gelu'"),
        (LLAMA_31_8B, "quantization_config", {"quant_method": "fp8"}, "quantization_config is not handled by the llama"),
        (LLAMA_31_8B, "sliding_window", 4096, "sliding_window is not handled by the llama mapping"),
        (MISTRAL_7B_V03, "sliding_window", 4096, "sliding_window = 4096: sliding-window attention is not supported"),
        (MISTRAL_7B_V03, "attention_bias", False, "attention_bias is not handled by the mistral mapping"),
        (MISTRAL_7B_V03, "num_key_value_heads", 5, "model.num_attention_heads (32) must be a multiple of"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(base: dict[str, Any], path: str, value: Any, needle: str) -> None:
    with pytest.raises(ConversionError) as err:
        model_config_from_hf(_with(base, path, value))
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_llama3_scaling_belongs_to_llama() -> None:
    from megatron_rl.models.families import check_family

    from mrl_configs import tiny_model

    with pytest.raises(ConfigError, match="rope_scaling = 'llama3' is only supported for model.family = 'llama'"):
        check_family(tiny_model("mistral", rope_scaling="llama3"))
    with pytest.raises(
        ConfigError, match=r"rope_scaling = 'yarn' is only supported for deepseek_v3 \(MLA\) and gpt_oss"
    ):
        check_family(tiny_model("llama", rope_scaling="yarn"))


@pytest.mark.parametrize("family", DENSE_FAMILIES)
def test_config_round_trip_and_transformers_reads_it(family: str) -> None:
    model = model_config_from_hf(hf_config_json(family), params_dtype="fp32")
    hf = hf_config_from_model(model)
    assert model_config_from_hf(hf) == model
    config = transformers.AutoConfig.for_model(family, **{k: v for k, v in hf.items() if k != "model_type"})
    expected = {"rope_type": "llama3", "factor": 4.0} if family == "llama" else {"rope_type": "default"}
    assert {k: config.rope_parameters[k] for k in expected} == expected
    assert getattr(config, "sliding_window", None) is None and config.head_dim == (24 if family == "llama" else 16)


@pytest.mark.parametrize("family", DENSE_FAMILIES)
def test_convert_forward_and_back_on_one_rank(tmp_path: Path, family: str) -> None:
    """HF -> Megatron checkpoint -> logits: log-probs equal transformers' within 1e-5 (Llama's with llama3
    scaling, which moves them by far more than that); Megatron -> HF: the original tensors bit for bit."""
    from megatron_rl.commands.convert import hf_to_megatron, megatron_to_hf

    from mrl_multiproc.scenarios_convert import assert_same_tensors, megatron_logits, sample_ids

    src = save_random_hf_model(tmp_path / "hf", hf_config(family, "split"), seed=5)
    with launch_of_one():
        hf_to_megatron(src, tmp_path / "mg")
        logp = megatron_logits(tmp_path / "mg", ParallelConfig())[0].log_softmax(-1)  # right-padded
        megatron_to_hf(tmp_path / "mg", tmp_path / "back")
    assert_same_tensors(tmp_path / "back", src)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager").float().eval()
    with torch.no_grad():
        expected = hf(input_ids=sample_ids()).logits.log_softmax(-1)
    assert (logp - expected).abs().max().item() <= 1e-5
    if family == "llama":
        plain = transformers.AutoModelForCausalLM.from_config(
            hf_config(family, "split", rope_scaling=None), attn_implementation="eager"
        )
        plain.load_state_dict(hf.state_dict())
        with torch.no_grad():
            unscaled = plain.float().eval()(input_ids=sample_ids()).logits.log_softmax(-1)
        assert (unscaled - expected).abs().max().item() > 1e-3  # the scaling is visible at this length
