"""Colocated GPU memory: what the trainer gives back while the engine works (`rollout.colocate_offload`).

The plan of a colocated step (engines started with `--enable-memory-saver` and slurm/jobplan.py's
default `--mem-fraction-static`): the engines release weights and KV cache before the trainer builds
its state (`release_colocated_engines`, at start-up) and before each update (`WeightSync.release_engine_memory`);
before the engines resume, every trainer rank empties its CUDA cache and, with
`rollout.colocate_offload`, moves its optimizer state (Adam's moments: twice the fp32 parameters of
its shard) to pinned host memory; it comes back when the engines release again, before training.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from megatron_rl.rollout.engine import configured_api_key
from megatron_rl.rollout.sglang import SGLangClient
from megatron_rl.rollout.types import MEMORY_TAGS

if TYPE_CHECKING:
    from megatron_rl.config import Config
    from megatron_rl.rollout.event_loop import RolloutLoop


def optimizer_state_tensors(optimizer: Any) -> Iterator[tuple[dict, str]]:
    """(state dict, key) of every tensor in a (chained) Megatron optimizer's inner torch state."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", part)
        for state in getattr(inner, "state", {}).values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    yield state, key


class OptimizerOffload:
    """Moves an optimizer's state tensors to pinned host memory and back (CUDA state only)."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self._devices: dict[tuple[int, str], torch.device] = {}

    @property
    def offloaded(self) -> bool:
        return bool(self._devices)

    @torch.no_grad()
    def to_host(self) -> int:
        """Offload; returns the bytes moved."""
        moved = 0
        for state, key in optimizer_state_tensors(self.optimizer):
            tensor = state[key]
            if tensor.device.type != "cuda":
                continue
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            self._devices[(id(state), key)] = tensor.device
            state[key] = host
            moved += tensor.numel() * tensor.element_size()
        if moved:
            torch.cuda.synchronize()
        return moved

    @torch.no_grad()
    def to_device(self) -> None:
        for state, key in optimizer_state_tensors(self.optimizer):
            device = self._devices.pop((id(state), key), None)
            if device is not None:
                state[key] = state[key].to(device, non_blocking=True)
        if self._devices:
            raise RuntimeError(f"optimizer offload: {len(self._devices)} state tensors were not found to bring back")


def empty_cuda_cache() -> None:
    """Give the CUDA caching allocator's free blocks back to the driver, so the engine can take them."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def release_colocated_engines(cfg: Config, loop: RolloutLoop) -> bool:
    """Rank 0, before the trainer builds its model and optimizer: ask running colocated SGLang servers
    (`rollout.colocate`, `rollout.sglang_urls`; an sglang-router's workers, which it lists: the router
    answers the memory endpoints with an empty 404) to release their memory, on `loop`. Whether it applies (the
    same on every rank: the next weight sync must then resume the engines, so the trainer syncs at once)."""
    if not colocated_engines_released(cfg):
        return False
    ro = cfg.rollout

    async def release() -> None:
        async with SGLangClient(
            list(ro.sglang_urls),
            api_key=configured_api_key(ro),
            timeout_s=ro.request_timeout_s,
            admin_api_key=ro.admin_api_key,
        ) as client:
            await client.wait_healthy(timeout_s=ro.request_timeout_s)
            await client.use_router()
            await client.release_memory_occupation(list(MEMORY_TAGS))

    loop.run(release(), 3 * ro.request_timeout_s)  # the health wait, the router's discovery, the release
    return True


def colocated_engines_released(cfg: Config) -> bool:
    """Whether `release_colocated_engines` applies to `cfg` (computable on every rank)."""
    ro = cfg.rollout
    return bool(ro.colocate and ro.engine == "sglang" and ro.sglang_urls)
