"""Check a TP/PP/CP/EP/ETP layout against the world size and the model, before anything is built.

Only the world size is needed, not a process group: `megatron_rl.validation` makes the check with
the launch's WORLD_SIZE before Megatron is imported, `init_distributed` again as it builds the groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_rl.config import Config, ConfigError, ModelConfig, ParallelConfig, check_rules


class LayoutError(ConfigError):
    """A parallel layout that does not fit the world size or the model's widths; `world_sizes` is what
    the world size must be a multiple of when that is the problem (else None)."""

    def __init__(self, message: str, world_sizes: int | None = None) -> None:
        super().__init__(message)
        self.world_sizes = world_sizes


@dataclass(frozen=True)
class ParallelLayout:
    """Resolved sizes of every parallel dimension for one world size."""

    world_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    expert_model_parallel_size: int
    expert_tensor_parallel_size: int
    context_parallel_size: int
    data_parallel_size: int
    expert_data_parallel_size: int
    sequence_parallel: bool


def resolve_sequence_parallel(parallel: ParallelConfig) -> bool:
    """`parallel.sequence_parallel`, where null means on whenever TP > 1."""
    if parallel.sequence_parallel is None:
        return parallel.tensor_model_parallel_size > 1
    return bool(parallel.sequence_parallel)


def resolve_expert_tensor_parallel(parallel: ParallelConfig) -> int:
    """`parallel.expert_tensor_parallel_size`, where null means the same as TP."""
    etp = parallel.expert_tensor_parallel_size
    return parallel.tensor_model_parallel_size if etp is None else etp


def _require(ok: bool, message: str, world_sizes: int | None = None) -> None:
    if not ok:
        raise LayoutError(message, world_sizes)


def check_layout(parallel: ParallelConfig, world_size: int, model: ModelConfig | None = None) -> ParallelLayout:
    """The resolved layout, or ConfigError naming the keys that cannot run on `world_size` ranks.

    With `model`, the model/parallel combinations of `megatron_rl.config.check_rules` are checked too
    (EP divides the experts, TP divides the heads, PP divides the layers, ...) plus the widths.
    """
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    cp = parallel.context_parallel_size
    ep, etp = parallel.expert_model_parallel_size, resolve_expert_tensor_parallel(parallel)
    sp = resolve_sequence_parallel(parallel)
    if model is not None:
        check_rules(Config(model=model, parallel=parallel))
        _require(
            model.ffn_hidden_size % tp == 0,
            f"parallel.tensor_model_parallel_size ({tp}) must divide model.ffn_hidden_size ({model.ffn_hidden_size})",
        )
        if model.num_experts is not None:
            _require(
                model.moe_ffn_hidden_size % etp == 0,
                f"parallel.expert_tensor_parallel_size ({etp}) must divide model.moe_ffn_hidden_size "
                f"({model.moe_ffn_hidden_size})",
            )
    fits = math.lcm(tp * pp * cp, etp * ep * pp)
    _require(
        world_size % (tp * pp * cp) == 0,
        f"world size {world_size} is not divisible by parallel.tensor_model_parallel_size ({tp}) x "
        f"parallel.pipeline_model_parallel_size ({pp})"
        + (f" x parallel.context_parallel_size ({cp})" if cp > 1 else ""),
        fits,
    )
    _require(
        world_size % (etp * ep * pp) == 0,
        f"world size {world_size} is not divisible by parallel.expert_tensor_parallel_size ({etp}) x "
        f"parallel.expert_model_parallel_size ({ep}) x parallel.pipeline_model_parallel_size ({pp})",
        fits,
    )
    _require(
        not (sp and tp == 1),
        "parallel.sequence_parallel = true needs parallel.tensor_model_parallel_size > 1",
    )
    return ParallelLayout(
        world_size=world_size,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        context_parallel_size=cp,
        data_parallel_size=world_size // (tp * pp * cp),
        expert_data_parallel_size=world_size // (etp * ep * pp),
        sequence_parallel=sp,
    )
