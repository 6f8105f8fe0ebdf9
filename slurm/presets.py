"""Layout presets of the Slurm planner for the largest MoE models.

    python slurm/jobplan.py plan --preset deepseek-v3-671b ... CONFIG [key=value ...]   (or PRESET=...)

A preset is the published config.json of the model (the architecture keys that matter; the run's own
`model.hf_path` config.json is what the trainer builds, and the planner reads it again) and a trainer
layout for nodes of 8 x 80 GB GPUs (H100): its `model.*` and `parallel.*` overrides go before the job's
own overrides, which win. `jobplan.make_plan` then checks the layout's divisibility on the job's world
(`validate_run`) and its memory (`jobcheck`: the trainer's largest pipeline stage within 90% of the GPU,
the engines' weights and KV cache within SGLang's static share). Each fits with its rollout nodes: one
engine holding the bf16 weights with room for the KV cache, on GPUs that divide the model's attention
heads (SGLang's TP splits them).

- DeepSeek-V3-671B (also DeepSeek-R1), 32 nodes: 61 layers and 256 experts. 28 training nodes: TP 8,
  PP 7 (8, 9, 9, 9, 9, 9, 8 layers), EP 32, ETP 1, about 55 GiB per GPU; an engine of 32 GPUs (4 nodes,
  1.34 TB of bf16 weights).
- Kimi-K2 (1.03 T), 32 nodes: the DeepSeek-V3 architecture with 384 experts and 64 heads. 24 training
  nodes: TP 8, PP 8 (7, 8 x 6, 6 layers), EP 24, ETP 1, Adam's moments on the host (about 54 GiB per GPU
  without them, 96 with); an engine of 64 GPUs (8 nodes, 2.05 TB; 32 GPUs leave room for 9 sequences of
  2,048 tokens, and 40 or 48 do not divide the 64 heads).
- GLM-4.5-355B, 8 nodes: 92 layers (3 dense), 160 experts. 6 training nodes: TP 8, PP 6 (17, 15 x 5
  layers: the first stage's 3 dense layers are light), EP 8, ETP 1, Adam's moments on the host (about
  70 GiB per GPU); an engine of 16 GPUs (2 nodes, 0.71 TB).
- gpt-oss-120b, 5 nodes: 36 layers, 128 experts (116.8 B parameters, of them 114.7 B the experts'). 4 training
  nodes: TP 2, EP 32, ETP 1 (Megatron's biased experts take expert-TP 1 only), no pipeline; an engine of 8 GPUs
  (1 node, 0.23 TB). The Hub release quantizes the experts to MXFP4, which the trainer refuses
  (`quantization_config`): the run's `model.hf_path` is a bf16 copy of it.

None of them has run here (no GPU cluster); their figures are the planner's arithmetic.
"""

from __future__ import annotations

import dataclasses
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

# deepseek-ai/DeepSeek-V3.2's config.json: DeepSeek-V3's with the lightning indexer's sizes.
DEEPSEEK_V32_671B: dict[str, Any] = {
    **DEEPSEEK_V3_671B, "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
    "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048,
}  # fmt: skip
# zai-org/GLM-5's config.json: DeepSeek-V3.2's architecture at GLM's sizes (plain RoPE, rms_norm_eps 1e-5).
GLM_5_744B: dict[str, Any] = {
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "attention_bias": False,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 6144, "intermediate_size": 12288,
    "kv_lora_rank": 512, "max_position_embeddings": 202752, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 1, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 64,
    "num_experts_per_tok": 8, "num_hidden_layers": 78, "num_key_value_heads": 64, "num_nextn_predict_layers": 1,
    "q_lora_rank": 2048, "qk_head_dim": 256, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "head_dim": 64,
    "rms_norm_eps": 1e-05, "rope_interleave": True, "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False, "topk_group": 1,
    "topk_method": "noaux_tc", "v_head_dim": 256, "vocab_size": 154880, "index_head_dim": 128, "index_n_heads": 32,
    "index_topk": 2048, "dtype": "bfloat16",
}  # fmt: skip

# openai/gpt-oss-120b's config.json without its quantization_config (the architecture of a bf16 copy).
GPT_OSS_120B: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "experts_per_token": 4,
    "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 18,
    "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "num_local_experts": 128, "rms_norm_eps": 1e-05, "rope_theta": 150000,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 201088,
}  # fmt: skip

# Qwen/Qwen3-Next-80B-A3B-Instruct's config.json: 36 Gated DeltaNet layers and 12 gated full-attention ones (every
# 4th), 512 experts top-10 and a gated shared expert per layer.
QWEN3_NEXT_80B: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "attention_bias": False,
    "decoder_sparse_step": 1, "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 5120, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
    "max_position_embeddings": 262144, "mlp_only_layers": [], "moe_intermediate_size": 512, "norm_topk_prob": True,
    "num_attention_heads": 16, "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48,
    "num_key_value_heads": 2, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 10000000, "shared_expert_intermediate_size": 512, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip
# Qwen/Qwen3.5-397B-A17B's text_config (its text model, as Qwen3_5MoeForCausalLM converts it; the vision tower and
# the MTP layer are not part of it): 45 DeltaNet layers and 15 full ones, 512 experts top-10.
QWEN3_5_397B: dict[str, Any] = {
    "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "attention_bias": False,
    "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 4096,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 64,
    "linear_value_head_dim": 128, "max_position_embeddings": 262144, "moe_intermediate_size": 1024,
    "mtp_num_hidden_layers": 1, "num_attention_heads": 32, "num_experts": 512, "num_experts_per_tok": 10,
    "num_hidden_layers": 60, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "shared_expert_intermediate_size": 1024,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    "tie_word_embeddings": False, "dtype": "bfloat16", "vocab_size": 248320,
}  # fmt: skip


@dataclass(frozen=True)
class Preset:
    """A model's published config.json and the trainer layout for it (node count for 8 GPUs per node)."""

    hf_config: dict[str, Any]
    layout: dict[str, Any]
    train_nodes: int
    rollout: dict[str, Any] = field(default_factory=dict)

    @property
    def rollout_nodes(self) -> int:
        """Nodes of 8 GPUs for one engine of `rollout.engine_gpus`."""
        return self.rollout["engine_gpus"] // 8


PRESETS: dict[str, Preset] = {
    "deepseek-v3-671b": Preset(
        DEEPSEEK_V3_671B,
        {
            "tensor_model_parallel_size": 8,
            "pipeline_model_parallel_size": 7,
            "num_layers_in_first_pipeline_stage": 8,
            "num_layers_in_last_pipeline_stage": 8,
            "expert_model_parallel_size": 32,
            "expert_tensor_parallel_size": 1,
        },
        train_nodes=28,
        rollout={"engine_gpus": 32},
    ),
    "kimi-k2": Preset(
        KIMI_K2,
        {
            "tensor_model_parallel_size": 8,
            "pipeline_model_parallel_size": 8,
            "num_layers_in_first_pipeline_stage": 7,
            "num_layers_in_last_pipeline_stage": 6,
            "expert_model_parallel_size": 24,
            "expert_tensor_parallel_size": 1,
            "optimizer_cpu_offload": True,
        },
        train_nodes=24,
        rollout={"engine_gpus": 64},
    ),
    "glm-4.5-355b": Preset(
        GLM_45_355B,
        {
            "tensor_model_parallel_size": 8,
            "pipeline_model_parallel_size": 6,
            "num_layers_in_first_pipeline_stage": 17,
            "num_layers_in_last_pipeline_stage": 15,
            "expert_model_parallel_size": 8,
            "expert_tensor_parallel_size": 1,
            "optimizer_cpu_offload": True,
        },
        train_nodes=6,
        rollout={"engine_gpus": 16},
    ),
    "deepseek-v3.2-671b": Preset(
        DEEPSEEK_V32_671B,
        {
            "tensor_model_parallel_size": 8,
            "pipeline_model_parallel_size": 7,
            "num_layers_in_first_pipeline_stage": 8,
            "num_layers_in_last_pipeline_stage": 8,
            "expert_model_parallel_size": 32,
            "expert_tensor_parallel_size": 1,
        },
        train_nodes=28,
        rollout={"engine_gpus": 32},
    ),
    "glm-5-744b": Preset(
        GLM_5_744B,
        {
            "tensor_model_parallel_size": 8,
            "pipeline_model_parallel_size": 8,
            "num_layers_in_first_pipeline_stage": 9,
            "num_layers_in_last_pipeline_stage": 9,
            "expert_model_parallel_size": 32,
            "expert_tensor_parallel_size": 1,
        },
        train_nodes=32,
        rollout={"engine_gpus": 32},
    ),
    # Gated DeltaNet takes no CP (models.gated_delta); its 80 B fit without TP: pipeline stages and expert parallelism.
    "qwen3-next-80b-a3b": Preset(
        QWEN3_NEXT_80B,
        {"pipeline_model_parallel_size": 2, "expert_model_parallel_size": 16, "expert_tensor_parallel_size": 1},
        train_nodes=4,
        rollout={"engine_gpus": 8},
    ),
    "qwen3.5-397b-a17b": Preset(
        QWEN3_5_397B,
        {"pipeline_model_parallel_size": 4, "expert_model_parallel_size": 32, "expert_tensor_parallel_size": 1},
        train_nodes=16,
        rollout={"engine_gpus": 16},
    ),
    "gpt-oss-120b": Preset(
        GPT_OSS_120B,
        {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 32, "expert_tensor_parallel_size": 1},
        train_nodes=4,
        rollout={"engine_gpus": 8},
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
    out = [f"model.family={model.family}"]
    for key, value in vars(model).items():
        # its sections (lora, fusions): the run's choices, not the checkpoint's shape; linear_attention is the shape
        if key == "linear_attention":
            out += [f"model.{key}.{k}={'null' if v is None else v}" for k, v in vars(value).items()]
        elif key not in ("hf_path", "family") and not dataclasses.is_dataclass(value):
            out.append(f"model.{key}={'null' if value is None else value}")
    out += [f"parallel.{k}={v}" for k, v in preset.layout.items()]
    out += [f"rollout.{k}={v}" for k, v in preset.rollout.items()]
    return out


# the config.json keys that tell one model from another (a fine-tune keeps them all): those in both are compared
IDENTITY_KEYS = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "n_routed_experts",
                 "num_experts", "num_local_experts")  # fmt: skip


def model_mismatch(name: str, hf_config: dict[str, Any]) -> str | None:
    """What tells `hf_config` (the run's config.json) from the model of preset `name`, or None."""
    published = PRESETS[name].hf_config
    differ = [
        f"{key} {hf_config[key]!r} (the preset's: {published[key]!r})"
        for key in IDENTITY_KEYS
        if key in hf_config and key in published and hf_config[key] != published[key]
    ]
    return ", ".join(differ) or None


# the model keys of a preset that are the run's choices, not the checkpoint's shape
RUN_CHOICES = ("model.params_dtype", "model.recompute", "model.recompute_modules")


def trainer_preset_overrides(overrides: list[str]) -> list[str]:
    """Of `preset_overrides(name)`, those the job's trainer gets before the job's own overrides: the layout, the
    rollout settings and bf16 with recompute. The model's shape is left out: the trainer reads it from
    `model.hf_path`'s config.json (or `checkpoint.load`), which wins over model keys anyway."""
    return [o for o in overrides if not o.startswith("model.") or o.split("=", 1)[0] in RUN_CHOICES]
