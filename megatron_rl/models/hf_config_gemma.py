"""config.json <-> `model` for Gemma 2 (`Gemma2ForCausalLM`, model_type gemma2) and Gemma 3's text model
(`Gemma3ForCausalLM`, model_type gemma3_text).

Every key of config.json is mapped, checked against what the Megatron model computes, or known not to be
architecture (`_IGNORED`); any other key is refused by name, never dropped. A key left out means what
transformers' config class defaults it to (Gemma 2: soft-capping 50 / 30, a window of 4096 on every other
layer; Gemma 3: no soft-capping, every 6th layer full, RoPE bases 1e6 and 1e4; both: head_dim 256,
query_pre_attn_scalar 256, the tanh GELU). The Hub files and transformers 5 spell RoPE differently:
`rope_theta` (+ Gemma 3's `rope_local_base_freq` and `rope_scaling`) or `rope_parameters` (Gemma 3: one
per layer type, `full_attention` and `sliding_attention`).

What the Megatron model computes (`models.gemma`): embeddings times sqrt(hidden_size), (1 + weight) RMSNorms,
a norm after the attention and after the MLP, a tanh-GELU GLU, scores scaled by query_pre_attn_scalar ** -0.5,
layers of `layer_types` (every n-th full, the others attending to the last `sliding_window` keys, the query's
own included); Gemma 2: attention and final logit soft-capping; Gemma 3: (1 + weight) QK-norm, the sliding
layers' own RoPE base, linear RoPE scaling on the full layers, final logit soft-capping when set.
Refused: biases (`attention_bias`), another activation, bidirectional attention (Gemma 3's embedding models),
other RoPE types, Gemma 3's `attn_logit_softcapping` (transformers' Gemma 3 attention does not apply it).
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

_IGNORED = frozenset(
    {
        "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
        "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id", "attention_dropout",
        "cache_implementation", "_name_or_path", "name_or_path", "chunk_size_feed_forward", "id2label", "label2id",
        "is_encoder_decoder", "output_attentions", "output_hidden_states", "problem_type", "return_dict",
    }
)  # fmt: skip
_MAPPED = frozenset(
    {
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "hidden_activation", "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_theta",
        "rope_parameters", "rope_scaling", "tie_word_embeddings", "vocab_size", "attention_bias",
        "query_pre_attn_scalar", "sliding_window", "layer_types", "final_logit_softcapping",
        "attn_logit_softcapping", "use_bidirectional_attention",
    }
)  # fmt: skip
_GEMMA3_KEYS = frozenset({"rope_local_base_freq", "sliding_window_pattern", "_sliding_window_pattern"})
_GELU_TANH = "gelu_pytorch_tanh"
_ROPE_KEYS = frozenset({"rope_type", "type", "rope_theta", "factor"})
# transformers' defaults for what a config.json may leave out, per family
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0, pattern=2),
    "gemma3_text": dict(attn_logit_softcapping=None, final_logit_softcapping=None, pattern=6),
}


def _optional_float(hf: dict[str, Any], source: str, key: str, default: float | None) -> float | None:
    """The number of `key`, None when it is null, `default` when it is absent."""
    if key not in hf:
        return default
    return None if hf[key] is None else hf_float(hf, source, key)


def _rope(section: dict[str, Any], within: str, kinds: tuple[str, ...]) -> tuple[float | None, str, float]:
    """(rope_theta or None, rope type, linear factor) of one RoPE section, its keys and type checked."""
    unknown = sorted(set(section) - _ROPE_KEYS)
    if unknown:
        raise ConversionError(f"{within}.{unknown[0]} is not handled by the Gemma mapping")
    kind = section.get("rope_type") or section.get("type") or "default"
    if kind not in kinds:
        raise ConversionError(f"{within} rope_type = {kind!r} is not supported ({' or '.join(kinds)})")
    if kind == "default" and "factor" in section:
        raise ConversionError(f"{within}.factor is not handled with rope_type 'default'")
    factor = hf_float(section, within, "factor") if kind == "linear" else 1.0
    return hf_float(section, within, "rope_theta", default=None), kind, factor


def _rope_fields(hf: dict[str, Any], family: str, source: str) -> dict[str, Any]:
    """RoPE of the full layers (base, linear scaling) and, Gemma 3, the sliding layers' base."""
    params = hf_section(hf, source, "rope_parameters")
    if family == "gemma2":
        key = "rope_parameters" if params else "rope_scaling"
        theta, _, _ = _rope(hf_section(hf, source, key), f"{source}: {key}", ("default",))
        return dict(rope_theta=hf_float(hf, source, "rope_theta", default=1e4) if theta is None else theta)
    if params:  # transformers 5: one section per layer type
        unknown = sorted(set(params) - set(LAYER_TYPES))
        refuse(
            not unknown,
            source,
            f"rope_parameters.{unknown[0] if unknown else ''} is not a layer type (gemma3_text's rope_parameters holds "
            "one section per layer type: full_attention, sliding_attention)",
        )
        full, local = (
            hf_section(params, f"{source}: rope_parameters", t) for t in ("full_attention", "sliding_attention")
        )
        theta, kind, factor = _rope(full, f"{source}: rope_parameters.full_attention", ("default", "linear"))
        local_theta, _, _ = _rope(local, f"{source}: rope_parameters.sliding_attention", ("default",))
    else:  # the Hub's files: rope_theta, rope_local_base_freq, rope_scaling (the full layers')
        theta, kind, factor = _rope(
            hf_section(hf, source, "rope_scaling"), f"{source}: rope_scaling", ("default", "linear")
        )
        local_theta = None
    theta = hf_float(hf, source, "rope_theta", default=1e6) if theta is None else theta
    local_theta = hf_float(hf, source, "rope_local_base_freq", default=1e4) if local_theta is None else local_theta
    fields: dict[str, Any] = dict(rope_theta=theta, rope_local_theta=local_theta)
    if kind == "linear":
        fields.update(rope_scaling="linear", rope_linear_factor=factor)
    return fields


def _window_fields(hf: dict[str, Any], family: str, source: str, layers: int) -> dict[str, Any]:
    """`sliding_window` and the layer pattern of `layer_types` (or Gemma 3's sliding_window_pattern): every n-th
    layer full, the others sliding."""
    patterns = {k: hf_int(hf, source, k) for k in ("sliding_window_pattern", "_sliding_window_pattern") if k in hf}
    default = next(iter(patterns.values()), _DEFAULTS[family]["pattern"])
    types = hf.get("layer_types")
    if types is None:  # transformers' default
        types = [LAYER_TYPES[(i + 1) % default == 0] for i in range(layers)]
    pattern = full_layer_period(types, layers, source)
    if pattern is None:  # no layer slides: sliding_window is not used
        return dict(sliding_window=None)
    every_layer_slides = pattern > layers
    for key, value in patterns.items():
        refuse(
            value == pattern or every_layer_slides,
            source,
            f"{key} = {value} contradicts layer_types (every {pattern}th full)",
        )
    window = hf.get("sliding_window", 4096)
    refuse(window is not None, source, "sliding_window = null, but layer_types has sliding_attention layers")
    return dict(sliding_window=hf_int(hf, source, "sliding_window", default=4096), sliding_window_pattern=pattern)


def gemma_model_fields(hf: dict[str, Any], family: str, source: str) -> dict[str, Any]:
    """The architecture fields of `ModelConfig` of a gemma2 / gemma3_text config.json."""
    allowed = _MAPPED | (_GEMMA3_KEYS if family == "gemma3_text" else frozenset())
    unknown = sorted(set(hf) - _IGNORED - allowed)
    refuse(not unknown, source, f"{unknown[0] if unknown else ''} is not handled by the {family} mapping")
    act = hf.get("hidden_activation") or _GELU_TANH
    refuse(act == _GELU_TANH, source, f"hidden_activation = {act!r} is not supported ({_GELU_TANH} only)")
    other = hf.get("hidden_act")
    refuse(other in (None, act), source, f"hidden_act = {other!r} contradicts hidden_activation = {act!r}")
    refuse(not hf_bool(hf, source, "attention_bias", default=False), source, "attention_bias = true is not supported")
    refuse(
        not hf.get("use_bidirectional_attention"),
        source,
        "use_bidirectional_attention = true is not supported (causal attention only)",
    )
    defaults = _DEFAULTS[family]
    attn_cap = _optional_float(hf, source, "attn_logit_softcapping", defaults["attn_logit_softcapping"])
    refuse(
        family == "gemma2" or attn_cap is None,
        source,
        f"attn_logit_softcapping = {attn_cap!r} is not supported for gemma3_text: transformers' Gemma 3 attention does "
        "not apply it (set it to null)",
    )
    fields, _ = shared_fields(hf, source, head_dim=256, kv_heads=False, tied=True)
    layers = fields["num_layers"]
    fields.update(
        family=family,
        qk_layernorm=family == "gemma3_text",
        add_qkv_bias=False,
        num_experts=None,
        query_pre_attn_scalar=hf_int(hf, source, "query_pre_attn_scalar", default=256),
        attn_logit_softcapping=attn_cap,
        final_logit_softcapping=_optional_float(
            hf, source, "final_logit_softcapping", defaults["final_logit_softcapping"]
        ),
    )
    fields.update(_rope_fields(hf, family, source))
    fields.update(_window_fields(hf, family, source, layers))
    return fields


def gemma_hf_config(model: Any) -> dict[str, Any]:
    """The config.json keys (beyond the shared ones, `hidden_act` and `rope_theta` replaced) that `transformers`
    needs for `model`."""
    window, n = model.sliding_window, model.sliding_window_pattern
    full: dict[str, Any] = dict(rope_type="default", rope_theta=model.rope_theta)
    if model.rope_scaling == "linear":
        full.update(rope_type="linear", factor=model.rope_linear_factor)
    rope: dict[str, Any] = full
    if model.family == "gemma3_text":
        local = dict(rope_type="default", rope_theta=model.rope_local_theta or model.rope_theta)
        rope = dict(full_attention=full, sliding_attention=local)
    head_dim = model.kv_channels or model.hidden_size // model.num_attention_heads
    return dict(
        hidden_activation=_GELU_TANH,
        attention_bias=False,
        use_bidirectional_attention=False,
        query_pre_attn_scalar=model.query_pre_attn_scalar or head_dim,
        attn_logit_softcapping=model.attn_logit_softcapping,
        final_logit_softcapping=model.final_logit_softcapping,
        # transformers builds the sliding layers' mask even when no layer slides, which needs a window
        sliding_window=window or model.max_position_embeddings,
        layer_types=[LAYER_TYPES[window is None or (i + 1) % n == 0] for i in range(model.num_layers)],
        rope_parameters=rope,
    )
