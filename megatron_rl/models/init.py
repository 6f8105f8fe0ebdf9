"""Where each local parameter sits in the global model, and layout-independent weights.

Every parameter of a rank's model chunks is described by a `ParamShard`: its global name
(global layer number across PP stages, global expert id across EP, Transformer Engine's fused
names mapped to the local-spec ones, a tied output layer mapped to the embedding) and how the
full tensor is split over TP (or expert-TP for experts). With that:

- `init_deterministic` gives every parameter values drawn from `seed` and its global name, then
  takes this rank's shard, so any TP/PP/EP layout holds exactly the weights of the world-size-1
  model: the basis of every cross-layout equivalence test.
- `gather_full_params` rebuilds the full tensors (for tests and small models).
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_rl.config import ModelConfig
from megatron_rl.models.shard_gather import join_shards

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
_GROUPED_EXPERT = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.weight(\d+)$")
_TE_FUSED_NORMS = {
    ".self_attention.linear_qkv.layer_norm_weight": ".input_layernorm.weight",
    ".mlp.linear_fc1.layer_norm_weight": ".pre_mlp_layernorm.weight",
    ".self_attention.linear_q_up_proj.layer_norm_weight": ".self_attention.q_layernorm.weight",  # MLA
    ".self_attention.linear_kv_up_proj.layer_norm_weight": ".self_attention.kv_layernorm.weight",
}
# Buffers that are model state: the sigmoid router's expert bias (fp32; HF's e_score_correction_bias).
_STATE_BUFFERS = (".mlp.router.expert_bias",)
_VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass(frozen=True)
class ParamShard:
    """One local parameter (or state buffer: the expert bias) and its place in the global model."""

    local_name: str
    global_name: str
    param: torch.nn.Parameter
    partition_dim: int | None  # None = not split over (expert-)TP
    shard_rank: int
    shard_count: int
    # dim-0 sections of the full tensor split separately, each rank holding its part of every section in order
    # (SwiGLU fc1's [gate; up], DeltaNet's in_proj and conv1d); () = split in one piece
    sections: tuple[int, ...]
    is_expert: bool

    @property
    def full_shape(self) -> tuple[int, ...]:
        shape = list(self.param.shape)
        if self.partition_dim is not None:
            shape[self.partition_dim] *= self.shard_count
        return tuple(shape)


def _global_name(local_name: str, chunk: torch.nn.Module, tied: bool) -> str:
    name = local_name
    for te_name, local in _TE_FUSED_NORMS.items():
        if name.endswith(te_name):
            name = name[: -len(te_name)] + local
    if tied and name == "output_layer.weight":
        name = "embedding.word_embeddings.weight"
    layer_match = _LAYER.match(name)
    if layer_match is None:
        return name
    layer = chunk.decoder.layers[int(layer_match.group(1))]
    name = f"decoder.layers.{layer.layer_number - 1}." + name[layer_match.end() :]
    grouped = _GROUPED_EXPERT.search(name)
    if grouped is not None:
        expert = layer.mlp.local_expert_indices[int(grouped.group(2))]
        return name[: grouped.start()] + f".mlp.experts.local_experts.{expert}.{grouped.group(1)}.weight"
    local = _LOCAL_EXPERT.search(name)
    if local is not None:
        expert = layer.mlp.local_expert_indices[int(local.group(1))]
        return name[: local.start()] + f".mlp.experts.local_experts.{expert}." + name[local.end() :]
    return name


def iter_param_shards(chunks: list[torch.nn.Module], model: ModelConfig) -> Iterator[ParamShard]:
    """Every parameter of this rank's chunks, in a fixed order (the same on TP/EP peers)."""
    tp = (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
    etp = (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())
    for chunk in chunks:
        for local_name, buffer in chunk.named_buffers():
            if local_name.endswith(_STATE_BUFFERS):  # replicated on every rank, never split
                yield ParamShard(
                    local_name=local_name,
                    global_name=_global_name(local_name, chunk, model.tie_word_embeddings),
                    param=buffer,  # type: ignore[arg-type]
                    partition_dim=None,
                    shard_rank=0,
                    shard_count=1,
                    sections=(),
                    is_expert=False,
                )
        for local_name, param in chunk.named_parameters():
            if local_name.startswith("lora_adapters."):
                continue  # low-rank adapters: models.lora places them itself
            is_expert = ".mlp.experts." in local_name
            rank, count = etp if is_expert else tp
            split = getattr(param, "tensor_model_parallel", False) and count > 1
            yield ParamShard(
                local_name=local_name,
                global_name=_global_name(local_name, chunk, model.tie_word_embeddings),
                param=param,
                partition_dim=_partition_dim(local_name, param) if split else None,
                shard_rank=rank,
                shard_count=count,
                sections=_row_sections(chunk, local_name, param, count) if split else (),
                is_expert=is_expert,
            )


def _row_sections(chunk: torch.nn.Module, local_name: str, param: torch.nn.Parameter, count: int) -> tuple[int, ...]:
    """The full sizes of the dim-0 sections of a split parameter that are split separately (`ParamShard.sections`):
    a SwiGLU fc1's two halves, or what the owning module's `tp_row_sections(name)` gives (DeltaNet's)."""
    if chunk.config.gated_linear_unit and _is_fc1(local_name):
        half = param.shape[0] * count // 2
        return (half, half)
    path = local_name.split(".")
    for cut in range(len(path) - 1, 0, -1):  # the nearest module up the path that says
        sections = getattr(chunk.get_submodule(".".join(path[:cut])), "tp_row_sections", None)
        if sections is not None:
            return sections(".".join(path[cut:]))
    return ()


def _partition_dim(local_name: str, param: torch.nn.Parameter) -> int:
    """The dimension a split parameter is split on. Grouped experts (TE's `GroupedLinear`,
    `weight{i}`): from the role, fc1 (column-parallel) on 0 and fc2 (row-parallel) on 1. With
    explicit expert comms Megatron hides the parallelism from TE, which then tags every `weight{i}`
    with partition dim 0, fc2 included. Every other parameter: Megatron's tag, or dim 0 where it tags none
    (DeltaNet's conv1d, A_log and dt_bias: split with the heads)."""
    grouped = _GROUPED_EXPERT.search(local_name)
    if grouped is not None:
        return 0 if grouped.group(1) == "linear_fc1" else 1
    return getattr(param, "partition_dim", 0)


def _is_fc1(name: str) -> bool:
    grouped = _GROUPED_EXPERT.search(name)
    return name.endswith("linear_fc1.weight") or (grouped is not None and grouped.group(1) == "linear_fc1")


def seeded_generator(seed: int, name: str) -> torch.Generator:
    """A generator whose draws depend on `seed` and `name` only (the same on every rank and layout)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def deterministic_full_tensor(
    global_name: str, full_shape: tuple[int, ...], model: ModelConfig, seed: int
) -> torch.Tensor:
    """The fp32 value of one global parameter: a function of `seed` and its name only.

    Norm weights 1 + 0.1·N(0,1); biases 0.1·N(0,1); the embedding N(0,1); other matrices
    N(0,1)/sqrt(fan_in), so activations and logits are O(1) and a wrong shard shows. Rows of the
    vocabulary padding are zero, so models with different padding (different TP) agree.
    """
    gen = seeded_generator(seed, global_name)
    if global_name in _VOCAB_PARAMS:
        rows = min(model.vocab_size, full_shape[0])
        values = torch.randn((rows, *full_shape[1:]), generator=gen)
        if global_name == "output_layer.weight":
            values /= math.sqrt(full_shape[1])
        full = torch.zeros(full_shape)
        full[:rows] = values
        return full
    values = torch.randn(full_shape, generator=gen)
    if len(full_shape) == 1:
        return (1.0 + 0.1 * values) if global_name.endswith("norm.weight") else 0.1 * values
    return values / math.sqrt(full_shape[1])


def take_shard(full: torch.Tensor, shard: ParamShard) -> torch.Tensor:
    """This rank's part of a full tensor, split the way Megatron splits it."""
    if shard.partition_dim is None:
        return full
    if shard.sections:  # e.g. [gate; up]: each rank holds [gate_r; up_r]
        parts = full.split(list(shard.sections), dim=0)
        return torch.cat([part.chunk(shard.shard_count, dim=0)[shard.shard_rank] for part in parts], dim=0)
    return full.chunk(shard.shard_count, dim=shard.partition_dim)[shard.shard_rank]


@torch.no_grad()
def init_deterministic(chunks: list[torch.nn.Module], model: ModelConfig, seed: int = 0) -> None:
    """Set every parameter to its layout-independent value (see `deterministic_full_tensor`)."""
    for shard in iter_param_shards(chunks, model):
        full = deterministic_full_tensor(shard.global_name, shard.full_shape, model, seed)
        shard.param.copy_(take_shard(full, shard))


@torch.no_grad()
def gather_full_params(chunks: list[torch.nn.Module], model: ModelConfig) -> dict[str, torch.Tensor]:
    """Every global parameter as a full fp32 CPU tensor, on every rank (all-gathers the whole model:
    for tests and small models). Vocabulary rows are cut to `model.vocab_size`."""
    mine: dict[str, torch.Tensor] = {}
    for shard in iter_param_shards(chunks, model):
        local = shard.param.detach()
        if shard.partition_dim is not None:
            group = ps.get_expert_tensor_parallel_group() if shard.is_expert else ps.get_tensor_model_parallel_group()
            parts = [torch.empty_like(local) for _ in range(shard.shard_count)]
            dist.all_gather(parts, local.contiguous(), group=group)
            local = join_shards(shard, parts, local.new_empty(shard.full_shape))
        if shard.global_name in _VOCAB_PARAMS:
            local = local[: model.vocab_size]
        mine[shard.global_name] = local.float().cpu()
    everyone: list[dict[str, torch.Tensor]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, mine)
    merged: dict[str, torch.Tensor] = {}
    for part in everyone:
        merged.update(part)
    return merged
