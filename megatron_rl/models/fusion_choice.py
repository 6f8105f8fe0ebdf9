"""Which fused kernels the model runs (`model.fusions`), as Megatron's TransformerConfig fields; torch-free.

Each fusion is `auto` (on where it can run, with the reason of `fusion_blockers` where it stays off), `true` (on, or
ConfigError naming the reason) or `false`. Where they can run:

- `apply_rope_fusion`: Transformer Engine's fused RoPE (TE >= 1.4, its specs), plain and llama3 RoPE. Not with yarn:
  the kernel takes no cos/sin factor (Megatron falls back to the unfused RoPE at every call) and MLA's fused RoPE is
  experimental and training-only in Megatron-Core 0.16 (the log-prob forward runs it too).
- `bias_activation_fusion`: Megatron's own scripted SwiGLU (dense MLPs, shared experts, `SequentialMLP` experts), on
  CUDA with either spec. Not gpt-oss's clamped, offset gate nor Gemma's tanh-GELU, which Megatron's kernel refuses.
- `masked_softmax_fusion`: with Transformer Engine's specs. The local attention would import Megatron's CUDA
  softmax kernels (apex), not installed without it; `model.attention_backend = sdpa` fuses the softmax itself.
- `moe_permute_fusion` (TE >= 2.1), `moe_router_fusion` (TE >= 2.7): MoE models on Transformer Engine's specs. The
  fused router skips Megatron's `RouterReplay`, so it stays off wherever routing replay is built (the actor's MoE).

On the CPU every fusion is off (`CPU`): the CPU's TransformerConfig is what it was before the key.
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import Version

from megatron_rl.config import ConfigError, ModelConfig
from megatron_rl.models.families import check_family, is_gpt_oss

FUSIONS = (
    "apply_rope_fusion",
    "bias_activation_fusion",
    "masked_softmax_fusion",
    "moe_permute_fusion",
    "moe_router_fusion",
)
MIN_TE = {
    "apply_rope_fusion": "1.4",
    "masked_softmax_fusion": "1.0",
    "moe_permute_fusion": "2.1",
    "moe_router_fusion": "2.7",
}


@dataclass(frozen=True)
class Platform:
    """Where the model runs: with CUDA or not, and the version of Transformer Engine when its specs run (None: the
    local specs)."""

    cuda: bool = False
    transformer_engine: str | None = None


CPU = Platform()


def _te_blocker(name: str, platform: Platform) -> str | None:
    te = platform.transformer_engine
    if te is None:
        return "it needs Transformer Engine's specs (Transformer Engine and CUDA); the local specs run here"
    if Version(te).release < Version(MIN_TE[name]).release:
        return f"it needs Transformer Engine >= {MIN_TE[name]}, this is {te}"
    return None


def fusion_blockers(model: ModelConfig, platform: Platform, *, routing_replay: bool) -> dict[str, str]:
    """Fusion -> why it cannot run for `model` on `platform` (`routing_replay`: Megatron's RouterReplay is built);
    the fusions absent from it can run."""
    blockers: dict[str, str] = {}
    for name in ("apply_rope_fusion", "masked_softmax_fusion", "moe_permute_fusion", "moe_router_fusion"):
        reason = _te_blocker(name, platform)
        if reason:
            blockers[name] = reason
    if "apply_rope_fusion" not in blockers and model.rope_scaling == "yarn":
        mla = check_family(model).multi_latent_attention
        blockers["apply_rope_fusion"] = (
            "Megatron-Core 0.16's fused MLA RoPE is experimental and training-only"
            if mla
            else "the fused kernel takes no yarn cos/sin factor (Megatron falls back to the unfused RoPE)"
        )
    if not platform.cuda:
        blockers["bias_activation_fusion"] = "it needs CUDA (on the CPU it would only change the rounding)"
    elif is_gpt_oss(model) or check_family(model).gemma:
        blockers["bias_activation_fusion"] = (
            f"model.family = {model.family!r}: its gate is no plain SiLU (gpt_oss clamps and offsets it, Gemma's is "
            "tanh-GELU), which Megatron's fused kernel refuses"
        )
    for name in ("moe_permute_fusion", "moe_router_fusion"):
        if model.num_experts is None:
            blockers[name] = "the model is dense (model.num_experts = null)"
    if routing_replay and "moe_router_fusion" not in blockers:
        blockers["moe_router_fusion"] = "the fused router bypasses Megatron's RouterReplay, which routing replay uses"
    return blockers


def fusion_fields(model: ModelConfig, platform: Platform, *, routing_replay: bool) -> dict[str, bool]:
    """TransformerConfig's fusion fields: `auto` on unless blocked, `true` on (ConfigError naming the blocker)."""
    blockers = fusion_blockers(model, platform, routing_replay=routing_replay)
    fields = {}
    for name in FUSIONS:
        choice = getattr(model.fusions, name)
        if choice is True and name in blockers:
            raise ConfigError(f"model.fusions.{name} = true: {blockers[name]}; set it to auto or false")
        fields[name] = choice is True or (choice == "auto" and name not in blockers)
    return fields
