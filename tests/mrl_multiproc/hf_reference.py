"""A `transformers` model holding the same weights as a built Megatron model: the independent
reference that the builder's switches (router, QK-norm, RoPE, GQA, SwiGLU, biases) mean what the
Hugging Face families mean. Test-only: the package's HF <-> Megatron mapping lives in models/."""

from __future__ import annotations

import torch

from megatron_rl.config import ModelConfig


def hf_model(model: ModelConfig) -> torch.nn.Module:
    """An fp32 eager-attention `transformers` causal LM with `model`'s shape."""
    import transformers

    head_dim = model.kv_channels or model.hidden_size // model.num_attention_heads
    common = dict(
        vocab_size=model.vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.ffn_hidden_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_query_groups,
        head_dim=head_dim,
        rms_norm_eps=model.norm_epsilon,
        rope_theta=model.rope_theta,
        max_position_embeddings=model.max_position_embeddings,
        tie_word_embeddings=model.tie_word_embeddings,
        attention_dropout=0.0,
    )
    if model.family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **common,
            moe_intermediate_size=model.moe_ffn_hidden_size,
            num_experts=model.num_experts,
            num_experts_per_tok=model.moe_router_topk,
            norm_topk_prob=model.moe_router_norm_topk,
            decoder_sparse_step=model.moe_layer_freq,
            mlp_only_layers=list(range(model.first_k_dense_layers)),
            router_aux_loss_coef=model.moe_aux_loss_coeff,
        )
        cls = transformers.Qwen3MoeForCausalLM
    elif model.family == "mixtral":
        common["intermediate_size"] = model.moe_ffn_hidden_size
        config = transformers.MixtralConfig(
            **common, num_local_experts=model.num_experts, num_experts_per_tok=model.moe_router_topk
        )
        cls = transformers.MixtralForCausalLM
    elif model.family == "qwen3":
        config, cls = transformers.Qwen3Config(**common), transformers.Qwen3ForCausalLM
    else:
        config, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    config._attn_implementation = "eager"
    return cls(config).float().eval()


def _split_qkv(qkv: torch.Tensor, model: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's fused QKV rows are grouped per KV head: [q of its heads, k, v] for each group."""
    groups, per_group = model.num_query_groups, model.num_attention_heads // model.num_query_groups
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, per_group + 2, -1, *rest)
    q = grouped[:, :per_group].reshape(-1, *rest)
    return q, grouped[:, per_group].reshape(-1, *rest), grouped[:, per_group + 1].reshape(-1, *rest)


@torch.no_grad()
def load_megatron_params(hf: torch.nn.Module, full: dict[str, torch.Tensor], model: ModelConfig) -> None:
    """Copy full Megatron tensors (from `gather_full_params`) into the HF model; every HF tensor is set once."""
    target = dict(hf.state_dict())
    done: set[str] = set()
    remaining = dict(full)

    def take(name: str) -> torch.Tensor:
        return remaining.pop(name)

    def put(name: str, value: torch.Tensor) -> None:
        if target[name].shape != value.shape:
            raise AssertionError(f"{name}: HF shape {tuple(target[name].shape)} != {tuple(value.shape)}")
        target[name].copy_(value)
        done.add(name)

    put("model.embed_tokens.weight", take("embedding.word_embeddings.weight"))
    put("model.norm.weight", take("decoder.final_layernorm.weight"))
    if not model.tie_word_embeddings:
        put("lm_head.weight", take("output_layer.weight"))
    for i in range(model.num_layers):
        mg, hf_ = f"decoder.layers.{i}.", f"model.layers.{i}."
        put(hf_ + "input_layernorm.weight", take(mg + "input_layernorm.weight"))
        put(hf_ + "post_attention_layernorm.weight", take(mg + "pre_mlp_layernorm.weight"))
        q, k, v = _split_qkv(take(mg + "self_attention.linear_qkv.weight"), model)
        put(hf_ + "self_attn.q_proj.weight", q)
        put(hf_ + "self_attn.k_proj.weight", k)
        put(hf_ + "self_attn.v_proj.weight", v)
        if model.add_qkv_bias:
            qb, kb, vb = _split_qkv(take(mg + "self_attention.linear_qkv.bias"), model)
            put(hf_ + "self_attn.q_proj.bias", qb)
            put(hf_ + "self_attn.k_proj.bias", kb)
            put(hf_ + "self_attn.v_proj.bias", vb)
        put(hf_ + "self_attn.o_proj.weight", take(mg + "self_attention.linear_proj.weight"))
        if model.qk_layernorm:
            put(hf_ + "self_attn.q_norm.weight", take(mg + "self_attention.q_layernorm.weight"))
            put(hf_ + "self_attn.k_norm.weight", take(mg + "self_attention.k_layernorm.weight"))
        if mg + "mlp.router.weight" in remaining:
            put(hf_ + "mlp.gate.weight", take(mg + "mlp.router.weight"))
            experts = range(model.num_experts or 0)
            fc1 = [take(f"{mg}mlp.experts.local_experts.{e}.linear_fc1.weight") for e in experts]
            fc2 = [take(f"{mg}mlp.experts.local_experts.{e}.linear_fc2.weight") for e in experts]
            put(hf_ + "mlp.experts.gate_up_proj", torch.stack(fc1))  # [gate; up] rows in both
            put(hf_ + "mlp.experts.down_proj", torch.stack(fc2))
        else:
            gate, up = take(mg + "mlp.linear_fc1.weight").chunk(2, dim=0)
            put(hf_ + "mlp.gate_proj.weight", gate)
            put(hf_ + "mlp.up_proj.weight", up)
            put(hf_ + "mlp.down_proj.weight", take(mg + "mlp.linear_fc2.weight"))
    tied = {"lm_head.weight"} if model.tie_word_embeddings else set()
    untouched = sorted(set(target) - done - tied)
    if untouched:
        raise AssertionError(f"HF tensors without a Megatron source: {untouched}")
    if remaining:
        raise AssertionError(f"Megatron tensors with no HF destination: {sorted(remaining)}")
