"""config.json <-> `model` for gpt-oss (`GptOssForCausalLM`).

Every key of config.json is mapped, checked against what the Megatron model computes, or known not to
be architecture (`_IGNORED`); any other key is refused by name. The Hub files (openai/gpt-oss-20b, -120b)
and transformers 5 spell some settings differently: RoPE is `rope_scaling` + `rope_theta` (Hub) or
`rope_parameters` (transformers 5), top-k is also `experts_per_token` (Hub).

The architecture (transformers' `GptOss` modeling): GQA with biases on q/k/v/o and one learnable sink
logit per head (a softmax over the scores and the sink, the sink's share dropped); layers of
`layer_types`, sliding ones attending to the last `sliding_window` keys (the query's own included), full
ones to all; yarn RoPE (`truncate` false: the correction range is not rounded); a router with a bias whose
top-k logits, softmaxed, are the gates; experts with biases whose SwiGLU clamps the gate to at most
`swiglu_limit` and the linear half to +-`swiglu_limit`, and computes gate * sigmoid(`swiglu_alpha` * gate)
* (linear + 1); MoE in every layer. The Hub release quantizes the experts to MXFP4 (`quantization_config`):
refused by name, convert to bf16 first.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.models.hf_config import (
    LAYER_TYPES,
    ConversionError,
    full_layer_period,
    hf_bool,
    hf_float,
    hf_int,
    hf_section,
    refuse,
    shared_fields,
)

# Not architecture: training, generation, tokenizer, loader and bookkeeping settings. `hidden_act` is not read by
# transformers' GptOss (its experts' activation is the clamped swiglu_alpha gate); `initial_context_length` is the
# reference implementation's name of yarn's original_max_position_embeddings, which rope_scaling carries.
_IGNORED = frozenset(
    {
        "architectures", "model_type", "auto_map", "transformers_version", "torch_dtype", "dtype", "use_cache",
        "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id", "attention_dropout",
        "output_router_logits", "router_aux_loss_coef", "_name_or_path", "name_or_path", "hidden_act",
        "initial_context_length",
    }
)  # fmt: skip
_MAPPED = frozenset(
    {
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "num_local_experts", "num_experts", "num_experts_per_tok", "experts_per_token", "rms_norm_eps",
        "vocab_size", "max_position_embeddings", "tie_word_embeddings", "rope_theta", "rope_parameters",
        "rope_scaling", "attention_bias", "layer_types", "sliding_window", "swiglu_alpha", "swiglu_limit",
    }
)  # fmt: skip
_ROPE_KEYS = frozenset(
    {"rope_type", "type", "rope_theta", "factor", "beta_fast", "beta_slow", "original_max_position_embeddings",
     "truncate"}
)  # fmt: skip
_SWIGLU_ALPHA = 1.702  # transformers' default (the Hub files leave it out)


def _rope_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope, within = hf_section(hf, source, key), f"{source}: {key}"
    unknown = sorted(set(rope) - _ROPE_KEYS)
    refuse(not unknown, source, f"{key}.{unknown[0] if unknown else ''} is not handled by the gpt_oss mapping")
    kind = rope.get("rope_type") or rope.get("type") or "default"
    refuse(kind in ("yarn", "default"), source, f"{key} rope_type = {kind!r} is not supported (yarn or plain RoPE)")
    theta = hf_float(rope, within, "rope_theta", default=None)
    fields: dict[str, Any] = dict(rope_theta=hf_float(hf, source, "rope_theta") if theta is None else theta)
    if kind == "default":
        return fields
    return dict(
        fields,
        rope_scaling="yarn",
        yarn_factor=hf_float(rope, within, "factor"),
        yarn_original_max_position_embeddings=hf_int(rope, within, "original_max_position_embeddings"),
        yarn_beta_fast=hf_float(rope, within, "beta_fast", default=32.0),
        yarn_beta_slow=hf_float(rope, within, "beta_slow", default=1.0),
        yarn_truncate=hf_bool(rope, within, "truncate", default=True),
    )


def _window_fields(hf: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    """`sliding_window` and the layer pattern of `layer_types`: every n-th layer full, the others sliding."""
    window = hf.get("sliding_window")
    types = hf.get("layer_types")
    if types is None:  # transformers' default: sliding, full, sliding, ...
        types = [LAYER_TYPES[i % 2] for i in range(layers)]
    pattern = full_layer_period(types, layers, source)
    if pattern is None:  # no layer slides
        return dict(sliding_window=None)
    refuse(window is not None, source, "sliding_window = null with sliding layers in layer_types (transformers "
           "cannot run it)")  # fmt: skip
    window = hf_int(hf, source, "sliding_window")
    return dict(sliding_window=window, sliding_window_pattern=pattern)


def gpt_oss_model_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The architecture fields of `ModelConfig` of a gpt-oss config.json."""
    quant = hf.get("quantization_config")
    refuse(
        quant is None,
        source,
        f"quantization_config (quant_method {(quant or {}).get('quant_method')!r}) is not supported: the experts "
        "are quantized (the Hub's MXFP4 release); dequantize the checkpoint to bf16 first",
    )
    unknown = sorted(set(hf) - _IGNORED - _MAPPED)
    refuse(not unknown, source, f"{unknown[0] if unknown else ''} is not handled by the gpt_oss mapping")
    refuse(
        hf_bool(hf, source, "attention_bias", default=True),
        source,
        "attention_bias = false is not supported (Megatron's add_bias_linear puts the biases on q/k/v/o, the router "
        "and the experts at once, as gpt-oss has them)",
    )
    topk = hf_int(hf, source, "num_experts_per_tok", "experts_per_token")
    other = hf.get("experts_per_token")
    refuse(other is None or other == topk, source, f"experts_per_token = {other!r} contradicts num_experts_per_tok")
    fields, _ = shared_fields(hf, source)
    layers = fields["num_layers"]
    fields.update(
        family="gpt_oss",
        qk_layernorm=False,
        add_qkv_bias=True,
        num_experts=hf_int(hf, source, "num_local_experts", "num_experts"),
        moe_router_topk=topk,
        moe_ffn_hidden_size=fields["ffn_hidden_size"],
        moe_router_norm_topk=True,
        first_k_dense_layers=0,
        moe_layer_freq=1,
        swiglu_alpha=hf_float(hf, source, "swiglu_alpha", default=_SWIGLU_ALPHA),
        swiglu_limit=hf_float(hf, source, "swiglu_limit", default=7.0),
    )
    fields.update(_rope_fields(hf, source))
    fields.update(_window_fields(hf, source, layers))
    return fields


def gpt_oss_hf_config(model: Any) -> dict[str, Any]:
    """The config.json keys (beyond the shared ones) that `transformers` needs for `model`."""
    if model.moe_ffn_hidden_size != model.ffn_hidden_size:
        raise ConversionError(
            "gpt_oss's intermediate_size is the expert width: needs model.moe_ffn_hidden_size == model.ffn_hidden_size"
        )
    if model.swiglu_limit is None:
        raise ConversionError("gpt_oss clamps its SwiGLU (swiglu_limit): model.swiglu_limit must be set")
    rope: dict[str, Any] = dict(rope_type="default", rope_theta=model.rope_theta)
    if model.rope_scaling == "yarn":
        rope.update(
            rope_type="yarn",
            factor=model.yarn_factor,
            original_max_position_embeddings=model.yarn_original_max_position_embeddings,
            beta_fast=model.yarn_beta_fast,
            beta_slow=model.yarn_beta_slow,
            truncate=model.yarn_truncate,
        )
    window, n = model.sliding_window, model.sliding_window_pattern
    return dict(
        attention_bias=True,
        num_local_experts=model.num_experts,
        num_experts_per_tok=model.moe_router_topk,
        swiglu_alpha=model.swiglu_alpha,
        swiglu_limit=model.swiglu_limit,
        sliding_window=window,
        layer_types=[LAYER_TYPES[window is None or (i + 1) % n == 0] for i in range(model.num_layers)],
        rope_parameters=rope,
    )
