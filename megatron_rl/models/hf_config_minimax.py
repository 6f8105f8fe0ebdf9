"""config.json <-> `model` for MiniMax-M2 (`MiniMaxM2ForCausalLM`).

Every key of config.json is mapped, checked against what the Megatron model computes, or known not to
be architecture (`_IGNORED`); any other key is refused by name. The Hub files (MiniMaxAI/MiniMax-M2,
M2.1) and transformers 5 spell some settings differently: partial RoPE is `rotary_dim` (Hub) or
`rope_parameters.partial_rotary_factor` (transformers 5), the base `rope_theta` or
`rope_parameters.rope_theta`.

The architecture (transformers' `MiniMaxM2` modeling): GQA whose QK-norm is one RMSNorm over the whole
q projection (all heads) and one over the whole k projection, partial RoPE on the first dimensions
of each head (rotate-half), a sigmoid router whose scores plus `e_score_correction_bias` choose the
top-k experts, gates the chosen sigmoid scores renormalised; MoE in every layer (`intermediate_size` is
the expert width), no shared expert. Keys the Hub files carry for settings transformers does not
implement are accepted only at the value transformers' model computes with (`qk_norm_type`
"per_layer", `scoring_func` "sigmoid", full attention in every layer, no groups, scaling 1, ...).
"""

from __future__ import annotations

from typing import Any

from megatron_rl.models.hf_config import ConversionError, hf_int, partial_rope_fields, refuse, shared_fields

# Not architecture: training, generation, tokenizer, loader and bookkeeping settings. `mlp_intermediate_size`
# sizes a dense MLP that no layer has (every layer is MoE); the MTP keys describe layers that are not imported.
_IGNORED = frozenset(
    {
        "architectures", "model_type", "auto_map", "transformers_version", "torch_dtype", "dtype", "use_cache",
        "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id", "attention_dropout",
        "output_router_logits", "router_aux_loss_coef", "_name_or_path", "name_or_path", "max_model_len",
        "mlp_intermediate_size", "use_mtp", "num_mtp_modules", "mtp_transformer_layers", "swa_rope_theta",
    }
)  # fmt: skip
_MAPPED = frozenset(
    {
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "num_local_experts", "num_experts", "num_experts_per_tok", "rms_norm_eps", "vocab_size",
        "max_position_embeddings", "tie_word_embeddings", "rope_theta", "rotary_dim", "partial_rotary_factor",
        "rope_parameters", "rope_scaling", "hidden_act", "attn_type_list",
    }
)  # fmt: skip
# Settings transformers' MiniMaxM2 does not implement: accepted at the value its model computes with.
_FIXED: dict[str, tuple[Any, ...]] = {
    "use_qk_norm": (True,),
    "qk_norm_type": ("per_layer",),
    "scoring_func": ("sigmoid",),
    "use_routing_bias": (True,),
    "shared_intermediate_size": (0, None),
    "shared_moe_mode": ("sigmoid", None),
    "use_grouped_topk": (True, False, None),  # with one group (num_expert_group null) either is plain top-k
    "num_expert_group": (None, 1),
    "topk_group": (None, 1),
    "routed_scaling_factor": (1, 1.0, None),
    "router_jitter_noise": (0, 0.0, None),
    "layernorm_full_attention_beta": (1, 1.0, None),
    "layernorm_linear_attention_beta": (1, 1.0, None),
    "layernorm_mlp_beta": (1, 1.0, None),
    "sliding_window": (None,),
    "attn_window_size": (None,),
}
_ROPE_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})


def minimax_model_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The architecture fields of `ModelConfig` of a MiniMax-M2 config.json."""
    unknown = sorted(set(hf) - _IGNORED - _MAPPED - set(_FIXED))
    refuse(not unknown, source, f"{unknown[0] if unknown else ''} is not handled by the minimax_m2 mapping")
    for key, allowed in _FIXED.items():
        if key not in hf:  # transformers 5 writes none of them
            continue
        value = hf[key]
        ok = value in allowed and not (isinstance(value, bool) and not any(isinstance(a, bool) for a in allowed))
        refuse(ok, source, f"{key} = {value!r} is not supported (transformers' MiniMaxM2 computes with {allowed[0]!r})")
    attn_types = hf.get("attn_type_list")
    refuse(
        attn_types is None or (isinstance(attn_types, list) and all(t == 1 for t in attn_types)),
        source,
        f"attn_type_list = {attn_types!r}: only full attention (1) in every layer is supported",
    )
    act = hf.get("hidden_act", "silu")
    refuse(act == "silu", source, f"hidden_act = {act!r} is not supported (SwiGLU with silu only)")
    fields, head_dim = shared_fields(hf, source)
    fields.update(
        family="minimax_m2",
        qk_layernorm=True,
        add_qkv_bias=False,
        num_experts=hf_int(hf, source, "num_local_experts", "num_experts"),
        moe_router_topk=hf_int(hf, source, "num_experts_per_tok"),
        moe_ffn_hidden_size=fields["ffn_hidden_size"],
        moe_router_norm_topk=True,
        first_k_dense_layers=0,
        moe_layer_freq=1,
    )
    refuse(
        fields["moe_router_topk"] > 1, source, "num_experts_per_tok = 1 is not supported (transformers' gate is "
        "then 1, Megatron's the sigmoid score)",
    )  # fmt: skip
    fields.update(partial_rope_fields(hf, source, head_dim, keys=_ROPE_KEYS, default_partial=1.0, family="minimax_m2"))
    return fields


def minimax_hf_config(model: Any) -> dict[str, Any]:
    """The config.json keys (beyond the shared ones) that `transformers` needs for `model`."""
    if model.moe_ffn_hidden_size != model.ffn_hidden_size or model.first_k_dense_layers or model.moe_layer_freq != 1:
        raise ConversionError(
            "minimax_m2 has MoE in every layer and intermediate_size = the expert width: needs "
            "model.moe_ffn_hidden_size == model.ffn_hidden_size, model.first_k_dense_layers = 0, model.moe_layer_freq = 1"
        )
    return dict(
        num_local_experts=model.num_experts,
        num_experts_per_tok=model.moe_router_topk,
        rope_parameters=dict(
            rope_type="default", rope_theta=model.rope_theta, partial_rotary_factor=model.rotary_percent
        ),
    )
