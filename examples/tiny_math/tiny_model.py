"""A tiny, randomly initialised Qwen3-MoE policy for tiny_math, saved as a Hugging Face folder.

Shape (small enough for a 2-core CPU, large enough to learn the task): hidden 128, 4 layers, 4 query heads and 2 KV heads of
width 32, 8 experts per layer with top-2 routing (weights renormalised) and expert width 128, every
layer MoE, RoPE base 10000, no aux loss. Embeddings are NOT tied (like Qwen3-30B-A3B; the HF <->
Megatron mapping then needs no tied-weight case): 1,782,144 parameters with the 28-token vocabulary.
The folder also holds the tokenizer, so `model.hf_path` alone is enough. Same seed, same weights.

`MEGATRON_MODEL` lists the `model.*` settings that describe the same network.

`--family deepseek_v3|glm4_moe|gpt_oss|deepseek_v32|qwen3_next|glm_moe_dsa|qwen3_5_moe|minimax_m2` builds a
DeepSeek-V3-, GLM-4.5-, gpt-oss-, DeepSeek-V3.2-, Qwen3-Next-, GLM-5-, Qwen3.5- or MiniMax-M2-shaped policy instead
(`FAMILY_ARCHITECTURES`). `--layers N` changes the depth only (run.sh's
DISTILL=4to2 student: 2 layers, the same tokenizer as the 4-layer teacher).

Usage: python examples/tiny_math/tiny_model.py --out DIR [--seed 0] [--family qwen3_moe] [--layers 4]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tiny_tokenizer import build_tokenizer, save_tokenizer, vocabulary

ARCHITECTURE: dict[str, Any] = dict(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=256,  # dense MLP width; unused, as every layer is MoE
    moe_intermediate_size=128,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    router_aux_loss_coef=0.0,
    tie_word_embeddings=False,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)

# The same task on the two sigmoid-router families, at about the same size: DeepSeek-V3-shaped (MLA with
# q/kv compression, yarn RoPE, a dense first layer, a shared expert, 8 experts in 4 groups, top-2 from
# 1 group, routed scaling 2.5) and GLM-4.5-shaped (GQA with QKV biases and QK-norm, half-rotary RoPE,
# a dense first layer, a shared expert). Their expert bias starts non-zero (0.01 N(0, 1), seeded).
_SIGMOID_COMMON: dict[str, Any] = dict(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    intermediate_size=256,
    moe_intermediate_size=96,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    tie_word_embeddings=False,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    num_nextn_predict_layers=0,
)
# The GQA layers of the gpt-oss- and MiniMax-M2-shaped policies: 4 query / 2 KV heads of 32, 8 experts of width 96 in
# every layer, top-2, no aux loss.
_GQA_EXPERTS: dict[str, Any] = dict(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=96,
    num_local_experts=8,
    num_experts_per_tok=2,
    router_aux_loss_coef=0.0,
    tie_word_embeddings=False,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
FAMILY_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "deepseek_v3": dict(
        _SIGMOID_COMMON,
        num_key_value_heads=4,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        head_dim=16,
        v_head_dim=32,
        n_group=4,
        topk_group=1,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 2.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },  # fmt: skip
    ),
    "glm4_moe": dict(
        _SIGMOID_COMMON,
        num_key_value_heads=2,
        head_dim=32,
        attention_bias=True,
        use_qk_norm=True,
        n_group=1,
        topk_group=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),
    # gpt-oss-shaped: attention sinks, sliding-window layers (16 keys) between full ones, yarn RoPE not rounded,
    # biases on every linear and the router, 8 biased experts with the clamped (up + 1) SwiGLU, top-2.
    "gpt_oss": dict(
        _GQA_EXPERTS,
        sliding_window=16,
        swiglu_limit=7.0,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 2.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },  # fmt: skip
    ),
}
# DeepSeek-V3.2-shaped: the DeepSeek-V3 shape plus a lightning indexer (32 heads of 32, its RoPE part 16) keeping 24
# keys per query: from the 25th token of a sequence (prompts are 8, responses up to 32) attention is sparse. With
# few heads a key often scores exactly 0 (every head's product negative: 1 in 16 with 4 heads), ties that the
# engine and the trainer break differently (docs/training.md#deepseek-sparse-attention-deepseek-v32-glm-5).
FAMILY_ARCHITECTURES["deepseek_v32"] = dict(
    FAMILY_ARCHITECTURES["deepseek_v3"], index_n_heads=32, index_head_dim=32, index_topk=24
)
# Qwen3-Next-shaped: 3 Gated DeltaNet layers (2 key heads of 32 grouping 4 value heads of 32, a convolution of 4)
# then a full attention (GQA whose query also yields its output gate, a quarter of each head rotated), (1 + weight)
# norms, 8 experts top-2 renormalised and a gated shared expert in every layer.
FAMILY_ARCHITECTURES["qwen3_next"] = dict(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=256,  # dense MLP width; unused, as every layer is MoE
    moe_intermediate_size=96,
    shared_expert_intermediate_size=96,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    router_aux_loss_coef=0.0,
    tie_word_embeddings=False,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)
# GLM-5-shaped: DeepSeek-V3.2's shape with plain RoPE and no expert groups, as GLM-5 has.
FAMILY_ARCHITECTURES["glm_moe_dsa"] = dict(
    FAMILY_ARCHITECTURES["deepseek_v32"], n_group=1, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}
)
# Qwen3.5-shaped: Qwen3-Next's, every layer MoE, with Qwen3.5's separate DeltaNet projections (its checkpoint's).
FAMILY_ARCHITECTURES["qwen3_5_moe"] = {
    key: value
    for key, value in FAMILY_ARCHITECTURES["qwen3_next"].items()
    if key not in ("intermediate_size", "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob")
}
# MiniMax-M2-shaped: GQA with the QK-norm over each whole projection, half of each head rotated, 8 experts top-2 by
# sigmoid scores and an expert bias, every layer MoE.
FAMILY_ARCHITECTURES["minimax_m2"] = dict(
    _GQA_EXPERTS, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
)
FAMILIES = ("qwen3_moe", *FAMILY_ARCHITECTURES)
_CLASSES = {  # transformers' config and model classes of FAMILY_ARCHITECTURES
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM"),
}

# The same network as megatron_rl.config `model.*` keys.
MEGATRON_MODEL: dict[str, Any] = dict(
    family="qwen3_moe",
    num_layers=4,
    hidden_size=128,
    ffn_hidden_size=256,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=32,
    vocab_size=len(vocabulary()),
    max_position_embeddings=256,
    rope_theta=10000.0,
    norm_epsilon=1e-6,
    qk_layernorm=True,
    tie_word_embeddings=False,
    num_experts=8,
    moe_router_topk=2,
    moe_ffn_hidden_size=128,
    moe_router_norm_topk=True,
    moe_aux_loss_coeff=0.0,
)


def build_model(
    out: Path, seed: int = 0, tokenizer: Any = None, family: str = "qwen3_moe", layers: int | None = None
) -> Any:
    """Write the model of `family` (FAMILIES; safetensors, config, generation config) and its tokenizer
    (tiny_math's by default) to `out`; returns the model. The vocabulary size is the tokenizer's; `layers`
    replaces the family's depth (None: its 4)."""
    import torch
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"family {family!r}: allowed {', '.join(FAMILIES)}")
    if layers is not None and layers < 1:
        raise ValueError(f"layers = {layers}: a model needs at least 1 layer")
    depth = {} if layers is None else {"num_hidden_layers": layers}
    tokenizer = build_tokenizer() if tokenizer is None else tokenizer
    special = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    if family == "qwen3_moe":
        arch = dict(ARCHITECTURE, **depth)
        rope_theta = arch.pop("rope_theta")
        rope = {"rope_type": "default", "rope_theta": rope_theta}
        config: Any = transformers.Qwen3MoeConfig(vocab_size=len(tokenizer), rope_parameters=rope, **special, **arch)
        cls: Any = transformers.Qwen3MoeForCausalLM
    else:
        arch = dict(FAMILY_ARCHITECTURES[family], **depth)
        rope_theta = arch["rope_parameters"]["rope_theta"]
        config_name, cls_name = _CLASSES[family]
        config = getattr(transformers, config_name)(vocab_size=len(tokenizer), **special, **arch)
        cls = getattr(transformers, cls_name)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = cls(config)
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.copy_(0.01 * torch.randn(buffer.shape))
    finally:
        torch.random.set_rng_state(generator_state)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    _add_legacy_config_keys(out / "config.json", rope_theta, family)
    save_tokenizer(tokenizer, out)
    return model


def _add_legacy_config_keys(path: Path, rope_theta: float, family: str = "qwen3_moe") -> None:
    """transformers 5 writes num_local_experts / rope_parameters / dtype; readers on transformers 4.x
    (e.g. an SGLang server) look for num_experts / rope_theta / torch_dtype and would silently fall
    back to their defaults (128 experts) without them."""
    config = json.loads(path.read_text(encoding="utf-8"))
    if family == "qwen3_moe":
        config.setdefault("num_experts", config.get("num_local_experts", ARCHITECTURE["num_experts"]))
    config.setdefault("rope_theta", rope_theta)
    config.setdefault("torch_dtype", config.get("dtype", "float32"))
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="model folder to write")
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed")
    parser.add_argument("--family", default="qwen3_moe", choices=FAMILIES, help="model family")
    parser.add_argument("--layers", type=int, default=None, help="number of layers (default: the family's 4)")
    args = parser.parse_args(argv)
    model = build_model(args.out, args.seed, family=args.family, layers=args.layers)
    print(f"model: {args.out} ({sum(p.numel() for p in model.parameters()):,} parameters)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
