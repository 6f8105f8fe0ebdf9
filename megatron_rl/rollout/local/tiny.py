"""Tiny random Hugging Face models for tests, benchmarks and reduced-size examples (no downloads)."""

from __future__ import annotations

from typing import Any

import torch


def tiny_config(family: str = "qwen3_moe", **overrides: Any) -> Any:
    """A small config of `family` (qwen3_moe, qwen3, qwen2, mixtral); `overrides` replace its fields."""
    from transformers import MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common: dict[str, Any] = dict(
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
    )
    if family == "qwen3_moe":
        base = dict(head_dim=8, intermediate_size=64, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2)
        cls = Qwen3MoeConfig
    elif family == "mixtral":
        base = dict(head_dim=8, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)
        cls = MixtralConfig
    elif family == "qwen3":
        base = dict(head_dim=8, intermediate_size=64)
        cls = Qwen3Config
    elif family == "qwen2":
        base = dict(intermediate_size=64)
        cls = Qwen2Config
    else:
        raise ValueError(f"family {family!r}: allowed qwen3_moe, qwen3, qwen2, mixtral")
    return cls(**{**common, **base, **overrides})


def make_tiny_model(folder: str, family: str = "qwen3_moe", seed: int = 0, **overrides: Any) -> str:
    """Save a randomly initialised model of `family` to `folder` (checkpoint names); returns `folder`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
    model.save_pretrained(folder)
    return folder
