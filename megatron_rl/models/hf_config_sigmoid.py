"""config.json <-> `model` for the sigmoid-router families: DeepSeek-V3 (also Kimi-K2, Moonlight,
DeepSeek-R1), GLM-4.5, and DeepSeek-V3's with DeepSeek sparse attention, DeepSeek-V3.2 and GLM-5 (their indexer's
keys: `hf_config_dsa`).

Every key of config.json is either mapped, checked against what the Megatron model computes, or
known not to be architecture (`_IGNORED`); any other key is refused by name, so a field this
mapping does not understand is never silently dropped. The same holds for the keys of
`rope_scaling` / `rope_parameters`.

- DeepSeek-V3: MLA (`q_lora_rank` null = one q_proj), yarn RoPE (`factor`, `mscale`,
  `mscale_all_dim`, `original_max_position_embeddings`, `beta_fast`, `beta_slow`) whose mscale also
  scales MLA's softmax, `first_k_dense_replace` dense layers, `n_shared_experts` shared experts,
  group-limited (`n_group`, `topk_group`) sigmoid routing with `e_score_correction_bias`,
  renormalised and scaled by `routed_scaling_factor`.
- GLM-4.5: GQA with q/k/v biases (`attention_bias`), optional QK-norm (`use_qk_norm`), partial
  RoPE (`partial_rotary_factor`), the same router.
- `num_nextn_predict_layers` (MTP) is read and dropped: those layers are not imported
  (`models.import_hf`) and the exported config.json says 0 (`mtp_dropped_config`).
"""

from __future__ import annotations

from typing import Any

from megatron_rl.models.hf_config import ConversionError, hf_bool, hf_float, hf_int, hf_section, refuse
from megatron_rl.models.hf_config_dsa import DSA_FAMILIES, DSA_KEYS, GLM_DSA_KEYS, dsa_fields, dsa_hf_config

SIGMOID_FAMILIES = ("deepseek_v3", "glm4_moe", *DSA_FAMILIES)
_HF_CLASS = {
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
}

# Keys that are not architecture (training, generation, tokenizer, loader and bookkeeping settings).
_IGNORED = frozenset(
    {
        "architectures", "model_type", "auto_map", "transformers_version", "torch_dtype", "dtype", "use_cache",
        "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id", "attention_dropout",
        "aux_loss_alpha", "seq_aux", "ep_size", "output_router_logits", "router_aux_loss_coef",
        "pretraining_tp", "num_nextn_predict_layers", "num_mtp_layers", "_name_or_path", "name_or_path",
        "tie_word_embeddings", "rms_norm_eps", "hidden_act", "vocab_size", "max_position_embeddings",
    }
)  # fmt: skip
_COMMON = frozenset(
    {
        "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "n_routed_experts", "num_local_experts", "n_shared_experts", "num_experts_per_tok",
        "first_k_dense_replace", "norm_topk_prob", "routed_scaling_factor", "n_group", "topk_group",
        "rope_theta", "rope_scaling", "rope_parameters", "attention_bias",
    }
)  # fmt: skip
_FAMILY_KEYS = {
    "deepseek_v3": frozenset(
        {
            "q_lora_rank",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "qk_head_dim",
            "head_dim",
            "scoring_func",
            "topk_method",
            "moe_layer_freq",
            "rope_interleave",
        }
    ),  # fmt: skip
    "glm4_moe": frozenset({"head_dim", "partial_rotary_factor", "use_qk_norm"}),
}
_FAMILY_KEYS["deepseek_v32"] = _FAMILY_KEYS["deepseek_v3"] | DSA_KEYS
_FAMILY_KEYS["glm_moe_dsa"] = _FAMILY_KEYS["deepseek_v32"] | GLM_DSA_KEYS
_YARN_KEYS = frozenset(
    {"type", "rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
     "mscale_all_dim", "rope_theta", "partial_rotary_factor", "truncate"}
)  # fmt: skip


def _rope_fields(hf: dict[str, Any], family: str, source: str) -> dict[str, Any]:
    """RoPE base, partial rotation and yarn scaling, from rope_scaling (Hub files) or rope_parameters
    (transformers 5)."""
    key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope, within = dict(hf_section(hf, source, key)), f"{source}: {key}"
    unknown = sorted(set(rope) - _YARN_KEYS)
    refuse(not unknown, source, f"{key}.{unknown[0] if unknown else ''} is not handled by the {family} mapping")
    theta = hf_float(rope, within, "rope_theta", default=None)
    if theta is None:
        refuse(hf.get("rope_theta") is not None, source, "missing key 'rope_theta' (or rope_parameters.rope_theta)")
        theta = hf_float(hf, source, "rope_theta")
    fields: dict[str, Any] = dict(rope_theta=theta)
    partial = hf_float(rope, within, "partial_rotary_factor", default=None)
    partial = hf_float(hf, source, "partial_rotary_factor", default=1.0) if partial is None else partial
    if family == "glm4_moe":
        fields["rotary_percent"] = partial
    else:
        refuse(partial == 1.0, source, f"partial_rotary_factor = {partial}: MLA rotates all of qk_rope_head_dim")
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        extra = sorted(set(rope) - {"type", "rope_type", "rope_theta", "partial_rotary_factor"})
        refuse(not extra, source, f"{key}.{extra[0] if extra else ''} is set but rope_type is 'default'")
        return fields
    refuse(kind == "yarn", source, f"{key} rope_type = {kind!r} is not supported (default or yarn)")
    refuse(
        family != "glm4_moe", source, f"{key} rope_type = 'yarn' is only supported for deepseek_v3 and the MLA families"
    )
    refuse(rope.get("truncate", True) is True, source, f"{key}.truncate = {rope.get('truncate')!r}: needs true")
    original = hf_int(rope, within, "original_max_position_embeddings")
    factor = hf_float(rope, within, "factor", default=None)
    factor = factor if factor is not None else hf_int(hf, source, "max_position_embeddings") / original
    mscale = hf_float(rope, within, "mscale", default=None)
    all_dim = hf_float(rope, within, "mscale_all_dim", default=None)
    # transformers uses mscale / mscale_all_dim only when both are non-zero, else attention factor
    # 0.1 ln(factor) + 1 (= Megatron's with mscale 1, mscale_all_dim 0); the softmax scale uses mscale_all_dim.
    if not (mscale and all_dim):
        refuse(
            not all_dim, source, f"{key}.mscale_all_dim = {all_dim} without mscale: the yarn attention factor differs"
        )
        mscale, all_dim = 1.0, 0.0
    fields.update(
        rope_scaling="yarn",
        yarn_factor=factor,
        yarn_original_max_position_embeddings=original,
        yarn_beta_fast=hf_float(rope, within, "beta_fast", default=None) or 32.0,
        yarn_beta_slow=hf_float(rope, within, "beta_slow", default=None) or 1.0,
        yarn_mscale=float(mscale),
        yarn_mscale_all_dim=float(all_dim),
    )
    return fields


def _router_fields(hf: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    experts = hf_int(hf, source, "n_routed_experts", "num_local_experts")
    topk = hf_int(hf, source, "num_experts_per_tok")
    dense = hf_int(hf, source, "first_k_dense_replace", default=0, minimum=0)
    refuse(dense < layers, source, f"first_k_dense_replace = {dense} leaves no MoE layer")
    norm = hf_bool(hf, source, "norm_topk_prob", default=True)
    refuse(norm or topk == 1, source, "norm_topk_prob = false with top-k > 1 is not supported (Megatron renormalises)")
    refuse(
        not (norm and topk == 1), source, "norm_topk_prob = true with num_experts_per_tok = 1 is not supported "
        "(transformers' gate is then 1, Megatron's the sigmoid score)",
    )  # fmt: skip
    shared = hf_int(hf, source, "n_shared_experts", default=0, minimum=0)
    width = hf_int(hf, source, "moe_intermediate_size")
    groups, group_topk = hf_int(hf, source, "n_group", default=1), hf_int(hf, source, "topk_group", default=1)
    fields: dict[str, Any] = dict(
        num_experts=experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=width,
        moe_router_norm_topk=True,
        first_k_dense_layers=dense,
        moe_layer_freq=1,
        moe_shared_expert_size=shared * width if shared else None,
        moe_router_scaling_factor=hf_float(hf, source, "routed_scaling_factor", default=1.0),
    )
    if 1 < groups and group_topk < groups:  # otherwise every group is always chosen: plain top-k
        refuse(
            topk // group_topk == 2,
            source,
            f"num_experts_per_tok // topk_group = {topk} // {group_topk} must be 2 (Megatron scores a group by its "
            "top (topk / topk_group) experts; DeepSeek by its top 2)",
        )
        fields.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk)
    return fields


def _mla_fields(hf: dict[str, Any], family: str, source: str) -> dict[str, Any]:
    nope, rope = hf_int(hf, source, "qk_nope_head_dim"), hf_int(hf, source, "qk_rope_head_dim")
    refuse(
        hf.get("qk_head_dim") in (None, nope + rope), source, f"qk_head_dim = {hf.get('qk_head_dim')} != {nope + rope}"
    )
    refuse(hf.get("head_dim") in (None, rope), source, f"head_dim = {hf.get('head_dim')} != qk_rope_head_dim ({rope})")
    refuse(hf.get("scoring_func", "sigmoid") == "sigmoid", source, f"scoring_func = {hf.get('scoring_func')!r}")
    method = hf.get("topk_method", "noaux_tc")
    refuse(method == "noaux_tc", source, f"topk_method = {method!r} is not supported (noaux_tc)")
    refuse(
        hf_int(hf, source, "moe_layer_freq", default=1) == 1,
        source,
        f"moe_layer_freq = {hf.get('moe_layer_freq')}: needs 1",
    )
    refuse(hf.get("rope_interleave", True) is True, source, "rope_interleave = false is not supported")
    refuse(not hf.get("attention_bias", False), source, f"attention_bias = true is not supported for {family}")
    q_lora = hf.get("q_lora_rank")
    return dict(
        q_lora_rank=None if q_lora is None else hf_int(hf, source, "q_lora_rank"),
        kv_lora_rank=hf_int(hf, source, "kv_lora_rank"),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=hf_int(hf, source, "v_head_dim"),
        qk_layernorm=True,
        add_qkv_bias=False,
    )


def sigmoid_model_fields(hf: dict[str, Any], family: str, source: str) -> dict[str, Any]:
    """The architecture fields of `ModelConfig` of a deepseek_v3 / glm4_moe / deepseek_v32 / glm_moe_dsa config.json."""
    unknown = sorted(set(hf) - _IGNORED - _COMMON - _FAMILY_KEYS[family])
    refuse(not unknown, source, f"{unknown[0] if unknown else ''} is not handled by the {family} mapping")
    act = hf.get("hidden_act", "silu")
    refuse(act == "silu", source, f"hidden_act = {act!r} is not supported (SwiGLU with silu only)")
    hidden, heads = hf_int(hf, source, "hidden_size"), hf_int(hf, source, "num_attention_heads")
    layers = hf_int(hf, source, "num_hidden_layers")
    fields: dict[str, Any] = dict(
        family=family,
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=hf_int(hf, source, "intermediate_size"),
        num_attention_heads=heads,
        vocab_size=hf_int(hf, source, "vocab_size"),
        max_position_embeddings=hf_int(hf, source, "max_position_embeddings"),
        norm_epsilon=hf_float(hf, source, "rms_norm_eps"),
        tie_word_embeddings=hf_bool(hf, source, "tie_word_embeddings", default=False),
    )
    fields.update(_rope_fields(hf, family, source))
    fields.update(_router_fields(hf, source, layers))
    if family in DSA_FAMILIES:
        fields.update(dsa_fields(hf, family, source, layers, fields["first_k_dense_layers"]))
    if family != "glm4_moe":
        fields.update(_mla_fields(hf, family, source), num_query_groups=heads, kv_channels=None)
    else:
        head_dim = hf_int(hf, source, "head_dim", default=hidden // heads)
        fields.update(
            num_query_groups=hf_int(hf, source, "num_key_value_heads", default=heads),
            kv_channels=None if head_dim * heads == hidden else head_dim,
            qk_layernorm=hf_bool(hf, source, "use_qk_norm", default=False),
            add_qkv_bias=hf_bool(hf, source, "attention_bias", default=False),
        )
    return fields


def sigmoid_hf_config(model: Any) -> dict[str, Any]:
    """The config.json keys (beyond the shared ones) that `transformers` needs for `model`."""
    hf: dict[str, Any] = dict(
        architectures=[_HF_CLASS[model.family]],
        model_type=model.family,
        n_routed_experts=model.num_experts,
        num_experts_per_tok=model.moe_router_topk,
        moe_intermediate_size=model.moe_ffn_hidden_size,
        n_shared_experts=(model.moe_shared_expert_size or 0) // model.moe_ffn_hidden_size,
        first_k_dense_replace=model.first_k_dense_layers,
        norm_topk_prob=True,
        routed_scaling_factor=model.moe_router_scaling_factor,
        n_group=model.moe_router_num_groups or 1,
        topk_group=model.moe_router_group_topk or 1,
        num_nextn_predict_layers=0,
    )
    if model.moe_shared_expert_size is not None and model.moe_shared_expert_size % model.moe_ffn_hidden_size:
        raise ConversionError(
            f"model.moe_shared_expert_size ({model.moe_shared_expert_size}) must be a multiple of "
            f"model.moe_ffn_hidden_size ({model.moe_ffn_hidden_size}) (n_shared_experts x moe_intermediate_size)"
        )
    rope: dict[str, Any] = dict(rope_type="default", rope_theta=model.rope_theta)
    if model.family in DSA_FAMILIES:
        hf.update(dsa_hf_config(model))
    if model.family != "glm4_moe":
        hf.update(
            q_lora_rank=model.q_lora_rank,
            kv_lora_rank=model.kv_lora_rank,
            qk_nope_head_dim=model.qk_nope_head_dim,
            qk_rope_head_dim=model.qk_rope_head_dim,
            v_head_dim=model.v_head_dim,
            head_dim=model.qk_rope_head_dim,
            num_key_value_heads=model.num_attention_heads,
            attention_bias=False,
            rope_interleave=True,
        )
        if model.rope_scaling == "yarn":
            rope.update(
                rope_type="yarn",
                factor=model.yarn_factor,
                original_max_position_embeddings=model.yarn_original_max_position_embeddings,
                beta_fast=model.yarn_beta_fast,
                beta_slow=model.yarn_beta_slow,
                mscale=model.yarn_mscale,
                mscale_all_dim=model.yarn_mscale_all_dim,
            )
    else:
        hf.update(attention_bias=model.add_qkv_bias, use_qk_norm=model.qk_layernorm)
        rope["partial_rotary_factor"] = model.rotary_percent
    hf["rope_parameters"] = rope
    return hf


def mtp_dropped_config(hf: dict[str, Any]) -> dict[str, Any]:
    """An exported config.json: the MTP layers are not exported, so it says there are none."""
    out = dict(hf)
    for key in ("num_nextn_predict_layers", "num_mtp_layers"):
        if out.get(key):
            out[key] = 0
    return out
