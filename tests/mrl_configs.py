"""Configurations the tests build models from: tiny Megatron and Hugging Face models of every family,
parallel layouts, and the published shape of Qwen3-30B-A3B (no weights).

Two sizes of Hugging Face model: "small" (2 layers, width 32: what the engine tests serve quickly)
and "split" (4 layers, width 64, vocabulary 300: splits over TP = 2, EP = 2 and PP = 2, and pads to
384 rows at TP = 1 but 512 at TP = 2, so checkpoints must re-pad across layouts).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from megatron_rl.config import ModelConfig, ParallelConfig

VOCAB = 300
FAMILIES = ("qwen3_moe", "mixtral", "qwen3", "qwen2")

_MEGATRON_FAMILY_SWITCHES = {
    "qwen3_moe": dict(qk_layernorm=True, add_qkv_bias=False),
    "qwen3": dict(qk_layernorm=True, add_qkv_bias=False, num_experts=None),
    "qwen2": dict(qk_layernorm=False, add_qkv_bias=True, num_experts=None),
    "mixtral": dict(qk_layernorm=False, add_qkv_bias=False),
    "llama": dict(qk_layernorm=False, add_qkv_bias=False, num_experts=None),
    "mistral": dict(qk_layernorm=False, add_qkv_bias=False, num_experts=None),
    "gemma2": dict(qk_layernorm=False, add_qkv_bias=False, num_experts=None, tie_word_embeddings=True),
    "gemma3_text": dict(qk_layernorm=True, add_qkv_bias=False, num_experts=None, tie_word_embeddings=True),
}

# The sigmoid-router families (DeepSeek-V3, GLM-4.5): group-limited routing with 8 experts in 4 groups,
# top-4 from 2 groups, a shared expert, yarn RoPE (DeepSeek) and partial RoPE with QKV biases and
# QK-norm (GLM). Odd widths throughout; the expert bias is made non-zero by save_random_hf_model.
SIGMOID_FAMILIES = ("deepseek_v3", "glm4_moe")
_YARN = dict(type="yarn", factor=4.0, original_max_position_embeddings=128, beta_fast=32, beta_slow=1, mscale=1.0,
             mscale_all_dim=1.0)  # fmt: skip
_DEEPSEEK = dict(num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=4, n_group=4,
                 topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                 rope_scaling=_YARN)  # fmt: skip
_GLM = dict(n_routed_experts=6, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
            first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True,
            use_qk_norm=True, partial_rotary_factor=0.5)  # fmt: skip

# Qwen3-Next and Qwen3.5's text model: a DeltaNet and a full layer per PP stage (2 key heads of 8 grouping 4 value
# heads of 6), half of each full-attention head rotated
_DELTA = dict(layer_types=["linear_attention", "full_attention"] * 2, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=3, num_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=14,
              rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5))  # fmt: skip

# DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): DeepSeek-V3's MLA and router (yarn RoPE for DeepSeek-V3.2, plain
# for GLM-5) plus an indexer of 8 heads of 10 channels (its RoPE part 6) keeping 5 keys per query, fewer than the
# tests' sequences.
DSA_FAMILIES = ("deepseek_v32", "glm_moe_dsa")
_DSA = dict(q_lora_rank=22, kv_lora_rank=18, qk_nope_head_dim=10, qk_rope_head_dim=6, head_dim=6, v_head_dim=14,
            moe_intermediate_size=24, n_shared_experts=2, index_n_heads=8, index_head_dim=10, index_topk=5)  # fmt: skip

# The bias-free dense families: Llama with Llama 3.1's RoPE scaling (factor 4; head_dim 24 or 8 puts
# frequencies in all three of its bands: kept, smoothed, divided) and a head_dim that is not hidden / heads;
# Mistral with tied embeddings and another RoPE base. Megatron-Core fixes the other llama3 values.
DENSE_FAMILIES = ("llama", "mistral")
_LLAMA3 = dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=8192, rope_theta=10000.0)  # fmt: skip

# Gemma 2 and 3 (text), every switch off its default and visible at these widths: windows shorter than the test
# sequences, query_pre_attn_scalar unlike head_dim, soft-capping that bites on O(1) activations (Gemma 2), the
# sliding layers' own RoPE base and linear scaling of the full layers (Gemma 3: every 3rd layer full at "split").
GEMMA_FAMILIES = ("gemma2", "gemma3_text")
_GEMMA2 = dict(query_pre_attn_scalar=20, attn_logit_softcapping=3.0, final_logit_softcapping=4.0,
               tie_word_embeddings=True)  # fmt: skip
_GEMMA3_ROPE = dict(full_attention=dict(rope_type="linear", factor=4.0, rope_theta=5e5),
                    sliding_attention=dict(rope_type="default", rope_theta=100.0))  # fmt: skip


# A tiny MiniMax-M2 (transformers' field names): GQA 6/2 with head_dim 10, partial RoPE on 6 of them, top-3 of 6
# experts, a non-default RoPE base; splits over TP = 2 (heads and KV groups) and EP = 2.
MINIMAX_M2_TINY: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=48, intermediate_size=20, num_hidden_layers=2, num_attention_heads=6,
    num_key_value_heads=2, head_dim=10, rotary_dim=6, num_local_experts=6, num_experts_per_tok=3,
    max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    bos_token_id=0, eos_token_id=1, pad_token_id=0,
)  # fmt: skip


def tiny_minimax_model(**fields: Any) -> ModelConfig:
    """The fp32 Megatron `model` of `MINIMAX_M2_TINY` as transformers writes its config.json; `fields` override it."""

    from transformers import MiniMaxM2Config

    from megatron_rl.models.hf_config import model_config_from_hf

    hf = json.loads(MiniMaxM2Config(**MINIMAX_M2_TINY, architectures=["MiniMaxM2ForCausalLM"]).to_json_string())
    return model_config_from_hf(hf, params_dtype="fp32", **fields)


# A tiny gpt-oss (transformers' field names): GQA 6/2 with head_dim 10, sliding (window 5) and full layers
# alternating, yarn RoPE not rounded (truncate false) over 16 original positions, top-3 of 6 biased experts whose
# SwiGLU clamps at 1 with gain 1.3; splits over TP = 2 (heads and KV groups), EP = 2 and PP = 2 (a sliding and a
# full layer per stage).
GPT_OSS_TINY: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=48, intermediate_size=20, num_hidden_layers=4, num_attention_heads=6,
    num_key_value_heads=2, head_dim=10, num_local_experts=6, num_experts_per_tok=3, sliding_window=5,
    max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False, swiglu_alpha=1.3, swiglu_limit=1.0,
    rope_parameters=dict(rope_type="yarn", rope_theta=5000.0, factor=4.0, original_max_position_embeddings=16,
                         beta_fast=8.0, beta_slow=1.0, truncate=False),
    bos_token_id=0, eos_token_id=1, pad_token_id=0,
)  # fmt: skip


def tiny_gpt_oss_model(**fields: Any) -> ModelConfig:
    """The fp32 Megatron `model` of `GPT_OSS_TINY` as transformers writes its config.json; `fields` override it."""
    from megatron_rl.models.hf_config import model_config_from_hf

    return model_config_from_hf(hf_config_json("gpt_oss"), params_dtype="fp32", **fields)


# Per size: the fields every family shares, then what each family adds (transformers' field names).
_HF_SIZES: dict[str, tuple[dict[str, Any], dict[str, dict[str, Any]]]] = {
    "small": (
        dict(
            vocab_size=128,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            eos_token_id=1,
            bos_token_id=0,
            pad_token_id=0,
            tie_word_embeddings=False,
        ),
        {
            "qwen3_moe": dict(
                head_dim=8, intermediate_size=64, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2
            ),
            "mixtral": dict(head_dim=8, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2),
            "qwen3": dict(head_dim=8, intermediate_size=64),
            "qwen2": dict(intermediate_size=64),
            "deepseek_v3": dict(
                _DEEPSEEK,
                q_lora_rank=12,
                kv_lora_rank=10,
                qk_nope_head_dim=6,
                qk_rope_head_dim=4,
                head_dim=4,
                v_head_dim=5,
                intermediate_size=40,
                moe_intermediate_size=12,
            ),
            "glm4_moe": dict(_GLM, head_dim=12, intermediate_size=40, moe_intermediate_size=12),
            "llama": dict(head_dim=24, intermediate_size=64, rope_scaling=_LLAMA3),
            "mistral": dict(intermediate_size=64, sliding_window=None, tie_word_embeddings=True, rope_theta=1e6),
            "gemma2": dict(_GEMMA2, head_dim=8, intermediate_size=64, sliding_window=4),
            "gemma3_text": dict(
                head_dim=8,
                intermediate_size=64,
                sliding_window=4,
                sliding_window_pattern=2,
                query_pre_attn_scalar=12,
                rope_parameters=_GEMMA3_ROPE,
                final_logit_softcapping=6.0,
            ),  # fmt: skip
        },
    ),
    "split": (
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=64,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
        {
            "qwen3_moe": dict(
                moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0]
            ),
            "mixtral": dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
            "qwen3": dict(tie_word_embeddings=True),
            "qwen2": dict(),
            "deepseek_v3": dict(
                _DEEPSEEK,
                q_lora_rank=22,
                kv_lora_rank=18,
                qk_nope_head_dim=10,
                qk_rope_head_dim=6,
                head_dim=6,
                v_head_dim=14,
                moe_intermediate_size=24,
                n_shared_experts=2,
                rope_scaling=dict(_YARN, original_max_position_embeddings=16),
            ),
            "glm4_moe": dict(_GLM, head_dim=20, moe_intermediate_size=20, routed_scaling_factor=1.8),
            "deepseek_v32": dict(_DEEPSEEK, **_DSA, rope_scaling=dict(_YARN, original_max_position_embeddings=16)),
            "glm_moe_dsa": dict(
                _DEEPSEEK, **_DSA, rope_scaling=None, n_group=1, topk_group=1, num_experts_per_tok=3, rms_norm_eps=1e-5
            ),
            "qwen3_next": dict(_DELTA, mlp_only_layers=[0]),
            "qwen3_5_moe": dict(_DELTA),  # separate DeltaNet projections, every layer MoE
            "llama": dict(head_dim=24, rope_scaling=_LLAMA3, rms_norm_eps=1e-5),
            "mistral": dict(sliding_window=None, tie_word_embeddings=True, rope_theta=1e6),
            "gemma2": dict(_GEMMA2, head_dim=24, sliding_window=5),
            "gemma3_text": dict(
                sliding_window=5,
                sliding_window_pattern=3,
                query_pre_attn_scalar=12,
                rope_parameters=_GEMMA3_ROPE,
                tie_word_embeddings=False,
            ),  # fmt: skip
        },
    ),
}

# Qwen3-30B-A3B's config.json (the keys that matter; no weights: readers take only the architecture).
QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "router_aux_loss_coef": 0.001,
    "attention_bias": False,
    "hidden_act": "silu",
    "use_sliding_window": False,
    "torch_dtype": "bfloat16",
}


def write_plan_config(root: Path, folder: str, hf_config: dict[str, Any], yaml: str) -> Path:
    """A Slurm planner's config (tests/test_jobplan.py, tests/test_jobcheck.py): `hf_config` as
    ROOT/FOLDER/config.json and ROOT/YAML naming it, its model section the same shape (validated against
    the layout before config.json is read), bf16 with recompute, TP 4, EP 8, ETP 1 as in docs/slurm.md."""

    from megatron_rl.models.hf_config import model_config_from_hf

    (root / folder).mkdir()
    (root / folder / "config.json").write_text(json.dumps(hf_config))
    fields = vars(model_config_from_hf(hf_config, source=folder)).items()
    model = {k: v for k, v in fields if not dataclasses.is_dataclass(v)}  # its sections (lora, fusions): defaults
    config = {
        "model": {**model, "hf_path": str(root / folder), "params_dtype": "bf16", "recompute": True},
        "parallel": {
            "tensor_model_parallel_size": 4,
            "expert_model_parallel_size": 8,
            "expert_tensor_parallel_size": 1,
        },
        "data": {"train_path": str(root / "train.jsonl")},
        "logging": {"run_dir": str(root / "run")},
    }
    (root / yaml).write_text(json.dumps(config))  # JSON is YAML
    return root / yaml


def hf_config_json(family: str, size: str = "split", **overrides: Any) -> dict[str, Any]:
    """The config.json dict `save_pretrained` writes for `hf_config(family, size, **overrides)`."""

    from megatron_rl.models.hf_config import _HF_CLASS

    config = hf_config(family, size, **overrides)
    config.architectures = [_HF_CLASS[family]]
    return json.loads(config.to_json_string())


def tiny_sigmoid_model(
    family: str, size: str = "split", hf: dict[str, Any] | None = None, **fields: Any
) -> ModelConfig:
    """The Megatron `model` of a tiny DeepSeek-V3 / GLM-4.5 (`hf_config_json`), fp32; `fields` override it."""
    from megatron_rl.models.hf_config import model_config_from_hf

    return model_config_from_hf(hf or hf_config_json(family, size), params_dtype="fp32", **fields)


def tiny_model(family: str = "qwen3_moe", **overrides: object) -> ModelConfig:
    """A 4-layer Megatron model of `family` small enough for 4 ranks on 2 cores (vocabulary VOCAB);
    MoE families get a dense first layer."""
    fields = dict(
        family=family,
        num_layers=4,
        hidden_size=64,
        ffn_hidden_size=96,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        first_k_dense_layers=1 if family == "qwen3_moe" else 0,
        rope_theta=10000.0,
    )
    fields.update(_MEGATRON_FAMILY_SWITCHES[family])
    fields.update(overrides)
    return ModelConfig(**fields)


def layout(
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    sp: bool | None = None,
    cp: int = 1,
    first: int | None = None,
    last: int | None = None,
) -> ParallelConfig:
    """The parallel section with TP, PP (`first` / `last`: the layers of its first / last stage), EP,
    expert-TP, sequence and context parallelism as given."""
    return ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        sequence_parallel=sp,
        context_parallel_size=cp,
    )


def hf_config(family: str = "qwen3_moe", size: str = "small", **overrides: Any) -> Any:
    """A transformers config of `family` (one of FAMILIES) at `size` ("small" or "split"; gpt-oss: `GPT_OSS_TINY`,
    MiniMax-M2: `MINIMAX_M2_TINY`, at either); `overrides` replace its fields."""
    import transformers

    if family == "gpt_oss":
        return transformers.GptOssConfig(**{**GPT_OSS_TINY, **overrides})
    if family == "minimax_m2":
        return transformers.MiniMaxM2Config(**{**MINIMAX_M2_TINY, **overrides})
    classes = {"qwen3_moe": transformers.Qwen3MoeConfig, "mixtral": transformers.MixtralConfig}
    classes.update(qwen3=transformers.Qwen3Config, qwen2=transformers.Qwen2Config, llama=transformers.LlamaConfig)
    classes.update(mistral=transformers.MistralConfig)
    classes.update(gemma2=transformers.Gemma2Config, gemma3_text=transformers.Gemma3TextConfig)
    classes.update(deepseek_v3=transformers.DeepseekV3Config, glm4_moe=transformers.Glm4MoeConfig)
    classes.update(deepseek_v32=transformers.DeepseekV32Config, glm_moe_dsa=transformers.GlmMoeDsaConfig)
    classes.update(qwen3_next=transformers.Qwen3NextConfig, qwen3_5_moe=transformers.Qwen3_5MoeTextConfig)  # "split"
    if family not in classes:
        raise ValueError(
            f"family {family!r}: allowed "
            f"{', '.join(FAMILIES + SIGMOID_FAMILIES + DSA_FAMILIES + DENSE_FAMILIES + GEMMA_FAMILIES)}"
        )
    if size not in _HF_SIZES:
        raise ValueError(f"size {size!r}: allowed {', '.join(_HF_SIZES)}")
    common, per_family = _HF_SIZES[size]
    fields = {**common, **per_family[family], **overrides}
    if family == "qwen3_5_moe":
        fields.pop("intermediate_size")  # every layer MoE: its config.json has no dense width
    return classes[family](**fields)


def make_tiny_model(folder: str, family: str = "qwen3_moe", seed: int = 0, **overrides: Any) -> str:
    """Save a "small" model of `family` with transformers' own random initialisation (seeded) to `folder`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, **overrides))
    model.save_pretrained(folder)
    return folder


@torch.no_grad()
def save_random_hf_model(folder: Path, config: Any, dtype: torch.dtype = torch.float32, seed: int = 0) -> Path:
    """Save a model of the transformers `config` with O(1) activations: matrices N(0, 1)/sqrt(fan_in),
    norms 1 + 0.1 N (Gemma's, Qwen3-Next's and Qwen3.5's, which scale by 1 + weight: 0.1 N), attention sinks (gpt-oss) N(0, 1) so that they
    weigh, other vectors 0.1 N (router margins are then rarely near-ties)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    centred = config.model_type.startswith(("gemma", "qwen3_next", "qwen3_5"))  # (1 + weight) norms
    for name, param in model.named_parameters():
        values = torch.randn(param.shape, generator=gen)
        if param.dim() == 1 and not name.endswith("self_attn.sinks"):
            unit_norm = 0.0 if centred and not name.endswith("linear_attn.norm.weight") else 1.0
            values = unit_norm + 0.1 * values if name.endswith("norm.weight") else 0.1 * values
        elif param.dim() > 1:
            values /= math.sqrt(param.shape[-1])
        param.copy_(values)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # a non-zero expert bias that changes the routing
            buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen))
    model.to(dtype).save_pretrained(folder)
    return folder


@contextlib.contextmanager
def launch_of_one() -> Iterator[None]:
    """A world of this process alone: the launch variables set (a free port) inside, restored after,
    Megatron's state and the process group torn down."""
    from megatron_rl.parallel.launch import free_port

    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.get(k) for k in names}
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    from megatron_rl.parallel import destroy_distributed

    try:
        yield
    finally:
        destroy_distributed()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def actor_of_one(cfg: Any) -> Iterator[Any]:
    """A `MegatronActor` of `cfg` in a world of this process alone (`launch_of_one`), closed afterwards."""
    with launch_of_one():
        from megatron_rl.actor.actor import MegatronActor

        actor = MegatronActor(cfg)
        try:
            yield actor
        finally:
            actor.close()


def actor_log_probs(actor: Any, batch: Any, budget: Any, mode: str | None = None) -> Any:
    """The actor's `compute_log_probs` of `batch` in micro-batches of `budget`, with its routing replay in `mode`
    ("record", "replay" or None) and the run's temperature, vocabulary and chunking."""
    from megatron_rl.actor.forward import compute_log_probs

    cfg = actor.cfg
    return compute_log_probs(
        actor.state.model, batch, temperature=cfg.rollout.temperature, vocab_size=cfg.model.vocab_size, budget=budget,
        chunk_tokens=cfg.train.logprob_chunk_tokens, routing=actor.routing, routing_mode=mode,
    )  # fmt: skip


def seeded_batch(vocab: int, lengths: tuple[int, ...], prompts: tuple[int, ...]) -> Any:
    """An `ActorBatch` of random tokens (seed 0) with these sample and prompt lengths, one random
    advantage per sample."""
    from megatron_rl.actor.batch import ActorBatch

    gen = torch.Generator().manual_seed(0)
    return ActorBatch(
        tokens=[torch.randint(0, vocab, (n,), generator=gen) for n in lengths],
        prompt_lengths=list(prompts),
        advantages=[torch.randn((), generator=gen) for _ in lengths],
    )


def with_key(base: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A deep copy of `base` with the dotted `path` set to `value` (`...`: removed)."""
    out = copy.deepcopy(base)
    *parents, key = path.split(".")
    node = out
    for parent in parents:
        node = node[parent]
    if value is ...:
        del node[key]
    else:
        node[key] = value
    return out


def megatron_names(mapping: Any) -> list[str]:
    """Every global Megatron name of the mapping's model (layers, experts)."""
    model, names = mapping.model, []
    for rule in mapping.rules:
        if "{layer}" not in rule.megatron:
            names.append(rule.megatron)
            continue
        for layer in range(model.num_layers):
            if mapping._applies(rule, layer):
                experts = range(model.num_experts or 0) if "{expert}" in rule.megatron else [None]
                names += [rule.megatron.format(layer=layer, expert=e) for e in experts]
    return names
