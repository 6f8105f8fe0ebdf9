"""Which module runs the routed experts (`model.moe_grouped_gemm`); torch-free, so the validation reads it.

- With Transformer Engine: its grouped experts (`TEGroupedMLP`), or with `false` Megatron's `SequentialMLP` of
  Transformer Engine linears.
- Local specs: `models.grouped_experts.GroupedExperts` (one `torch._grouped_mm` per projection) or Megatron's
  `SequentialMLP` (the experts one after another). `auto` takes the grouped experts with CUDA and on the CPU
  (measured: docs/benchmarks.md), wherever torch's grouped GEMM takes the widths.

gpt-oss's experts have biases, which `GroupedExperts` has not (and whose names in Transformer Engine's grouped
experts, `bias{i}`, the exporter does not map): they run as `SequentialMLP` (`auto`), and `true` is refused.

`torch._grouped_mm` takes rows whose stride is a multiple of 16 bytes: model.hidden_size and
model.moe_ffn_hidden_size / expert-TP must be multiples of 4 elements in fp32 and of 8 in bf16 and fp16. `auto` runs
the loop where they are not; `true` is refused there (`check_grouped_experts`).
"""

from __future__ import annotations

from megatron_rl.config import ConfigError, ModelConfig, ParallelConfig
from megatron_rl.models.families import is_gpt_oss
from megatron_rl.parallel.layout import resolve_expert_tensor_parallel

ALIGN_BYTES = 16
_ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def unaligned_widths(model: ModelConfig, parallel: ParallelConfig) -> list[str]:
    """The expert widths torch's grouped GEMM cannot take, as `key (value)`; empty when it takes them all."""
    align = ALIGN_BYTES // _ELEMENT_BYTES[model.params_dtype]
    etp = resolve_expert_tensor_parallel(parallel)
    widths = {
        "model.hidden_size": model.hidden_size,
        "model.moe_ffn_hidden_size / expert-TP": model.moe_ffn_hidden_size // etp,
    }
    return [f"{key} ({value})" for key, value in widths.items() if value % align]


def use_grouped_experts(model: ModelConfig, parallel: ParallelConfig, *, transformer_engine: bool) -> bool:
    """Whether the routed experts run as grouped GEMMs (Transformer Engine's, else torch's)."""
    choice = model.moe_grouped_gemm
    if model.num_experts is None or choice is False:
        return False
    if is_gpt_oss(model):
        return False
    return transformer_engine or choice is True or not unaligned_widths(model, parallel)


def check_grouped_experts(model: ModelConfig, parallel: ParallelConfig, *, transformer_engine: bool) -> None:
    """ConfigError when `model.moe_grouped_gemm = true` asks torch's grouped GEMM for widths it cannot take, or for
    biased experts; and for biased experts split over expert-TP, which Megatron-Core 0.16 supports with expert-TP 1
    only (its TransformerConfig asserts it)."""
    etp = resolve_expert_tensor_parallel(parallel)
    if model.num_experts is not None and is_gpt_oss(model) and etp > 1:
        raise ConfigError(
            f"parallel.expert_tensor_parallel_size = {etp} (null means TP): model.family = {model.family!r} has "
            "biased experts, which Megatron-Core supports with expert-TP 1 only; set it to 1"
        )
    if model.num_experts is None or model.moe_grouped_gemm is not True:
        return
    if is_gpt_oss(model):
        raise ConfigError(
            f"model.moe_grouped_gemm = true: the grouped experts take no biases, which model.family = "
            f"{model.family!r} has; set it to auto or false"
        )
    if transformer_engine:
        return
    bad = unaligned_widths(model, parallel)
    if bad:
        raise ConfigError(
            f"model.moe_grouped_gemm = true: torch._grouped_mm needs rows of a multiple of {ALIGN_BYTES} bytes, "
            f"but in {model.params_dtype} {', '.join(bad)} are not; set it to auto or false"
        )
