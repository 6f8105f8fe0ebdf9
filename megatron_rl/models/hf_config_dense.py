"""config.json <-> `model` for the bias-free dense families: Llama (2, 3, 3.1, 3.2, 3.3) and Mistral
(v0.2+, Nemo, Small).

Every key of config.json is mapped, checked against what the Megatron model computes, or known not to
be architecture (`_IGNORED`); any other key is refused by name, never dropped. The same holds for the
keys of `rope_scaling` / `rope_parameters`.

- RoPE: plain, or Llama 3.1's `llama3` scaling. Megatron-Core 0.16 applies that scaling with its
  `factor` only, low/high frequency factors 1 and 4 and 8192 original positions fixed (every Llama
  3.1/3.2/3.3 release); other values are refused, not approximated.
- Refused: `attention_bias` (Llama's adds a bias to o_proj too, which the Megatron model lacks),
  `mlp_bias`, Mistral's `sliding_window` (v0.1: sliding-window attention), another activation.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.models.hf_config import hf_bool, hf_float, hf_section, refuse, shared_fields

# Keys that are not architecture (training, generation, tokenizer, loader and bookkeeping settings).
_IGNORED = frozenset(
    {
        "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
        "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id", "attention_dropout", "pretraining_tp",
        "_name_or_path", "name_or_path", "chunk_size_feed_forward", "id2label", "label2id", "is_encoder_decoder",
        "output_attentions", "output_hidden_states", "problem_type", "return_dict",
    }
)  # fmt: skip
_MAPPED = frozenset(
    {
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
        "rope_parameters", "tie_word_embeddings", "vocab_size",
    }
)  # fmt: skip
_FAMILY_KEYS = {"llama": frozenset({"attention_bias", "mlp_bias"}), "mistral": frozenset({"sliding_window"})}
_ROPE_KEYS = frozenset({"type", "rope_type", "rope_theta"})
_LLAMA3_KEYS = frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})
# What Megatron-Core 0.16's RotaryEmbedding._apply_scaling fixes (GPTModel passes it the factor only).
MEGATRON_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _rope_fields(hf: dict[str, Any], family: str, source: str) -> dict[str, Any]:
    """RoPE base and Llama 3.1's scaling, from rope_scaling (Hub files) or rope_parameters (transformers 5)."""
    key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope, within = dict(hf_section(hf, source, key)), f"{source}: {key}"
    kind = rope.get("rope_type") or rope.get("type") or "default"
    refuse(kind in ("default", "llama3"), source, f"{key} rope_type = {kind!r} is not supported (default or llama3)")
    allowed = _ROPE_KEYS | (_LLAMA3_KEYS if kind == "llama3" else frozenset())
    unknown = sorted(set(rope) - allowed)
    refuse(not unknown, source, f"{key}.{unknown[0] if unknown else ''} is not handled with rope_type {kind!r}")
    theta = hf_float(rope, within, "rope_theta", default=None)
    if theta is None:
        refuse(hf.get("rope_theta") is not None, source, "missing key 'rope_theta' (or rope_parameters.rope_theta)")
        theta = hf_float(hf, source, "rope_theta")
    if kind == "default":
        return dict(rope_theta=theta)
    refuse(family == "llama", source, f"{key} rope_type = 'llama3' is only supported for llama")
    for name, fixed in MEGATRON_LLAMA3.items():
        value = hf_float(rope, within, name)
        refuse(
            value == fixed,
            source,
            f"{key}.{name} = {value:g}: Megatron-Core's llama3 RoPE scaling fixes it to {fixed:g} "
            "(low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192)",
        )
    return dict(rope_theta=theta, rope_scaling="llama3", llama3_factor=hf_float(rope, within, "factor"))


def dense_model_fields(hf: dict[str, Any], family: str, source: str) -> dict[str, Any]:
    """The architecture fields of `ModelConfig` of a llama / mistral config.json."""
    unknown = sorted(set(hf) - _IGNORED - _MAPPED - _FAMILY_KEYS[family])
    refuse(not unknown, source, f"{unknown[0] if unknown else ''} is not handled by the {family} mapping")
    act = hf.get("hidden_act", "silu")
    refuse(act == "silu", source, f"hidden_act = {act!r} is not supported (SwiGLU with silu only)")
    for bias in ("attention_bias", "mlp_bias"):
        refuse(not hf_bool(hf, source, bias, default=False), source, f"{bias} = true is not supported for {family}")
    window = hf.get("sliding_window")
    refuse(window is None, source, f"sliding_window = {window!r}: sliding-window attention is not supported")
    fields, _ = shared_fields(hf, source)
    fields.update(family=family, qk_layernorm=False, add_qkv_bias=False, num_experts=None)
    fields.update(_rope_fields(hf, family, source))
    return fields


def dense_hf_config(model: Any) -> dict[str, Any]:
    """The config.json keys (beyond the shared ones, `rope_theta` replaced) that `transformers` needs for `model`."""
    rope: dict[str, Any] = dict(rope_type="default", rope_theta=model.rope_theta)
    if model.rope_scaling == "llama3":
        rope.update(rope_type="llama3", factor=model.llama3_factor, **MEGATRON_LLAMA3)
    hf: dict[str, Any] = dict(rope_parameters=rope)
    if model.family == "llama":
        hf.update(attention_bias=False, mlp_bias=False)
    else:
        hf["sliding_window"] = None
    return hf
