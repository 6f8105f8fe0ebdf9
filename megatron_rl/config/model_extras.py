"""Three sub-sections of `model`: `lora` (low-rank adapters), `fusions` (fused kernels) and `linear_attention` (the
Gated DeltaNet layers of Qwen3-Next and Qwen3.5), kept apart from `schema.py` for its length."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from megatron_rl.config.fields import described as _f

Switch = Literal["auto", True, False]


@dataclass
class LoraConfig:
    """Low-rank adapters (LoRA) on the frozen policy: W x + (alpha / rank) B A x (megatron_rl.models.lora)."""

    rank: int = _f(0, "adapter rank r; 0 = off (the whole policy trains)", ge=0)
    alpha: float = _f(16.0, "LoRA alpha: the update is scaled by alpha / rank", gt=0)
    dropout: float = _f(0.0, "dropout on the adapters' input (training forwards only)", ge=0, lt=1)
    target_modules: list = _f(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "the family's PEFT module names that get adapters (attention projections, dense MLP, routed experts; "
        "megatron_rl.models.lora_targets lists them per family)",
    )
    init_path: str | None = _f(
        None, "a PEFT adapter folder (adapter_config.json, adapter_model.safetensors) of the same base to start from"
    )


@dataclass
class FusionConfig:
    """Megatron's fused kernels (megatron_rl.models.fusion_choice): auto = on where the kernel runs and supports the
    model (Transformer Engine's specs on CUDA), false = off, true = on or refused naming why it cannot run."""

    apply_rope_fusion: Switch = _f("auto", "Transformer Engine's fused RoPE (not with yarn or MLA)")
    bias_activation_fusion: Switch = _f("auto", "Megatron's fused SwiGLU in the MLPs (not gpt_oss's or Gemma's gates)")
    masked_softmax_fusion: Switch = _f("auto", "fused scale-mask-softmax of the attention")
    moe_permute_fusion: Switch = _f("auto", "Transformer Engine's fused token permutation of the MoE dispatchers")
    moe_router_fusion: Switch = _f(
        "auto", "Transformer Engine's fused top-k router (not with routing replay, which it bypasses)"
    )


@dataclass
class LinearAttentionConfig:
    """Gated DeltaNet layers (Qwen3-Next, Qwen3.5: megatron_rl.models.gated_delta) between full-attention ones."""

    full_attention_interval: int | None = _f(
        None, "layers n, 2n, ... full attention, the others Gated DeltaNet; null = no linear attention", ge=1
    )
    conv_kernel: int = _f(4, "width of the causal convolution over q, k, v (linear_conv_kernel_dim)", ge=1)
    key_head_dim: int = _f(128, "query/key head width (linear_key_head_dim)", ge=1)
    value_head_dim: int = _f(128, "value/gate head width (linear_value_head_dim)", ge=1)
    num_key_heads: int = _f(16, "query/key heads (linear_num_key_heads)", ge=1)
    num_value_heads: int = _f(32, "value heads, a multiple of the key heads (linear_num_value_heads)", ge=1)


def linear_attention_section() -> Any:
    """`model.linear_attention`'s field (defaults: no linear attention)."""
    return field(
        default_factory=LinearAttentionConfig, metadata={"help": "Gated DeltaNet layers (qwen3_next, qwen3_5_moe)"}
    )
