"""Actor checkpoints: model, optimizer, LR schedule, step and RNG, through `megatron_rl.models.checkpoint_io`.

The format, the writer and the model-weights reader are `checkpoint_io`'s (one path for both
kinds of checkpoint); this module adds the training state. Model and optimizer state are saved as
sharded tensors in the layout-independent form (`fully_reshardable` distributed-optimizer state,
in model space), so a checkpoint saved under one TP/EP/PP/DP layout loads under another, also
when the padded vocabulary differs (see `checkpoint_io`). RNG states are per rank and only
restored under the same layout (they have no meaning on another one). A weights-only checkpoint
(the converter's) loads under any layout, with the optimizer state, schedule, step and RNG left
as they are. Saving starts a spawned helper process that re-imports `__main__`: scripts must keep
their start-up under `if __name__ == "__main__":`.
"""

from __future__ import annotations

import copy
import os
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from megatron_rl.actor.optimizer import TrainingState
from megatron_rl.models.checkpoint_io import (
    load_model_weights,
    model_sharded_state_dict,
    read_common_state,
    running_layout,
    sharding_metadata,
    write_checkpoint,
)
from megatron_rl.models.lora_checkpoint import COMMON_KEY as LORA_COMMON_KEY
from megatron_rl.models.lora_checkpoint import adapter_entries, check_adapters, load_adapter_weights


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


def _optimizer_sharded_state(state: TrainingState, model: dict[str, Any], *, is_loading: bool) -> dict[str, Any]:
    for opt in getattr(state.optimizer, "chained_optimizers", [state.optimizer]):
        init_torch_adam_state(opt)
    return state.optimizer.sharded_state_dict(model, is_loading=is_loading, metadata=sharding_metadata())


def _rng_sharded_state() -> ShardedObject:
    world, rank = dist.get_world_size(), dist.get_rank()
    return ShardedObject("rng_state", rng_state(), (world,), (rank,), replica_id=0)


def save_checkpoint(
    state: TrainingState, path: str | os.PathLike, *, lora: dict[str, Any] | None = None
) -> dict[str, str]:
    """Write `state` to the folder `path` (created; collective over all ranks); returns the SHA-256
    of each shard file this rank wrote (`write_checkpoint`). `lora`: a LoRA run's `base_record`: the
    model part holds the adapters alone (the optimizer has no other state), and the record goes along."""
    model = model_sharded_state_dict(state.model)
    extra: dict[str, Any] = {
        "optimizer": _optimizer_sharded_state(state, model, is_loading=False),
        "rng_state": _rng_sharded_state(),
        "scheduler": state.scheduler.state_dict(),
    }
    if lora is not None:
        model = adapter_entries(model)
        extra[LORA_COMMON_KEY] = lora
    return write_checkpoint(path, model, step=state.step, weights_only=False, extra=extra)


def load_checkpoint(
    state: TrainingState, path: str | os.PathLike, *, load_optimizer: bool = True, lora: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Load `path` (either kind, see the module doc) into `state` under the running layout; collective.
    `lora`: a LoRA run's `base_record`: the checkpoint's adapters are loaded (the base is the run's).

    Without `load_optimizer`, or from a weights-only checkpoint, only the weights (the optimizer's
    master copy is refreshed from them; its moments, the schedule and the step stay). Returns
    {"step": of the checkpoint, "saved_layout", "weights_only", "optimizer_loaded", "rng_restored"}.
    """
    if lora is None:
        check_adapters(path, read_common_state(path), None)  # a LoRA checkpoint: named, not a missing tensor
        common = load_model_weights(state.model, path)
    else:
        common = load_adapter_weights(state.model, path, lora)
    weights_only = bool(common.get("weights_only", False))
    with_optimizer = load_optimizer and not weights_only
    same_layout = not weights_only and common["layout"] == running_layout()
    request: dict[str, Any] = {}
    if with_optimizer:
        request["optimizer"] = _optimizer_sharded_state(state, model_sharded_state_dict(state.model), is_loading=True)
        own_optimizer = copy.deepcopy(_without_sharded(request["optimizer"]))
    if same_layout:
        request["rng_state"] = _rng_sharded_state()
    loaded = dist_checkpointing.load(request, str(path)) if request else {}
    step = int(common["step"])
    if with_optimizer:
        load_optimizer_state(state.optimizer, own_optimizer, loaded["optimizer"], step)
        state.scheduler.num_steps = 0  # Megatron's load adds the saved count to the current one
        state.scheduler.load_state_dict(common["scheduler"])
        state.step = step
    else:
        state.optimizer.reload_model_params()
    if same_layout:
        set_rng_state(loaded["rng_state"])
    return {
        "step": step,
        "saved_layout": common["layout"],
        "weights_only": weights_only,
        "optimizer_loaded": with_optimizer,
        "rng_restored": same_layout,
    }
