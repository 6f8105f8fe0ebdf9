"""Which core attention the local specs run (`model.attention_backend`); torch-free, so the validation reads it.

- `local`: Megatron's `DotProductAttention` (a [b x heads, s, s] score buffer, an unfused fp32 softmax), packed
  sequences one at a time (`packed_attention`), under context parallelism `context_attention`.
- `sdpa`: `models.sdpa_attention.SDPAttention` (torch's fused attention, varlen attention for packs on CUDA).
- `auto`: `sdpa` with CUDA, `local` on the CPU (where SDPA is faster, docs/benchmarks.md, but moves the
  log-probs by up to ~1.5e-5 from transformers' eager attention, past the 1e-5 the equality tests hold the
  local specs to: force `sdpa` for speed) and under context parallelism, whose attention gathers the keys
  over the CP ranks and is local's.

Attention sinks (gpt-oss), sliding-window layers (gpt-oss, Gemma 2 and 3), attention soft-capping (Gemma 2) and
DeepSeek sparse attention (DeepSeek-V3.2, GLM-5: `models.dsa_attention`, on either spec) run `local` only (`local_attention_only`): SDPA computes none of them, and the context-parallel attention builds its
own causal mask, which Megatron's sliding-window softmax would replace by one that assumes the queries are the
sequence's last positions. `auto` is `local` there; `sdpa` and CP > 1 are refused.

With Transformer Engine its own attention runs; the key chooses among the local specs only. Gemma's layers are
built on the local specs wherever Transformer Engine is (`transformer_engine_layers`).
"""

from __future__ import annotations

from megatron_rl.config import ConfigError, ModelConfig, ParallelConfig
from megatron_rl.models.families import FAMILIES, is_gpt_oss, is_linear_attention, is_sparse_attention


def local_attention_only(model: ModelConfig) -> str | None:
    """What of `model` only Megatron's local core attention computes among the local specs' attentions, None when
    any of them does."""
    window = model.sliding_window is not None
    if is_sparse_attention(model):
        return "DeepSeek sparse attention"
    if is_gpt_oss(model):
        return "attention sinks and sliding-window layers" if window else "attention sinks"
    if window:
        return "sliding-window layers"
    if model.attn_logit_softcapping is not None:
        return "attention logit soft-capping"
    return None


def transformer_engine_layers(model: ModelConfig, *, available: bool) -> bool:
    """Whether `model` is built from Transformer Engine's layer specs where TE is `available`: never Gemma's
    (`models.gemma` builds on the local specs), nor Qwen3-Next's and Qwen3.5's (`models.gated_delta`)."""
    spec = FAMILIES.get(model.family)
    return available and not (spec is not None and (spec.gemma or spec.linear_attention))


def use_sdpa(model: ModelConfig, parallel: ParallelConfig, *, cuda: bool) -> bool:
    """Whether the local specs' core attention is `SDPAttention` (`cuda`: the model runs on a GPU)."""
    if model.attention_backend == "auto":
        return cuda and parallel.context_parallel_size == 1 and local_attention_only(model) is None
    return model.attention_backend == "sdpa"


def check_attention_backend(model: ModelConfig, parallel: ParallelConfig, *, transformer_engine: bool) -> None:
    """ConfigError for a backend that cannot run: `sdpa` under context parallelism, `local`/`sdpa` with
    Transformer Engine (its attention runs there)."""
    choice = model.attention_backend
    cp = parallel.context_parallel_size
    if cp > 1 and is_sparse_attention(model):  # either spec: models.dsa_attention
        raise ConfigError(
            f"parallel.context_parallel_size = {cp}: model.family = {model.family!r} has DeepSeek sparse attention, "
            "whose indexer picks keys from the whole sequence, not split over CP ranks: set it to 1"
        )
    if is_linear_attention(model):
        _check_linear_attention_layout(model, parallel)
    only = local_attention_only(model)
    if only is not None and not transformer_engine and (choice == "sdpa" or cp > 1):
        key = f"model.attention_backend = {choice}" if choice == "sdpa" else f"parallel.context_parallel_size = {cp}"
        raise ConfigError(
            f"{key}: model.family = {model.family!r} has {only}, which only Megatron's local attention computes, "
            "without context parallelism"
        )
    if choice == "auto":
        return
    if transformer_engine:
        raise ConfigError(
            f"model.attention_backend = {choice} chooses the local specs' attention, but Transformer Engine's "
            "runs here; set it to auto"
        )
    if choice == "sdpa" and parallel.context_parallel_size > 1:
        raise ConfigError(
            f"model.attention_backend = sdpa does not run under context parallelism (parallel.context_parallel_size "
            f"= {parallel.context_parallel_size}: its keys are gathered over the CP ranks by the local attention); "
            "set it to auto or local"
        )


def _check_linear_attention_layout(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Gated DeltaNet layers (`models.gated_delta`) split over TP by key heads (each rank a key head's value heads
    with it), and run without context parallelism: the recurrence over a sequence split across CP ranks would pass
    its state from rank to rank (Megatron-Core 0.16 has no such path)."""
    tp, cp = parallel.tensor_model_parallel_size, parallel.context_parallel_size
    if cp > 1:
        raise ConfigError(
            f"parallel.context_parallel_size = {cp}: model.family = {model.family!r} has Gated DeltaNet layers, "
            "whose recurrent state is not passed over CP ranks: set it to 1 (TP, EP, ETP and PP are supported)"
        )
    linear = model.linear_attention
    for key, heads in (("num_key_heads", linear.num_key_heads), ("num_value_heads", linear.num_value_heads)):
        if heads % tp:
            raise ConfigError(
                f"parallel.tensor_model_parallel_size ({tp}) must divide model.linear_attention.{key} ({heads}): "
                "Gated DeltaNet layers split over TP by heads"
            )
