"""Layout presets of the Slurm planner for the largest sigmoid-router MoE models.

    python slurm/jobplan.py plan --preset deepseek-v3-671b ... CONFIG [key=value ...]   (or PRESET=...)

A preset is the published config.json of the model (the architecture keys that matter; the run's own
`model.hf_path` config.json is what the trainer builds, and the planner reads it again) and a trainer
layout for nodes of 8 x 80 GB GPUs: its `model.*` and `parallel.*` overrides go before the job's own
overrides, which win. `jobplan.make_plan` then checks the layout's divisibility on the job's world
(`validate_run`) and its memory (`jobcheck`: the trainer's static state within 90% of the GPU, the
engines' weights and KV cache within SGLang's static share). The
training node counts are the smallest worlds the expert layout divides; the rollout servers hold the
bf16 weights (`rollout.engine_gpus`) with room left for the KV cache.

- DeepSeek-V3-671B (also DeepSeek-R1): 61 layers (a prime: PP = 1), 256 experts. TP 8 for the 17 B
  dense parameters, EP 256 with ETP 1 puts one expert per GPU: 32 training nodes, about 56 GiB per
  GPU; servers of 32 GPUs (1.34 TB of bf16 weights).
- Kimi-K2 (1.03 T): the DeepSeek-V3 architecture with 384 experts and 64 heads: EP 384, 48 training
  nodes, about 53 GiB per GPU; servers of 64 GPUs (2.05 TB).
- GLM-4.5-355B: 92 layers, 160 experts: TP 4, PP 4, EP 40, ETP 1: 20 training nodes, about 42 GiB
  per GPU; servers of 16 GPUs (0.71 TB).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEEPSEEK_V3_671B: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06, "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "v_head_dim": 128, "vocab_size": 129280,
}  # fmt: skip
KIMI_K2: dict[str, Any] = {
    **DEEPSEEK_V3_671B, "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": 384,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827,
    "vocab_size": 163840, "max_position_embeddings": 131072, "rope_theta": 50000.0,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}  # fmt: skip
GLM_45_355B: dict[str, Any] = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 5120, "partial_rotary_factor": 0.5, "intermediate_size": 12288,
    "max_position_embeddings": 131072, "moe_intermediate_size": 1536, "norm_topk_prob": True,
    "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 160, "n_shared_experts": 1,
    "routed_scaling_factor": 2.5, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "num_hidden_layers": 92,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000, "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_qk_norm": True, "vocab_size": 151552,
}  # fmt: skip


@dataclass(frozen=True)
class Preset:
    """A model's published config.json and the trainer layout for it (node count for 8 GPUs per node)."""

    hf_config: dict[str, Any]
    layout: dict[str, Any]
    train_nodes: int
    rollout: dict[str, Any] = field(default_factory=dict)


PRESETS: dict[str, Preset] = {
    "deepseek-v3-671b": Preset(
        DEEPSEEK_V3_671B,
        {"tensor_model_parallel_size": 8, "expert_model_parallel_size": 256, "expert_tensor_parallel_size": 1},
        train_nodes=32,
        rollout={"engine_gpus": 32},
    ),
    "kimi-k2": Preset(
        KIMI_K2,
        {"tensor_model_parallel_size": 8, "expert_model_parallel_size": 384, "expert_tensor_parallel_size": 1},
        train_nodes=48,
        rollout={"engine_gpus": 64},
    ),
    "glm-4.5-355b": Preset(
        GLM_45_355B,
        {
            "tensor_model_parallel_size": 4,
            "pipeline_model_parallel_size": 4,
            "expert_model_parallel_size": 40,
            "expert_tensor_parallel_size": 1,
        },
        train_nodes=20,
        rollout={"engine_gpus": 16},
    ),
}


def preset_overrides(name: str) -> list[str]:
    """The `key=value` overrides of preset `name`: the model's shape (so that the YAML's model section is
    validated against the layout as the checkpoint's will be), bf16 with recompute, the layout."""
    from megatron_rl.models.hf_config import model_config_from_hf

    if name not in PRESETS:
        raise ValueError(f"PRESET={name!r}; allowed: {', '.join(sorted(PRESETS))}")
    preset = PRESETS[name]
    model = model_config_from_hf(preset.hf_config, source=f"preset {name}", recompute=True)
    skip = {"hf_path", "family", "lora"}  # lora: the run's choice, not the checkpoint's shape
    out = [f"model.family={model.family}"]
    for key, value in vars(model).items():
        if key not in skip:
            out.append(f"model.{key}={'null' if value is None else value}")
    out += [f"parallel.{k}={v}" for k, v in preset.layout.items()]
    out += [f"rollout.{k}={v}" for k, v in preset.rollout.items()]
    return out
