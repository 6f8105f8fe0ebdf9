"""Model builder pieces that need no process group: vocabulary padding, families, TransformerConfig, shards."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rl.config import ConfigError, ModelConfig, ParallelConfig
from megatron_rl.models.builder import padded_vocab_size, transformer_config
from megatron_rl.models.families import check_family, moe_layer_pattern
from megatron_rl.models.init import ParamShard, deterministic_full_tensor, take_shard
from megatron_rl.models.shard_gather import join_shards


@pytest.mark.parametrize(
    ("vocab", "divisible_by", "tp", "padded"),
    [(300, 128, 1, 384), (300, 128, 2, 512), (151936, 128, 1, 151936), (151936, 128, 4, 152064), (256, 128, 2, 256)],
)
def test_padded_vocab_size(vocab: int, divisible_by: int, tp: int, padded: int) -> None:
    assert padded_vocab_size(vocab, divisible_by, tp) == padded


@pytest.mark.parametrize(
    ("layers", "freq", "first_dense", "pattern"),
    [(4, 1, 0, [1, 1, 1, 1]), (4, 2, 0, [0, 1, 0, 1]), (4, 1, 1, [0, 1, 1, 1]), (6, 2, 2, [0, 0, 0, 1, 0, 1])],
)
def test_moe_layer_pattern(layers: int, freq: int, first_dense: int, pattern: list[int]) -> None:
    model = ModelConfig(num_layers=layers, moe_layer_freq=freq, first_k_dense_layers=first_dense)
    assert moe_layer_pattern(model) == pattern


def test_moe_layer_pattern_needs_one_moe_layer() -> None:
    with pytest.raises(ConfigError, match=r"model.moe_layer_freq \(4\) .* leaves no MoE layer"):
        moe_layer_pattern(ModelConfig(num_layers=2, moe_layer_freq=4))
    assert moe_layer_pattern(ModelConfig(family="qwen3", num_layers=2, num_experts=None)) == [0, 0]


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        (dict(family="qwen2", num_experts=None), "model.family = 'qwen2' needs model.qk_layernorm = false"),
        (dict(family="qwen2", num_experts=None, qk_layernorm=False), "needs model.add_qkv_bias = true"),
        (dict(family="qwen3"), "model.family = 'qwen3' is dense: set model.num_experts = null (got 8)"),
        (dict(num_experts=None), "model.family = 'qwen3_moe' is a mixture of experts: set model.num_experts"),
        (dict(family="mixtral", qk_layernorm=False, moe_router_norm_topk=False), "model.moe_router_norm_topk = true"),
    ],
)
def test_family_contradictions_name_the_key(fields: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        check_family(ModelConfig(**fields))
    assert needle in str(err.value)


def test_qwen3_moe_transformer_config() -> None:
    model = ModelConfig(num_layers=4, first_k_dense_layers=1, rope_theta=1e6, norm_epsilon=1e-6)
    cfg = transformer_config(model, ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2))
    # Router: softmax over all experts, top-k, renormalised == softmax of the top-k logits.
    assert (cfg.moe_router_score_function, cfg.moe_router_pre_softmax, cfg.moe_router_topk) == ("softmax", False, 2)
    assert cfg.moe_router_topk_scaling_factor is None and cfg.moe_router_dtype == "fp32"
    assert (cfg.moe_router_load_balancing_type, cfg.moe_aux_loss_coeff) == ("none", 0.0)
    assert cfg.moe_expert_capacity_factor is None and cfg.moe_shared_expert_intermediate_size is None
    assert cfg.moe_layer_freq == [0, 1, 1, 1] and cfg.num_moe_experts == 8 and cfg.moe_ffn_hidden_size == 128
    assert (cfg.normalization, cfg.layernorm_epsilon, cfg.qk_layernorm) == ("RMSNorm", 1e-6, True)
    assert cfg.gated_linear_unit and cfg.activation_func is torch.nn.functional.silu
    assert not cfg.add_bias_linear and not cfg.add_qkv_bias
    assert (cfg.hidden_dropout, cfg.attention_dropout) == (0.0, 0.0)
    assert (cfg.tensor_model_parallel_size, cfg.expert_model_parallel_size, cfg.expert_tensor_parallel_size) == (
        2,
        2,
        2,
    )
    assert cfg.sequence_parallel and not cfg.moe_enable_routing_replay and cfg.recompute_granularity is None


def test_transformer_config_options() -> None:
    no_renorm = transformer_config(ModelConfig(moe_router_norm_topk=False), ParallelConfig())
    assert no_renorm.moe_router_pre_softmax  # top-k of softmax(all), not renormalised
    aux = transformer_config(ModelConfig(moe_aux_loss_coeff=0.01), ParallelConfig())
    assert (aux.moe_router_load_balancing_type, aux.moe_aux_loss_coeff) == ("aux_loss", 0.01)
    replay = transformer_config(ModelConfig(recompute=True), ParallelConfig(), enable_routing_replay=True)
    assert replay.moe_enable_routing_replay
    assert (replay.recompute_granularity, replay.recompute_method, replay.recompute_num_layers) == (
        "full",
        "uniform",
        1,
    )
    bf16 = transformer_config(ModelConfig(params_dtype="bf16"), ParallelConfig(pipeline_model_parallel_size=2))
    assert bf16.params_dtype is torch.bfloat16 and bf16.pipeline_dtype is torch.bfloat16 and bf16.bf16
    qwen2 = ModelConfig(family="qwen2", num_experts=None, qk_layernorm=False, add_qkv_bias=True)
    dense = transformer_config(qwen2, ParallelConfig(), overrides={"calculate_per_token_loss": True})
    assert dense.num_moe_experts is None and dense.add_qkv_bias and dense.calculate_per_token_loss
    with pytest.raises(ValueError, match="routing replay needs an MoE model"):
        transformer_config(qwen2, ParallelConfig(), enable_routing_replay=True)


def _shard(shape: tuple[int, ...], dim: int | None, rank: int, count: int, sections: tuple[int, ...]) -> ParamShard:
    return ParamShard("w", "w", torch.nn.Parameter(torch.empty(shape)), dim, rank, count, sections, False)


def test_take_shard_splits_sections_separately() -> None:
    full = torch.arange(8.0).reshape(8, 1)  # rows 0-3 gate, 4-7 up
    assert take_shard(full, _shard((4, 1), 0, 0, 2, (4, 4))).flatten().tolist() == [0, 1, 4, 5]
    assert take_shard(full, _shard((4, 1), 0, 1, 2, (4, 4))).flatten().tolist() == [2, 3, 6, 7]
    assert take_shard(full, _shard((4, 1), 0, 1, 2, ())).flatten().tolist() == [4, 5, 6, 7]
    # DeltaNet's in_proj: [q, k, v, z, b, a] of 2, 2, 4, 4, 2, 2 rows, each section halved over 2 ranks
    rows = torch.arange(16.0).reshape(16, 1)
    first = _shard((8, 1), 0, 0, 2, (2, 2, 4, 4, 2, 2))
    assert take_shard(rows, first).flatten().tolist() == [0, 2, 4, 5, 8, 9, 12, 14]
    second = dataclasses.replace(first, shard_rank=1)
    assert take_shard(rows, second).flatten().tolist() == [1, 3, 6, 7, 10, 11, 13, 15]
    joined = join_shards(first, [take_shard(rows, first), take_shard(rows, second)], torch.empty(rows.shape))
    assert torch.equal(joined, rows)
    columns = torch.arange(6.0).reshape(1, 6)
    assert take_shard(columns, _shard((1, 2), 1, 2, 3, ())).tolist() == [[4, 5]]
    assert take_shard(columns, _shard((1, 6), None, 0, 3, ())) is columns


def test_deterministic_values_depend_on_name_only() -> None:
    model = ModelConfig(vocab_size=300)
    emb = deterministic_full_tensor("embedding.word_embeddings.weight", (384, 8), model, seed=5)
    emb_tp2 = deterministic_full_tensor("embedding.word_embeddings.weight", (512, 8), model, seed=5)
    assert torch.equal(emb[:300], emb_tp2[:300]) and not emb[:300].eq(0).all()
    assert emb[300:].eq(0).all() and emb_tp2[300:].eq(0).all()  # vocabulary padding
    a = deterministic_full_tensor("decoder.layers.0.mlp.linear_fc2.weight", (8, 16), model, seed=5)
    assert torch.equal(a, deterministic_full_tensor("decoder.layers.0.mlp.linear_fc2.weight", (8, 16), model, 5))
    assert not torch.equal(a, deterministic_full_tensor("decoder.layers.1.mlp.linear_fc2.weight", (8, 16), model, 5))
    assert not torch.equal(a, deterministic_full_tensor("decoder.layers.0.mlp.linear_fc2.weight", (8, 16), model, 6))
    norm = deterministic_full_tensor("decoder.final_layernorm.weight", (4096,), model, seed=5)
    assert 0.99 < norm.mean().item() < 1.01 and 0.09 < norm.std().item() < 0.11


def test_a_lora_rank_is_bounded_by_the_narrowest_adapted_layer() -> None:
    """A rank above min(inputs, outputs) of an adapted linear cannot be used (a 1-step run of rank 100000 on a
    width-128 model took 93 s instead of 17 s): refused naming the key, the value and the bound."""
    from megatron_rl.config import LoraConfig
    from megatron_rl.models.lora_rank import check_lora_rank

    def lora(rank: int, *targets: str, **fields: object) -> ModelConfig:
        return ModelConfig(lora=LoraConfig(rank=rank, target_modules=list(targets)), **fields)

    # hidden 128, 4 heads of 32, 2 KV groups: q_proj 128 x 128, k_proj and v_proj 128 -> 64, o_proj 128 -> 128
    with pytest.raises(ConfigError) as err:
        check_lora_rank(lora(100000, "q_proj"))
    assert str(err.value) == (
        "model.lora.rank = 100000 exceeds 128, the narrowest adapted layer's width (q_proj: 128 inputs, "
        "128 outputs); an adapter's rank is at most min(inputs, outputs)"
    )
    check_lora_rank(lora(128, "q_proj", "o_proj"))
    with pytest.raises(ConfigError, match=r"= 65 exceeds 64, .*\(k_proj: 128 inputs, 64 outputs\)"):
        check_lora_rank(lora(65, "q_proj", "k_proj"))
    # the routed experts (width 16) of an MoE model without dense layers: its dense width (8) adapts nothing
    experts = dict(moe_ffn_hidden_size=16, ffn_hidden_size=8)
    check_lora_rank(lora(16, "gate_proj", "down_proj", **experts))
    with pytest.raises(ConfigError, match=r"= 17 exceeds 16, .*\(down_proj: 16 inputs, 128 outputs\)"):
        check_lora_rank(lora(17, "down_proj", **experts))
    with pytest.raises(ConfigError, match=r"= 9 exceeds 8, .*\(up_proj: 128 inputs, 8 outputs\)"):
        check_lora_rank(lora(9, "up_proj", first_k_dense_layers=1, **experts))  # a dense first layer
    with pytest.raises(ConfigError, match=r"= 9 exceeds 8, .*\(w2: 8 inputs, 128 outputs\)"):
        check_lora_rank(lora(9, "w2", family="mixtral", qk_layernorm=False, moe_ffn_hidden_size=8))
    check_lora_rank(lora(64, "gate_proj", family="qwen3", num_experts=None, ffn_hidden_size=64))
