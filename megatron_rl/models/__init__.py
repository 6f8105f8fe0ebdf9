"""Megatron-Core model builders (and, per family, the HF <-> Megatron parameter mapping)."""

from megatron_rl.models.builder import (
    build_model,
    decoder_block_spec,
    padded_vocab_size,
    transformer_config,
    transformer_engine_available,
)
from megatron_rl.models.families import FAMILIES, FamilySpec, check_family, moe_layer_pattern
from megatron_rl.models.init import (
    ParamShard,
    deterministic_full_tensor,
    gather_full_params,
    init_deterministic,
    iter_param_shards,
    take_shard,
)
from megatron_rl.models.norm import SequenceParallelRMSNorm

__all__ = [
    "FAMILIES",
    "FamilySpec",
    "ParamShard",
    "SequenceParallelRMSNorm",
    "build_model",
    "check_family",
    "decoder_block_spec",
    "deterministic_full_tensor",
    "gather_full_params",
    "init_deterministic",
    "iter_param_shards",
    "moe_layer_pattern",
    "padded_vocab_size",
    "take_shard",
    "transformer_config",
    "transformer_engine_available",
]
