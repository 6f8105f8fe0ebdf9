"""Actor checkpoints with Megatron's distributed checkpointing: model, optimizer, LR schedule, step, RNG.

Model and optimizer state are saved as sharded tensors in the layout-independent form
(`fully_reshardable` distributed-optimizer state), so a checkpoint saved under one TP/EP/PP/DP
layout loads under another. RNG states are per rank and only restored when the layout is the
same (they have no meaning on another one). Saving starts a spawned helper process that
re-imports `__main__`: scripts must keep their start-up under `if __name__ == "__main__":`.
"""

from __future__ import annotations

import copy
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
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
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


def init_torch_adam_state(opt: Any) -> None:
    """Give a torch Adam that has not stepped yet its (zero) per-parameter state, "step" included.

    Megatron's non-Apex/TE path reads "step" from every parameter's state when building the
    sharded state dict, so a fresh optimizer could neither save nor load (AssertionError in
    `DistributedOptimizer.state_dict`). Zero moments at step 0 are what Adam starts from anyway.
    """
    inner = getattr(opt, "optimizer", None)
    if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        return
    for group in inner.param_groups:
        for p in group["params"]:
            if len(inner.state[p]) == 0:
                inner.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }


def _optimizer_parts(optimizer: Any, tree: dict) -> list[dict]:
    """Per inner optimizer, its part of a (chained) optimizer state dict."""
    inner = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    return [tree] if len(inner) == 1 else [tree[i] for i in range(len(inner))]


def load_optimizer_state(optimizer: Any, request: dict, loaded: dict, step: int) -> None:
    """Load the optimizer from a checkpoint saved under any layout.

    `request`: this optimizer's own sharded state dict (is_loading=True), taken before
    `dist_checkpointing.load`; `loaded`: what the load returned for it; `step`: optimizer steps done.
    Only the per-parameter state (master weights, Adam moments; layout-independent keys) is taken
    from the checkpoint. The rest of a Megatron optimizer state dict (param groups) follows the
    running layout's structure, which differs between layouts (EP = 1 has one optimizer, EP > 1 a
    dense and an expert one), so it comes from this optimizer, with the step count of the checkpoint.

    Without Apex/Transformer Engine (the CPU) the distributed optimizer falls back to torch Adam,
    whose per-parameter "step" Megatron 0.16 mishandles: a fresh optimizer has no state to load
    into (`init_torch_adam_state`); the fully reshardable loader does not provide "step" (KeyError
    in `_set_main_param_and_optimizer_states`), so the parameter state is loaded with those entries
    set aside; and every parameter is handed the same "step" tensor, which torch increments in place
    once per parameter, so each gets its own copy.
    """
    inner = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    if not all(isinstance(opt, DistributedOptimizer) for opt in inner):
        optimizer.load_state_dict(loaded)  # same structure only: saved under the same EP setting
        inner = []
    for opt, own, got in zip(
        inner, _optimizer_parts(optimizer, request), _optimizer_parts(optimizer, loaded), strict=True
    ):
        part = dict(own)
        for group in part.get("optimizer", {}).get("param_groups", []):
            group["step"] = step
        part["param_state"] = got["param_state"]
        _load_one(opt, part)
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_opt = getattr(opt, "optimizer", None)
        if isinstance(torch_opt, (torch.optim.Adam, torch.optim.AdamW)):
            for st in torch_opt.state.values():
                if "step" in st:
                    st["step"] = st["step"].clone()


def _load_one(opt: DistributedOptimizer, part: dict) -> None:
    if part.get("param_state_sharding_type") != "fully_reshardable":
        raise ValueError(
            f"optimizer state sharded as {part.get('param_state_sharding_type')!r}, expected 'fully_reshardable'"
        )
    opt.load_state_dict({k: v for k, v in part.items() if k not in ("param_state", "param_state_sharding_type")})
    steps = {p: st.pop("step") for p, st in opt.optimizer.state.items() if "step" in st}
    try:
        opt.load_parameter_state_from_fully_reshardable(part["param_state"])
    finally:
        for p, step in steps.items():
            opt.optimizer.state[p]["step"] = step


def _without_sharded(tree: Any) -> Any:
    """A copy of a state-dict tree without its "param_state" (sharded) branches."""
    if isinstance(tree, dict):
        return {k: _without_sharded(v) for k, v in tree.items() if k != "param_state"}
    return tree


def _sharded_state(state: TrainingState, *, is_loading: bool, optimizer: bool, rng: bool) -> dict[str, Any]:
    if len(state.model) != 1:
        raise NotImplementedError(f"checkpoints of {len(state.model)} model chunks (virtual pipeline stages)")
    # Megatron adds this layout's DP group to the metadata it is given: hand it a fresh copy.
    model_sd = unwrap_model(state.model[0]).sharded_state_dict(metadata=dict(SHARDING_METADATA))
    out: dict[str, Any] = {"model": model_sd}
    if optimizer:
        for opt in getattr(state.optimizer, "chained_optimizers", [state.optimizer]):
            init_torch_adam_state(opt)
        out["optimizer"] = state.optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=dict(SHARDING_METADATA)
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
    dist_checkpointing.save(sharded, str(path), content_metadata=dict(SHARDING_METADATA))
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
    own_optimizer = copy.deepcopy(_without_sharded(sharded.get("optimizer", {})))
    loaded = dist_checkpointing.load(sharded, str(path))
    unwrap_model(state.model[0]).load_state_dict(loaded["model"])
    if load_optimizer:
        load_optimizer_state(state.optimizer, own_optimizer, loaded["optimizer"], int(common["step"]))
        state.scheduler.num_steps = 0  # Megatron's load adds the saved count to the current one
        state.scheduler.load_state_dict(common["scheduler"])
        state.step = int(common["step"])
    else:
        state.optimizer.reload_model_params()
    if same_layout:
        set_rng_state(loaded["rng_state"])
    return {"step": int(common["step"]), "saved_layout": common["layout"], "rng_restored": same_layout}
