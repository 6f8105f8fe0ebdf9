"""Actor checkpoints with Megatron's distributed checkpointing: model, optimizer, LR schedule, step, RNG.

Model and optimizer state are saved as sharded tensors in the layout-independent form
(`fully_reshardable` distributed-optimizer state), so a checkpoint saved under one TP/EP/PP/DP
layout loads under another. RNG states are per rank and only restored when the layout is the
same (they have no meaning on another one). Saving starts a spawned helper process that
re-imports `__main__`: scripts must keep their start-up under `if __name__ == "__main__":`.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.utils import unwrap_model

from megatron_rl.actor.optimizer import TrainingState

FORMAT_VERSION = 1
SHARDING_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "singleton_local_shards": False,
    "chained_optim_avoid_prefix": True,
}


def parallel_layout() -> dict[str, int]:
    """The running layout, stored with the checkpoint."""
    return {
        "world_size": dist.get_world_size(),
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
        "expert_tensor_parallel_size": ps.get_expert_tensor_parallel_world_size(),
        "data_parallel_size": ps.get_data_parallel_world_size(),
    }


def rng_state() -> dict[str, Any]:
    """Python, NumPy, torch (and CUDA) generators plus Megatron's model-parallel RNG tracker."""
    return {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded_state(state: TrainingState, *, is_loading: bool, optimizer: bool, rng: bool) -> dict[str, Any]:
    if len(state.model) != 1:
        raise NotImplementedError(f"checkpoints of {len(state.model)} model chunks (virtual pipeline stages)")
    model_sd = unwrap_model(state.model[0]).sharded_state_dict(metadata=SHARDING_METADATA)
    out: dict[str, Any] = {"model": model_sd}
    if optimizer:
        out["optimizer"] = state.optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=SHARDING_METADATA
        )
    if rng:
        world, rank = dist.get_world_size(), dist.get_rank()
        out["rng_state"] = ShardedObject("rng_state", rng_state(), (world,), (rank,), replica_id=0)
    return out


def save_checkpoint(state: TrainingState, path: str | os.PathLike) -> None:
    """Write `state` to the folder `path` (created; collective over all ranks)."""
    path = Path(path)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    sharded = _sharded_state(state, is_loading=False, optimizer=True, rng=True)
    sharded.update(
        format_version=FORMAT_VERSION,
        step=state.step,
        scheduler=state.scheduler.state_dict(),
        layout=parallel_layout(),
    )
    dist_checkpointing.save(sharded, str(path), content_metadata=SHARDING_METADATA)
    dist.barrier()


def load_checkpoint(state: TrainingState, path: str | os.PathLike, *, load_optimizer: bool = True) -> dict[str, Any]:
    """Load `path` into `state` under the running layout; returns {"step", "saved_layout", "rng_restored"}.

    Without `load_optimizer`, only the weights (the optimizer's master copy is refreshed from them).
    """
    path = Path(path)
    if not (path / "common.pt").exists() and not dist_checkpointing.check_is_distributed_checkpoint(str(path)):
        raise FileNotFoundError(f"{path} is not a Megatron distributed checkpoint (checkpoint.load)")
    common = dist_checkpointing.load_common_state_dict(str(path))
    if common.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {common.get('format_version')}, this code reads {FORMAT_VERSION}")
    same_layout = common["layout"] == parallel_layout()
    sharded = _sharded_state(state, is_loading=True, optimizer=load_optimizer, rng=same_layout)
    loaded = dist_checkpointing.load(sharded, str(path))
    unwrap_model(state.model[0]).load_state_dict(loaded["model"])
    if load_optimizer:
        state.optimizer.load_state_dict(loaded["optimizer"])
        state.scheduler.load_state_dict(common["scheduler"])
        state.step = int(common["step"])
    else:
        state.optimizer.reload_model_params()
    if same_layout:
        set_rng_state(loaded["rng_state"])
    return {"step": int(common["step"]), "saved_layout": common["layout"], "rng_restored": same_layout}
