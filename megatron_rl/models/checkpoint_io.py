"""Model weights as a Megatron distributed checkpoint (no optimizer), loadable under any layout.

The format is the actor's (`megatron_rl.actor.checkpoint`): the model's `sharded_state_dict`
with the same sharding metadata under the key `model`, plus `format_version`, `step` and
`layout` in the common state; `weights_only = True` marks a checkpoint without optimizer,
schedule or RNG state. `load_model_weights` reads the `model` part of either kind.

Megatron pads the vocabulary to a multiple of `make_vocab_size_divisible_by x TP`, so the
embedding and output layer of a checkpoint saved under one TP can have more or fewer padding rows
than the model loading it; they are read whole and re-padded (padding rows are not tokens).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedTensor,
    ShardedTensorFactory,
    apply_factories,
    apply_factory_merges,
)
from megatron.core.utils import unwrap_model

from megatron_rl.models.hf_config import ConversionError

FORMAT_VERSION = 1  # == megatron_rl.actor.checkpoint.FORMAT_VERSION
SHARDING_METADATA = {  # == megatron_rl.actor.checkpoint.SHARDING_METADATA (tests check both)
    "distrib_optim_sharding_type": "fully_reshardable",
    "singleton_local_shards": False,
    "chained_optim_avoid_prefix": True,
}
VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _metadata() -> dict[str, Any]:
    """A fresh copy: Megatron's `sharded_state_dict` adds the current data-parallel group to the
    dict it is given, and a module-level dict would keep the group of an earlier layout."""
    return dict(SHARDING_METADATA)


def running_layout() -> dict[str, int]:
    """The parallel layout of this process (stored in the checkpoint, informational)."""
    return {
        "world_size": dist.get_world_size(),
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
        "expert_tensor_parallel_size": ps.get_expert_tensor_parallel_world_size(),
        "data_parallel_size": ps.get_data_parallel_world_size(),
    }


def _single_chunk(chunks: list[torch.nn.Module]) -> torch.nn.Module:
    if len(chunks) != 1:
        raise NotImplementedError(f"checkpoints of {len(chunks)} model chunks (virtual pipeline stages)")
    return unwrap_model(chunks[0])


def save_model_weights(
    chunks: list[torch.nn.Module], path: str | os.PathLike, extra: dict[str, Any] | None = None
) -> None:
    """Write the weights of `chunks` to the (existing, empty) folder `path`; collective over all ranks.
    `extra` adds plain values to the common state (e.g. the source of a conversion)."""
    sharded: dict[str, Any] = {"model": _single_chunk(chunks).sharded_state_dict(metadata=_metadata())}
    sharded.update(format_version=FORMAT_VERSION, step=0, layout=running_layout(), weights_only=True)
    sharded.update(extra or {})
    dist_checkpointing.save(sharded, str(path), content_metadata=_metadata())
    dist.barrier()


def read_common_state(path: str | os.PathLike) -> dict[str, Any]:
    """The common (non-sharded) state of a checkpoint folder; ConversionError if it is not one."""
    path = Path(path)
    if not path.is_dir() or not dist_checkpointing.check_is_distributed_checkpoint(str(path)):
        raise ConversionError(f"{path} is not a Megatron distributed checkpoint (no metadata.json)")
    common = dist_checkpointing.load_common_state_dict(str(path))
    if common.get("format_version") != FORMAT_VERSION:
        raise ConversionError(
            f"{path}: checkpoint format {common.get('format_version')}, this code reads {FORMAT_VERSION}"
        )
    return common


def _model_tensors(chunk: torch.nn.Module) -> list[ShardedTensor]:
    """The model's ShardedTensors as they are stored (factories applied)."""
    out: list[ShardedTensor] = []

    def visit(values: Any) -> None:
        for value in nested_values(values):
            if isinstance(value, ShardedTensorFactory):
                built = value.build()
                visit(built if isinstance(built, (dict, list)) else [built])
            elif isinstance(value, ShardedTensor):
                out.append(value)

    visit(chunk.sharded_state_dict(metadata=_metadata()))
    return out


def check_checkpoint_tensors(chunk: torch.nn.Module, path: str, saved: dict[str, Any]) -> None:
    """Raise ConversionError naming the first tensor the model needs that `saved` lacks or shapes otherwise."""
    for tensor in _model_tensors(chunk):
        stored = saved.get(tensor.key)
        if stored is None:
            raise ConversionError(
                f"{path}: the checkpoint has no tensor {tensor.key!r} (the model has shape {list(tensor.global_shape)})"
            )
        want, have = tuple(tensor.global_shape), tuple(stored.global_shape)
        if tensor.key in VOCAB_KEYS:
            want, have = want[1:], have[1:]
        if want != have:
            raise ConversionError(
                f"{path}: tensor {tensor.key!r} has shape {list(stored.global_shape)} in the checkpoint, "
                f"but the model has {list(tensor.global_shape)}"
            )


def _repad_vocab(full: torch.Tensor, padded_rows: int) -> torch.Tensor:
    rows = min(full.shape[0], padded_rows)
    out = full.new_zeros(padded_rows, *full.shape[1:])
    out[:rows] = full[:rows]
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    return out.chunk(tp, dim=0)[rank]


@torch.no_grad()
def load_model_weights(chunks: list[torch.nn.Module], path: str | os.PathLike) -> None:
    """Load the `model` part of a distributed checkpoint (this package's converter's or the actor's)
    into `chunks` under the running layout; collective."""
    path = str(path)
    read_common_state(path)
    chunk = _single_chunk(chunks)
    saved = dist_checkpointing.load_tensors_metadata(path)
    check_checkpoint_tensors(chunk, path, saved)
    sharded = chunk.sharded_state_dict(metadata=_metadata())
    repad: dict[str, tuple[int, ...]] = {}
    for name, value in list(sharded.items()):
        if isinstance(value, ShardedTensor) and value.key in VOCAB_KEYS:
            shape = tuple(saved[value.key].global_shape)
            if shape != tuple(value.global_shape):
                sharded[name] = ShardedTensor.from_rank_offsets(
                    value.key, torch.empty(shape, dtype=value.data.dtype, device=value.data.device), replica_id=0
                )
                repad[name] = tuple(value.global_shape)
    factories = {k: v for k, v in sharded.items() if isinstance(v, ShardedTensorFactory)}
    # Built factories are views of the parameters (e.g. the two SwiGLU halves of linear_fc1), and the
    # reader fills the given tensors in place: no merge, no second copy.
    apply_factories(sharded)
    loaded = dist_checkpointing.load({"model": sharded}, path, validate_access_integrity=not repad)["model"]
    for name, global_shape in repad.items():
        loaded[name] = _repad_vocab(loaded[name], global_shape[0])
    _copy_unless_in_place(chunk, loaded, factories, path)


def _inside(leaf: Any, target: torch.Tensor) -> bool:
    if not isinstance(leaf, torch.Tensor) or leaf.dtype != target.dtype or leaf.device != target.device:
        return False
    start, end = target.data_ptr(), target.data_ptr() + target.numel() * target.element_size()
    return start <= leaf.data_ptr() and leaf.data_ptr() + leaf.numel() * leaf.element_size() <= end


def _copy_unless_in_place(
    chunk: torch.nn.Module, loaded: dict[str, Any], factories: dict[str, ShardedTensorFactory], path: str
) -> None:
    """Copy into each parameter what was not read into its memory directly (re-padded vocabulary,
    another dtype); factory parts are merged first."""
    pending: dict[str, Any] = {}
    for name, target in chunk.state_dict(keep_vars=True).items():
        if name.endswith("_extra_state"):
            continue
        if name not in loaded:
            raise ConversionError(f"{path}: nothing was loaded for parameter {name!r}")
        value = loaded[name]
        leaves = list(nested_values(value)) if isinstance(value, (dict, list)) else [value]
        if not all(_inside(leaf, target) for leaf in leaves):
            pending[name] = value
    if not pending:
        return
    merged = apply_factory_merges(pending, {k: f for k, f in factories.items() if k in pending})
    params = chunk.state_dict(keep_vars=True)
    for name, value in merged.items():
        params[name].copy_(value)
