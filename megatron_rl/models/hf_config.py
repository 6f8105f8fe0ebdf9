"""The `model` config of a Hugging Face checkpoint (from its config.json), and the reverse.

Every value the architecture needs is derived (family from `architectures`, layers, widths, heads,
KV groups, head dim, experts, top-k, MoE layer pattern, RoPE base, norm epsilon, vocabulary,
tying); an HF setting the Megatron model cannot reproduce (another activation, RoPE scaling,
sliding-window attention, biases the family does not have) raises `ConversionError` naming the
config.json key (the sigmoid-router families: `hf_config_sigmoid`, with DeepSeek sparse attention's keys in `hf_config_dsa`; Llama and Mistral: `hf_config_dense`; MiniMax-M2:
`hf_config_minimax`; gpt-oss: `hf_config_gpt_oss`; Gemma 2 and Gemma 3: `hf_config_gemma`; Qwen3-Next and Qwen3.5:
`hf_config_qwen3_next`).
Fields that are not architecture (dtype, dispatcher, recompute, aux-loss weight) keep the `ModelConfig`
defaults unless passed as overrides.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from megatron_rl.config import Config, ConfigError, ModelConfig, check_rules

ARCHITECTURES: dict[str, str] = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "MixtralForCausalLM": "mixtral",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Glm4MoeForCausalLM": "glm4_moe",
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "GlmMoeDsaForCausalLM": "glm_moe_dsa",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MiniMaxM2ForCausalLM": "minimax_m2",
    "GptOssForCausalLM": "gpt_oss",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
}
# Architectures refused by name, and why.
UNSUPPORTED_ARCHITECTURES: dict[str, str] = {
    "Gemma3ForConditionalGeneration": (
        "Gemma 3's vision-language model (a SigLIP vision tower and projector, the text model under "
        "model.language_model); its text model converts as Gemma3ForCausalLM (model_type gemma3_text)"
    ),
    "Qwen3_5MoeForConditionalGeneration": (
        "Qwen3.5's vision-language model (a vision tower, the text model under model.language_model); its text "
        "model converts as Qwen3_5MoeForCausalLM (model_type qwen3_5_moe_text, text_config's keys)"
    ),
}
_HF_CLASS = {family: arch for arch, family in ARCHITECTURES.items()}
_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_DTYPE_NAMES = {short: long for long, short in _DTYPES.items()}


class ConversionError(ValueError):
    """A checkpoint or config that cannot be converted; the message names the culprit."""


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    """The parsed `config.json` of an HF model folder: a JSON object (ConversionError naming the file otherwise)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConversionError(f"{folder}: no config.json (not a Hugging Face model folder)")
    try:
        hf = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConversionError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(hf, dict):
        raise ConversionError(f"{path}: the top level is a JSON {type(hf).__name__}, not an object of settings")
    return hf


def family_of(hf: dict[str, Any], source: str = "config.json") -> str:
    """The model family named by `architectures`."""
    archs = hf.get("architectures") or []
    if not isinstance(archs, list) or len(archs) != 1:
        raise ConversionError(f"{source}: architectures = {archs!r}; expected one of {sorted(ARCHITECTURES)}")
    if archs[0] in UNSUPPORTED_ARCHITECTURES:
        raise ConversionError(
            f"{source}: architectures = {archs!r} is not supported: {UNSUPPORTED_ARCHITECTURES[archs[0]]}"
        )
    if archs[0] not in ARCHITECTURES:
        raise ConversionError(
            f"{source}: architectures = {archs!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        )
    return ARCHITECTURES[archs[0]]


def _get(hf: dict[str, Any], source: str, *keys: str, default: Any = ...) -> Any:
    for key in keys:
        if hf.get(key) is not None:
            return hf[key]
    if default is ...:
        raise ConversionError(f"{source}: missing key {keys[0]!r}")
    return default


def _found(hf: dict[str, Any], keys: tuple[str, ...]) -> str:
    return next((key for key in keys if hf.get(key) is not None), keys[0])


def hf_int(hf: dict[str, Any], source: str, *keys: str, default: Any = ..., minimum: int = 1) -> int:
    """The integer >= `minimum` of the first of `keys` set in `hf` (else `default`, as given; ConversionError when
    none is set and there is no default); ConversionError naming the key when the value is anything else."""
    key = _found(hf, keys)
    if hf.get(key) is None:
        return _get(hf, source, *keys, default=default)  # the default, or the missing key named
    value = hf[key]
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not number or value != int(value) or value < minimum:
        raise ConversionError(f"{source}: {key} = {value!r} is not an integer >= {minimum}")
    return int(value)


def hf_float(hf: dict[str, Any], source: str, *keys: str, default: Any = ...) -> float:
    """The finite number of the first of `keys` set in `hf` (else `default`, as given), as `hf_int`."""
    key = _found(hf, keys)
    if hf.get(key) is None:
        return _get(hf, source, *keys, default=default)
    value = hf[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConversionError(f"{source}: {key} = {value!r} is not a finite number")
    return float(value)


def hf_bool(hf: dict[str, Any], source: str, key: str, default: bool) -> bool:
    """The true/false of `key` in `hf` (`default` when unset); ConversionError naming it for any other value."""
    value = _get(hf, source, key, default=default)
    if not isinstance(value, bool):
        raise ConversionError(f"{source}: {key} = {value!r} is not true or false")
    return value


def shared_fields(
    hf: dict[str, Any], source: str, *, head_dim: int | None = None, kv_heads: bool = True, tied: bool = False
) -> tuple[dict[str, Any], int]:
    """The `model` fields every family reads alike from config.json (layers, widths, heads, vocabulary, positions,
    norm epsilon, tied embeddings), and the attention head width. `head_dim`: the width when config.json has no
    `head_dim` (None: hidden_size / heads); `kv_heads`: a missing `num_key_value_heads` means one per head (False:
    it is required); `tied`: `tie_word_embeddings` when unset."""
    hidden, heads = hf_int(hf, source, "hidden_size"), hf_int(hf, source, "num_attention_heads")
    width = hf_int(hf, source, "head_dim", default=head_dim or hidden // heads)
    fields = dict(
        num_layers=hf_int(hf, source, "num_hidden_layers"),
        hidden_size=hidden,
        ffn_hidden_size=hf_int(hf, source, "intermediate_size"),
        num_attention_heads=heads,
        num_query_groups=hf_int(hf, source, "num_key_value_heads", **({"default": heads} if kv_heads else {})),
        kv_channels=None if width * heads == hidden else width,
        vocab_size=hf_int(hf, source, "vocab_size"),
        max_position_embeddings=hf_int(hf, source, "max_position_embeddings"),
        norm_epsilon=hf_float(hf, source, "rms_norm_eps"),
        tie_word_embeddings=hf_bool(hf, source, "tie_word_embeddings", default=tied),
    )
    return fields, width


def hf_section(hf: dict[str, Any], source: str, key: str) -> dict[str, Any]:
    """The object `hf[key]` ({} when unset or null); ConversionError naming the key for any other value."""
    value = hf.get(key) or {}
    if not isinstance(value, dict):
        raise ConversionError(f"{source}: {key} = {value!r} is not an object of settings")
    return value


def _rope_theta(hf: dict[str, Any], source: str) -> float:
    params = hf_section(hf, source, "rope_parameters")
    scaling = hf_section(hf, source, "rope_scaling")
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        key = "rope_parameters" if params else "rope_scaling"
        raise ConversionError(f"{source}: {key} rope_type = {kind!r} is not supported (only plain RoPE)")
    if params.get("rope_theta") is not None:
        return hf_float(params, f"{source}: rope_parameters", "rope_theta")
    if hf.get("rope_theta") is None:
        raise ConversionError(f"{source}: missing key 'rope_theta' (or rope_parameters.rope_theta)")
    return hf_float(hf, source, "rope_theta")


def partial_rope_fields(
    hf: dict[str, Any], source: str, head_dim: int, *, keys: frozenset[str], default_partial: float, family: str
) -> dict[str, Any]:
    """`rope_theta` and `rotary_percent` of a plain RoPE on part of each head: from `rope_parameters`
    (transformers 5) or `rope_scaling`, else config.json's top-level `rope_theta`, `partial_rotary_factor` or
    `rotary_dim`; a section key outside `keys`, a scaled RoPE or an odd number of rotated dimensions is refused."""
    key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope, within = hf_section(hf, source, key), f"{source}: {key}"
    unknown = sorted(set(rope) - keys)
    refuse(not unknown, source, f"{key}.{unknown[0] if unknown else ''} is not handled by the {family} mapping")
    kind = rope.get("rope_type") or rope.get("type") or "default"
    refuse(kind == "default", source, f"{key} rope_type = {kind!r} is not supported (plain RoPE only)")
    theta = hf_float(rope, within, "rope_theta", default=None)
    theta = hf_float(hf, source, "rope_theta") if theta is None else theta
    partial = hf_float(rope, within, "partial_rotary_factor", default=None)
    if partial is None and hf.get("rotary_dim") is not None:
        partial = hf_int(hf, source, "rotary_dim") / head_dim
    partial = hf_float(hf, source, "partial_rotary_factor", default=default_partial) if partial is None else partial
    rotated = partial * head_dim
    refuse(
        0 < partial <= 1 and rotated == int(rotated) and int(rotated) % 2 == 0,
        source,
        f"partial_rotary_factor {partial} x head_dim {head_dim} is not an even number of rotated dimensions",
    )
    return dict(rope_theta=theta, rotary_percent=partial)


def refuse(ok: bool, source: str, message: str) -> None:
    """ConversionError `source: message` unless `ok` (the families' config.json readers)."""
    if not ok:
        raise ConversionError(f"{source}: {message}")


LAYER_TYPES = ("sliding_attention", "full_attention")  # config.json's `layer_types`


def full_layer_period(types: Any, layers: int, source: str) -> int | None:
    """n of `layer_types` read as every n-th layer full attention and the others sliding (n > `layers`: every
    layer slides); None when no layer slides. ConversionError naming `layer_types` for any other list."""
    refuse(
        isinstance(types, list) and len(types) == layers and all(t in LAYER_TYPES for t in types),
        source,
        f"layer_types = {types!r} is not a list of {layers} of {list(LAYER_TYPES)}",
    )
    if "sliding_attention" not in types:
        return None
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    period = full[0] + 1 if full else layers + 1  # past the last layer: every layer slides
    refuse(
        period >= 2 and full == list(range(period - 1, layers, period)),
        source,
        f"layer_types = {types!r} is not supported: every n-th layer full (n >= 2), the others sliding",
    )
    return period


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConversionError(message)


def _moe_fields(hf: dict[str, Any], family: str, source: str, num_layers: int) -> dict[str, Any]:
    experts = hf_int(hf, source, "num_experts", "num_local_experts")
    fields: dict[str, Any] = dict(num_experts=experts, moe_router_topk=hf_int(hf, source, "num_experts_per_tok"))
    if family == "mixtral":
        fields.update(moe_ffn_hidden_size=hf_int(hf, source, "intermediate_size"), moe_router_norm_topk=True)
        return fields
    listed = hf.get("mlp_only_layers") or []
    _require(
        isinstance(listed, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in listed),
        f"{source}: mlp_only_layers = {listed!r} is not a list of layer numbers",
    )
    dense = sorted(listed)
    _require(
        dense == list(range(len(dense))),
        f"{source}: mlp_only_layers = {dense} is not supported (only leading dense layers [0, ..., k-1])",
    )
    _require(len(dense) < num_layers, f"{source}: mlp_only_layers = {dense} leaves no MoE layer")
    fields.update(
        moe_ffn_hidden_size=hf_int(hf, source, "moe_intermediate_size"),
        moe_router_norm_topk=hf_bool(hf, source, "norm_topk_prob", default=False),
        moe_layer_freq=hf_int(hf, source, "decoder_sparse_step", default=1),
        first_k_dense_layers=len(dense),
    )
    return fields


def model_config_from_hf(
    hf: dict[str, Any], *, hf_path: str | None = None, source: str = "config.json", **overrides: Any
) -> ModelConfig:
    """The `model` config of an HF config.json dict; `overrides` set other ModelConfig fields."""
    family = family_of(hf, source)
    if family in ("deepseek_v3", "glm4_moe", "deepseek_v32", "glm_moe_dsa"):
        from megatron_rl.models.hf_config_sigmoid import sigmoid_model_fields

        return _finish(sigmoid_model_fields(hf, family, source), hf, hf_path, source, overrides)
    if family in ("llama", "mistral"):
        from megatron_rl.models.hf_config_dense import dense_model_fields

        return _finish(dense_model_fields(hf, family, source), hf, hf_path, source, overrides)
    if family == "minimax_m2":
        from megatron_rl.models.hf_config_minimax import minimax_model_fields

        return _finish(minimax_model_fields(hf, source), hf, hf_path, source, overrides)
    if family == "gpt_oss":
        from megatron_rl.models.hf_config_gpt_oss import gpt_oss_model_fields

        return _finish(gpt_oss_model_fields(hf, source), hf, hf_path, source, overrides)
    if family in ("qwen3_next", "qwen3_5_moe"):
        from megatron_rl.models.hf_config_qwen3_next import qwen3_next_model_fields

        return _finish(qwen3_next_model_fields(hf, family, source), hf, hf_path, source, overrides)
    if family in ("gemma2", "gemma3_text"):
        from megatron_rl.models.hf_config_gemma import gemma_model_fields

        return _finish(gemma_model_fields(hf, family, source), hf, hf_path, source, overrides)
    act = hf.get("hidden_act", "silu")
    _require(act == "silu", f"{source}: hidden_act = {act!r} is not supported (SwiGLU with silu only)")
    if hf.get("use_sliding_window") or (family == "mixtral" and hf.get("sliding_window") is not None):
        key = "use_sliding_window" if hf.get("use_sliding_window") else "sliding_window"
        raise ConversionError(f"{source}: {key} = {hf[key]!r}: sliding-window attention is not supported")
    if family in ("qwen3", "qwen3_moe"):
        _require(
            not hf.get("attention_bias", False),
            f"{source}: attention_bias = true is not supported for {family} (biases on q/k/v and o_proj)",
        )
    fields, _ = shared_fields(hf, source)
    fields.update(
        family=family,
        hf_path=hf_path,
        rope_theta=_rope_theta(hf, source),
        qk_layernorm=family in ("qwen3", "qwen3_moe"),
        add_qkv_bias=family == "qwen2",
        num_experts=None,
    )
    if family in ("qwen3_moe", "mixtral"):
        fields.update(_moe_fields(hf, family, source, fields["num_layers"]))
    return _finish(fields, hf, hf_path, source, overrides)


def _finish(
    fields: dict[str, Any], hf: dict[str, Any], hf_path: str | None, source: str, overrides: dict[str, Any]
) -> ModelConfig:
    """The ModelConfig of the derived `fields`, the checkpoint's dtype and the `overrides`, checked."""
    fields["hf_path"] = hf_path
    dtype = _DTYPES.get(str(hf.get("dtype") or hf.get("torch_dtype") or ""))
    if dtype is not None:
        fields["params_dtype"] = dtype
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(ModelConfig)})
    _require(not unknown, f"model_config_from_hf: unknown ModelConfig fields {unknown}")
    fields.update(overrides)
    model = ModelConfig(**fields)
    from megatron_rl.models.families import check_family

    try:
        check_family(model)
        check_rules(Config(model=model))
    except ConfigError as err:
        raise ConversionError(f"{source}: {err}") from None
    return model


def hf_config_from_model(model: ModelConfig) -> dict[str, Any]:
    """A config.json dict that `transformers` loads as the architecture of `model`."""
    from megatron_rl.models.families import check_family

    check_family(model)
    head_dim = model.kv_channels or model.hidden_size // model.num_attention_heads
    hf: dict[str, Any] = dict(
        architectures=[_HF_CLASS[model.family]],
        model_type=model.family,
        vocab_size=model.vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.ffn_hidden_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_query_groups,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=model.max_position_embeddings,
        rms_norm_eps=model.norm_epsilon,
        rope_theta=model.rope_theta,
        tie_word_embeddings=model.tie_word_embeddings,
        attention_dropout=0.0,
        dtype=_DTYPE_NAMES[model.params_dtype],
    )
    if model.family in ("qwen3", "qwen3_moe"):
        hf["attention_bias"] = False
    if model.family in ("deepseek_v3", "glm4_moe", "deepseek_v32", "glm_moe_dsa"):
        from megatron_rl.models.hf_config_sigmoid import sigmoid_hf_config

        hf.pop("rope_theta")
        hf.update(sigmoid_hf_config(model))
    elif model.family in ("llama", "mistral"):
        from megatron_rl.models.hf_config_dense import dense_hf_config

        hf.pop("rope_theta")
        hf.update(dense_hf_config(model))
    elif model.family == "minimax_m2":
        from megatron_rl.models.hf_config_minimax import minimax_hf_config

        hf.pop("rope_theta")
        hf.update(minimax_hf_config(model))
    elif model.family == "gpt_oss":
        from megatron_rl.models.hf_config_gpt_oss import gpt_oss_hf_config

        hf.pop("rope_theta")
        hf.update(gpt_oss_hf_config(model))
    elif model.family in ("qwen3_next", "qwen3_5_moe"):
        from megatron_rl.models.hf_config_qwen3_next import qwen3_next_hf_config

        hf.pop("rope_theta")
        hf.update(qwen3_next_hf_config(model))
        if model.family == "qwen3_5_moe":  # every layer MoE: no dense width
            hf.pop("intermediate_size")
    elif model.family in ("gemma2", "gemma3_text"):
        from megatron_rl.models.hf_config_gemma import gemma_hf_config

        hf.pop("rope_theta")
        hf.pop("hidden_act")
        hf.update(gemma_hf_config(model))
    elif model.family == "qwen3_moe":
        hf.update(
            num_experts=model.num_experts,
            num_experts_per_tok=model.moe_router_topk,
            moe_intermediate_size=model.moe_ffn_hidden_size,
            norm_topk_prob=model.moe_router_norm_topk,
            decoder_sparse_step=model.moe_layer_freq,
            mlp_only_layers=list(range(model.first_k_dense_layers)),
        )
    elif model.family == "mixtral":
        if (
            model.moe_ffn_hidden_size != model.ffn_hidden_size
            or model.first_k_dense_layers
            or model.moe_layer_freq != 1
        ):
            raise ConversionError(
                "mixtral has MoE in every layer and intermediate_size = the expert width: needs "
                "model.moe_ffn_hidden_size == model.ffn_hidden_size, model.first_k_dense_layers = 0, "
                "model.moe_layer_freq = 1"
            )
        hf.update(num_local_experts=model.num_experts, num_experts_per_tok=model.moe_router_topk, sliding_window=None)
    return hf
