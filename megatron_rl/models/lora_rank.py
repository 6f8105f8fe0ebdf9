"""The largest `model.lora.rank` a model takes: an adapter B A on a linear of n inputs and m outputs has rank at
most min(n, m), so a higher rank only adds parameters and time. Torch-free (read by the validation)."""

from __future__ import annotations

from megatron_rl.config import ConfigError, ModelConfig
from megatron_rl.models.families import moe_layer_pattern
from megatron_rl.models.lora_targets import LORA_TARGETS, Target


def _widths(model: ModelConfig, target: Target) -> tuple[int, int] | None:
    """(inputs, outputs) of the part of a linear `target` adapts; None when the model has no such layer."""
    hidden = model.hidden_size
    head_dim = model.kv_channels or hidden // model.num_attention_heads
    pattern = moe_layer_pattern(model)
    if target.linear.startswith("mlp.experts."):
        width = model.moe_ffn_hidden_size if any(pattern) else None
    elif target.linear.startswith("mlp."):
        width = model.ffn_hidden_size if not all(pattern) else None
    else:
        width = head_dim * (model.num_attention_heads if target.slot in ("q", "") else model.num_query_groups)
    if width is None:
        return None
    return (width, hidden) if target.linear.endswith(("linear_fc2", "linear_proj")) else (hidden, width)


def check_lora_rank(model: ModelConfig) -> None:
    """ConfigError naming `model.lora.rank`, its value and the bound when it exceeds min(inputs, outputs) of the
    narrowest linear `model.lora.target_modules` adapts."""
    names = set(model.lora.target_modules)
    adapted = [
        (min(widths), target.peft_name, widths)
        for target in LORA_TARGETS.get(model.family, ())
        if target.peft_name in names and (widths := _widths(model, target)) is not None
    ]
    if not adapted:
        return
    bound, name, (inputs, outputs) = min(adapted)
    if model.lora.rank > bound:
        raise ConfigError(
            f"model.lora.rank = {model.lora.rank} exceeds {bound}, the narrowest adapted layer's width ({name}: "
            f"{inputs} inputs, {outputs} outputs); an adapter's rank is at most min(inputs, outputs)"
        )
