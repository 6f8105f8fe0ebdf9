"""What each supported model family fixes about the architecture, and the MoE layer pattern."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config import ConfigError, ModelConfig


@dataclass(frozen=True)
class FamilySpec:
    """Switches a family fixes; `None` = free. Everything else (sizes, tying) comes from the config."""

    moe: bool
    qk_layernorm: bool
    add_qkv_bias: bool
    norm_topk: bool | None = None


FAMILIES: dict[str, FamilySpec] = {
    # Qwen3-MoE: softmax over all experts, top-k, renormalised when norm_topk_prob; QK-norm; no bias.
    "qwen3_moe": FamilySpec(moe=True, qk_layernorm=True, add_qkv_bias=False),
    # Qwen3 dense: QK-norm, no bias.
    "qwen3": FamilySpec(moe=False, qk_layernorm=True, add_qkv_bias=False),
    # Qwen2 dense: bias on the QKV projection only, no QK-norm.
    "qwen2": FamilySpec(moe=False, qk_layernorm=False, add_qkv_bias=True),
    # Mixtral: softmax of the top-k logits, which is the renormalised top-k softmax.
    "mixtral": FamilySpec(moe=True, qk_layernorm=False, add_qkv_bias=False, norm_topk=True),
}


def check_family(model: ModelConfig) -> FamilySpec:
    """The family's spec, or ConfigError naming the key that contradicts `model.family`."""
    if model.family not in FAMILIES:
        raise ConfigError(f"model.family = {model.family!r}; allowed: {sorted(FAMILIES)}")
    spec = FAMILIES[model.family]
    fam = f"model.family = {model.family!r}"
    if spec.moe and model.num_experts is None:
        raise ConfigError(f"{fam} is a mixture of experts: set model.num_experts")
    if not spec.moe and model.num_experts is not None:
        raise ConfigError(f"{fam} is dense: set model.num_experts = null (got {model.num_experts})")
    if model.qk_layernorm != spec.qk_layernorm:
        raise ConfigError(f"{fam} needs model.qk_layernorm = {str(spec.qk_layernorm).lower()}")
    if model.add_qkv_bias != spec.add_qkv_bias:
        raise ConfigError(f"{fam} needs model.add_qkv_bias = {str(spec.add_qkv_bias).lower()}")
    if spec.norm_topk is not None and model.moe_router_norm_topk != spec.norm_topk:
        raise ConfigError(f"{fam} needs model.moe_router_norm_topk = {str(spec.norm_topk).lower()}")
    return spec


def moe_layer_pattern(model: ModelConfig) -> list[int]:
    """1 for an MoE layer, 0 for a dense one, per layer (0-based index i).

    Layer i is MoE when i >= `first_k_dense_layers` and (i + 1) % `moe_layer_freq` == 0: Hugging
    Face's Qwen-MoE `decoder_sparse_step` rule, with DeepSeek-style leading dense layers.
    """
    if model.num_experts is None:
        return [0] * model.num_layers
    pattern = [
        int(i >= model.first_k_dense_layers and (i + 1) % model.moe_layer_freq == 0) for i in range(model.num_layers)
    ]
    if not any(pattern):
        raise ConfigError(
            f"model.moe_layer_freq ({model.moe_layer_freq}) with model.first_k_dense_layers "
            f"({model.first_k_dense_layers}) leaves no MoE layer in model.num_layers ({model.num_layers})"
        )
    return pattern
