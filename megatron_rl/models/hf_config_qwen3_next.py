"""config.json <-> `model` for Qwen3-Next (`Qwen3NextForCausalLM`) and Qwen3.5's text model
(`Qwen3_5MoeForCausalLM`, model_type `qwen3_5_moe_text`).

Every key of config.json is mapped, checked against what the Megatron model computes, or known not to be
architecture (`_IGNORED`); any other key is refused by name. The Hub files and transformers 5 spell some settings
differently: the layer pattern is `full_attention_interval` (Hub) or `layer_types` (transformers 5), RoPE is
`rope_theta` + `partial_rotary_factor` (Hub) or `rope_parameters` (transformers 5).

The architecture (transformers' `Qwen3Next` / `Qwen3_5Moe` modeling): Gated DeltaNet layers (`models.gated_delta`),
every n-th layer a full GQA attention whose q projection also yields a gate (output * sigmoid(gate)), per-head
(1 + weight) QK-norms, partial RoPE (rotate-half on the first dimensions of each head); (1 + weight) RMSNorms;
a softmax router over all experts, top-k renormalised (`norm_topk_prob`; always for Qwen3.5), and a shared expert
scaled by sigmoid(`shared_expert_gate`). Qwen3.5's text RoPE is multimodal RoPE (`mrope_section`): on text the
three position axes are equal and it is plain RoPE. The multi-token-prediction layers (`mtp_*`) are not imported.
Qwen3.5's vision-language checkpoint (`Qwen3_5MoeForConditionalGeneration`) is refused by name: its text model
converts as `Qwen3_5MoeForCausalLM`.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.config import LinearAttentionConfig
from megatron_rl.models.hf_config import (
    ConversionError,
    hf_int,
    hf_section,
    partial_rope_fields,
    refuse,
    shared_fields,
)

QWEN3_NEXT_FAMILIES = ("qwen3_next", "qwen3_5_moe")
MODEL_TYPES = {"qwen3_next": "qwen3_next", "qwen3_5_moe": "qwen3_5_moe_text"}
_IGNORED = frozenset(
    {
        "architectures", "model_type", "auto_map", "transformers_version", "torch_dtype", "dtype", "use_cache",
        "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id", "attention_dropout",
        "output_router_logits", "router_aux_loss_coef", "_name_or_path", "name_or_path",
        "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings", "num_nextn_predict_layers",
    }
)  # fmt: skip
_MAPPED = frozenset(
    {
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
        "rms_norm_eps", "vocab_size", "max_position_embeddings", "tie_word_embeddings", "rope_theta",
        "partial_rotary_factor", "rope_parameters", "rope_scaling", "hidden_act", "attention_bias",
        "layer_types", "full_attention_interval", "linear_conv_kernel_dim", "linear_key_head_dim",
        "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
    }
)  # fmt: skip
# Qwen3-Next only: a dense MLP width, MoE layers every decoder_sparse_step-th, leading dense layers, the
# renormalisation switch, and the sliding window its full attention does not use.
_NEXT_ONLY = frozenset(
    {"intermediate_size", "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob", "use_sliding_window",
     "sliding_window", "max_window_layers"}
)  # fmt: skip
_ROPE_KEYS = frozenset(
    {"rope_type", "type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"}
)
_LAYER_TYPES = ("linear_attention", "full_attention")


def _interval(hf: dict[str, Any], source: str, layers: int) -> int:
    """n of every n-th layer full attention, the others Gated DeltaNet."""
    types = hf.get("layer_types")
    if types is None:
        return hf_int(hf, source, "full_attention_interval", default=4)
    refuse(
        isinstance(types, list) and len(types) == layers and all(t in _LAYER_TYPES for t in types),
        source,
        f"layer_types = {types!r} is not a list of {layers} of {list(_LAYER_TYPES)}",
    )
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    period = full[0] + 1 if full else layers + 1
    refuse(
        full == list(range(period - 1, layers, period)),
        source,
        f"layer_types = {types!r} is not supported: every n-th layer full attention, the others linear",
    )
    given = hf.get("full_attention_interval")
    refuse(given in (None, period), source, f"full_attention_interval = {given!r} contradicts layer_types")
    return period


def _rope_fields(hf: dict[str, Any], source: str, head_dim: int, family: str) -> dict[str, Any]:
    key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    section = hf_section(hf, source, key).get("mrope_section")
    refuse(
        section is None or (isinstance(section, list) and len(section) == 3),
        source,
        f"{key}.mrope_section = {section!r} is not a list of 3 (text positions are equal on all three)",
    )
    return partial_rope_fields(hf, source, head_dim, keys=_ROPE_KEYS, default_partial=0.25, family=family)


def _next_moe_fields(hf: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    """Qwen3-Next's MLP pattern (Qwen3-MoE's rule: leading dense layers, every decoder_sparse_step-th MoE)."""
    refuse(not hf.get("use_sliding_window"), source, "use_sliding_window = true is not supported")
    dense = hf.get("mlp_only_layers") or []
    refuse(
        isinstance(dense, list) and sorted(dense) == list(range(len(dense))) and len(dense) < layers,
        source,
        f"mlp_only_layers = {dense!r} is not supported (only leading dense layers [0, ..., k-1], some MoE left)",
    )
    return dict(
        ffn_hidden_size=hf_int(hf, source, "intermediate_size"),
        moe_layer_freq=hf_int(hf, source, "decoder_sparse_step", default=1),
        first_k_dense_layers=len(dense),
        moe_router_norm_topk=hf.get("norm_topk_prob", True) is True,
    )


def qwen3_next_model_fields(hf: dict[str, Any], family: str, source: str) -> dict[str, Any]:
    """The architecture fields of `ModelConfig` of a Qwen3-Next or Qwen3.5 text config.json."""
    allowed = _IGNORED | _MAPPED | (_NEXT_ONLY if family == "qwen3_next" else frozenset())
    unknown = sorted(set(hf) - allowed)
    refuse(not unknown, source, f"{unknown[0] if unknown else ''} is not handled by the {family} mapping")
    act = hf.get("hidden_act", "silu")
    refuse(act == "silu", source, f"hidden_act = {act!r} is not supported (SwiGLU with silu only)")
    refuse(not hf.get("attention_bias", False), source, f"attention_bias = true is not supported for {family}")
    if family == "qwen3_5_moe":  # every layer MoE; intermediate_size sizes no layer
        hf = {**hf, "intermediate_size": hf_int(hf, source, "moe_intermediate_size")}
    fields, head_dim = shared_fields(hf, source, head_dim=256)
    layers = fields["num_layers"]
    fields.update(
        family=family,
        qk_layernorm=True,
        add_qkv_bias=False,
        num_experts=hf_int(hf, source, "num_experts"),
        moe_router_topk=hf_int(hf, source, "num_experts_per_tok"),
        moe_ffn_hidden_size=hf_int(hf, source, "moe_intermediate_size"),
        moe_shared_expert_size=hf_int(hf, source, "shared_expert_intermediate_size"),
        moe_router_norm_topk=True,
        linear_attention=LinearAttentionConfig(
            full_attention_interval=_interval(hf, source, layers),
            conv_kernel=hf_int(hf, source, "linear_conv_kernel_dim", default=4),
            key_head_dim=hf_int(hf, source, "linear_key_head_dim", default=128),
            value_head_dim=hf_int(hf, source, "linear_value_head_dim", default=128),
            num_key_heads=hf_int(hf, source, "linear_num_key_heads", default=16),
            num_value_heads=hf_int(hf, source, "linear_num_value_heads", default=32),
        ),
    )
    if family == "qwen3_next":
        fields.update(_next_moe_fields(hf, source, layers))
    fields.update(_rope_fields(hf, source, head_dim, family))
    return fields


def qwen3_next_hf_config(model: Any) -> dict[str, Any]:
    """The config.json keys (beyond the shared ones) that `transformers` needs for `model` (Qwen3.5's without
    `intermediate_size`: `hf_config_from_model` drops it)."""
    linear = model.linear_attention
    n = linear.full_attention_interval
    hf: dict[str, Any] = dict(
        model_type=MODEL_TYPES[model.family],
        attention_bias=False,
        num_experts=model.num_experts,
        num_experts_per_tok=model.moe_router_topk,
        moe_intermediate_size=model.moe_ffn_hidden_size,
        shared_expert_intermediate_size=model.moe_shared_expert_size,
        layer_types=[_LAYER_TYPES[(i + 1) % n == 0] for i in range(model.num_layers)],
        linear_conv_kernel_dim=linear.conv_kernel,
        linear_key_head_dim=linear.key_head_dim,
        linear_value_head_dim=linear.value_head_dim,
        linear_num_key_heads=linear.num_key_heads,
        linear_num_value_heads=linear.num_value_heads,
        rope_parameters=dict(
            rope_type="default", rope_theta=model.rope_theta, partial_rotary_factor=model.rotary_percent
        ),
    )
    if model.family == "qwen3_next":
        hf.update(
            norm_topk_prob=model.moe_router_norm_topk,
            decoder_sparse_step=model.moe_layer_freq,
            mlp_only_layers=list(range(model.first_k_dense_layers)),
        )
        return hf
    if model.first_k_dense_layers or model.moe_layer_freq != 1 or not model.moe_router_norm_topk:
        raise ConversionError(
            "qwen3_5_moe has MoE in every layer, its top-k renormalised: needs model.first_k_dense_layers = 0, "
            "model.moe_layer_freq = 1, model.moe_router_norm_topk = true"
        )
    return hf
