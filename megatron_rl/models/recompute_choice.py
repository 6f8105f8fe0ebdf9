"""Activation recompute (`model.recompute`, `model.recompute_modules`) as Megatron's TransformerConfig fields;
torch-free, so the validation reads it.

- `full` (or `true`): every transformer layer recomputed whole in backward (granularity full, uniform, one layer).
- `selective`: Megatron-Core's submodules listed in `model.recompute_modules`, each checkpointed where its layer
  runs it. With the local specs: `core_attn` (whichever core attention runs, packed and SDPA included),
  `mlp` (dense MLP layers), `moe` (the whole MoE layer, routing replay included: the router reruns in
  REPLAY_BACKWARD), `shared_experts`. With Transformer Engine's specs also `layernorm` (input and pre-MLP norms),
  `mla_up_proj` (MLA's up projections and RoPE) and, with its grouped experts, `moe_act`.
- Why not on the local specs: Megatron-Core 0.16.1 recomputes `layernorm`, `mla_up_proj` and `moe_act` with its
  `CheckpointWithoutOutput`, whose `fp8 = fp8 is not None` is always true, so it reads Transformer Engine's FP8 state
  and fails (NameError) without it; and only Transformer Engine's grouped experts (`TEGroupedMLP`) recompute their
  activation (Megatron-Core refuses `moe_act` without `moe_grouped_gemm`), not `GroupedExperts` or `SequentialMLP`.

A module this model does not have (`mlp` with MoE layers only, `moe` on a dense model, `shared_experts` without
shared experts, `mla_up_proj` without MLA) would recompute nothing: refused, naming the key.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.config import ConfigError, ModelConfig
from megatron_rl.models.families import check_family

MODULES = ("core_attn", "layernorm", "mlp", "moe", "shared_experts", "mla_up_proj", "moe_act")


def _absent(model: ModelConfig, te_grouped_experts: bool, transformer_engine: bool) -> dict[str, str]:
    """Module -> why this model, on these specs, cannot recompute it."""
    moe = model.num_experts is not None
    dense_layers = not moe or model.first_k_dense_layers > 0 or model.moe_layer_freq > 1
    absent = {}
    if not dense_layers:
        absent["mlp"] = "every layer is an MoE layer (no dense MLP)"
    if not moe:
        absent["moe"] = absent["moe_act"] = absent["shared_experts"] = "the model is dense (model.num_experts = null)"
    elif model.moe_shared_expert_size is None:
        absent["shared_experts"] = "the MoE layers have no shared expert (model.moe_shared_expert_size = null)"
    if check_family(model).sparse_attention:
        absent["core_attn"] = (
            "Megatron-Core 0.16.1's MLA recomputes its core attention without the hidden states and query latent "
            "DeepSeek sparse attention's indexer reads (use full, or other modules)"
        )
    if not check_family(model).multi_latent_attention:
        absent["mla_up_proj"] = f"model.family = {model.family!r} has no multi-latent attention"
    if not transformer_engine:
        for module in ("layernorm", "mla_up_proj", "moe_act"):
            absent.setdefault(
                module,
                "Megatron-Core 0.16.1 recomputes it with CheckpointWithoutOutput, which needs Transformer Engine "
                "(its FP8 state); the local specs run here",
            )
    if moe and not te_grouped_experts:
        absent["moe_act"] = (
            "only Transformer Engine's grouped experts recompute their activation; the local specs' experts "
            "(GroupedExperts, SequentialMLP) do not: use moe"
        )
    return absent


def recompute_fields(
    model: ModelConfig, *, transformer_engine: bool = False, te_grouped_experts: bool = False
) -> dict[str, Any]:
    """TransformerConfig's recompute fields for `model` (`transformer_engine`: its specs run; `te_grouped_experts`:
    its grouped experts run the MoE layers); ConfigError for a module list that cannot run (`check_recompute`)."""
    if model.recompute is False:
        return {}
    if model.recompute is True or model.recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    check_recompute(model, transformer_engine=transformer_engine, te_grouped_experts=te_grouped_experts)
    return dict(recompute_granularity="selective", recompute_modules=list(dict.fromkeys(model.recompute_modules)))


def check_recompute(model: ModelConfig, *, transformer_engine: bool = False, te_grouped_experts: bool = False) -> None:
    """ConfigError unless every module of `model.recompute_modules` is one these specs recompute in this model
    (read with `model.recompute = selective` only)."""
    if model.recompute != "selective":
        return
    modules = list(model.recompute_modules)
    if not modules:
        raise ConfigError(
            "model.recompute_modules = [] with model.recompute = selective recomputes nothing; "
            "name modules or set model.recompute = false"
        )
    unknown = [m for m in modules if m not in MODULES]
    if unknown:
        raise ConfigError(f"model.recompute_modules: unknown {unknown}; allowed: {', '.join(MODULES)}")
    absent = _absent(model, te_grouped_experts, transformer_engine)
    for module in modules:
        if module in absent:
            raise ConfigError(f"model.recompute_modules: {module} cannot be recomputed here: {absent[module]}")
