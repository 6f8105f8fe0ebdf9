"""The one reader and writer of Megatron distributed checkpoints in this package, loadable under any layout.

A checkpoint holds the model's `sharded_state_dict` (with `SHARDING_METADATA`) under the key
`model`, and in its common state `format_version`, `step`, `layout` (the writer's, informational)
and `weights_only`. Two kinds share this format:

- weights only (`save_model_weights`: the HF -> Megatron converter): `weights_only = True`, step 0;
- training state (`megatron_rl.actor.checkpoint`): also `optimizer` (fully reshardable
  distributed-optimizer state in model space), `scheduler`, per-rank `rng_state`.

`load_model_weights` reads the `model` part of either kind; the actor reads the rest itself.

Megatron pads the vocabulary to a multiple of `make_vocab_size_divisible_by x TP`, so the
embedding and output layer (and their optimizer moments) of a checkpoint saved under one TP can
have more or fewer padding rows than the model loading it. Megatron marks those tensors
`allow_shape_mismatch`: its loader zero-fills them and reads the rows both have. Padding rows are
no tokens, so nothing else may differ: every other dimension and every other tensor must match.
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
from megatron_rl.models.torch_dist_io import DirectLoadStrategy, DirectSaveStrategy

FORMAT_VERSION = 1
SHARDING_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "singleton_local_shards": False,
    "chained_optim_avoid_prefix": True,
}


def sharding_metadata() -> dict[str, Any]:
    """A fresh copy of `SHARDING_METADATA` for one `sharded_state_dict` call: Megatron adds the current
    data-parallel group to the dict it is given, and a shared dict would keep the group of an earlier layout."""
    return dict(SHARDING_METADATA)


def running_layout() -> dict[str, int]:
    """The parallel layout of this process (stored in the checkpoint)."""
    return {
        "world_size": dist.get_world_size(),
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
        "expert_tensor_parallel_size": ps.get_expert_tensor_parallel_world_size(),
        "data_parallel_size": ps.get_data_parallel_world_size(),
    }


def model_chunk(chunks: list[torch.nn.Module]) -> torch.nn.Module:
    """The one model chunk of this rank, without its DDP / Float16Module wrappers."""
    if len(chunks) != 1:
        raise NotImplementedError(f"checkpoints of {len(chunks)} model chunks (virtual pipeline stages)")
    return unwrap_model(chunks[0])


def model_sharded_state_dict(chunks: list[torch.nn.Module]) -> dict[str, Any]:
    """The `model` part of a checkpoint, as written and as the optimizer's sharded state refers to it."""
    return model_chunk(chunks).sharded_state_dict(metadata=sharding_metadata())


def write_checkpoint(
    path: str | os.PathLike,
    model: dict[str, Any],
    *,
    step: int,
    weights_only: bool,
    extra: dict[str, Any] | None = None,
    fsync: bool = True,
) -> dict[str, str]:
    """Write a checkpoint folder `path` (created if missing); collective over all ranks. Returns the
    SHA-256 of each shard file this rank wrote (name in `path` -> hex), computed while writing.

    `model`: a `model_sharded_state_dict`; `extra`: more top-level entries, sharded (optimizer, RNG)
    or plain values that go to the common state (scheduler, the source of a conversion);
    `fsync`: sync the files to disk before returning (a training checkpoint must survive a crash).
    """
    path = Path(path)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    sharded: dict[str, Any] = {"model": model}
    sharded.update(extra or {})
    sharded.update(format_version=FORMAT_VERSION, step=step, layout=running_layout(), weights_only=weights_only)
    strategy = DirectSaveStrategy(fsync=fsync)
    dist_checkpointing.save(sharded, str(path), sharded_strategy=strategy, content_metadata=sharding_metadata())
    dist.barrier()
    return strategy.written_digests()


def save_model_weights(
    chunks: list[torch.nn.Module], path: str | os.PathLike, extra: dict[str, Any] | None = None
) -> None:
    """Write the weights of `chunks` as a weights-only checkpoint to `path`; collective over all ranks.
    `extra` adds plain values to the common state (e.g. the source of a conversion). Like a Hugging Face
    folder written by `save_pretrained`, the files are left to the OS to write back (no fsync)."""
    write_checkpoint(path, model_sharded_state_dict(chunks), step=0, weights_only=True, extra=extra, fsync=False)


def read_common_state(path: str | os.PathLike) -> dict[str, Any]:
    """The common (non-sharded) state of a checkpoint folder; ConversionError if it is not one of ours."""
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

    visit(chunk.sharded_state_dict(metadata=sharding_metadata()))
    return out


def check_checkpoint_tensors(chunk: torch.nn.Module, path: str, saved: dict[str, Any]) -> None:
    """Raise ConversionError naming the first tensor the model needs that `saved` (the checkpoint's
    tensor metadata) lacks or shapes otherwise; the padded vocabulary rows may differ."""
    for tensor in _model_tensors(chunk):
        stored = saved.get(tensor.key)
        if stored is None:
            raise ConversionError(
                f"{path}: the checkpoint has no tensor {tensor.key!r} (the model has shape {list(tensor.global_shape)})"
            )
        want, have = tuple(tensor.global_shape), tuple(stored.global_shape)
        if tensor.allow_shape_mismatch:  # the vocabulary dimension, padded for the saving TP
            want, have = want[1:], have[1:]
        if want != have:
            raise ConversionError(
                f"{path}: tensor {tensor.key!r} has shape {list(stored.global_shape)} in the checkpoint, "
                f"but the model has {list(tensor.global_shape)}"
            )


@torch.no_grad()
def load_model_weights(chunks: list[torch.nn.Module], path: str | os.PathLike) -> dict[str, Any]:
    """Load the `model` part of a checkpoint of either kind into `chunks` under the running layout
    (vocabulary re-padded for this TP); collective. Returns the checkpoint's common state."""
    path = str(path)
    common = read_common_state(path)
    chunk = model_chunk(chunks)
    check_checkpoint_tensors(chunk, path, dist_checkpointing.load_tensors_metadata(path))
    sharded = chunk.sharded_state_dict(metadata=sharding_metadata())
    factories = {k: v for k, v in sharded.items() if isinstance(v, ShardedTensorFactory)}
    # Built factories are views of the parameters (e.g. the two SwiGLU halves of linear_fc1), and the
    # reader fills the given tensors in place: no merge, no second copy.
    apply_factories(sharded)
    loaded = dist_checkpointing.load({"model": sharded}, path, sharded_strategy=DirectLoadStrategy())["model"]
    _copy_unless_in_place(chunk, loaded, factories, path)
    return common


def _inside(leaf: Any, target: torch.Tensor) -> bool:
    if not isinstance(leaf, torch.Tensor) or leaf.dtype != target.dtype or leaf.device != target.device:
        return False
    start, end = target.data_ptr(), target.data_ptr() + target.numel() * target.element_size()
    return start <= leaf.data_ptr() and leaf.data_ptr() + leaf.numel() * leaf.element_size() <= end


def _copy_unless_in_place(
    chunk: torch.nn.Module, loaded: dict[str, Any], factories: dict[str, ShardedTensorFactory], path: str
) -> None:
    """Copy into each parameter what was not read into its memory directly (e.g. another dtype);
    factory parts are merged first."""
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
