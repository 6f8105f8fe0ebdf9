"""The actor's LoRA adapters: attached after the base is loaded, started from `model.lora.init_path`.

`models.lora` holds the adapters themselves; this module decides what the actor starts them from
(PEFT's initialisation drawn from `train.seed`, or a PEFT folder) and counts what trains.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.actor.forward import LogProbResult
from megatron_rl.actor.policy import FrozenPolicy
from megatron_rl.config import Config
from megatron_rl.models.init import iter_param_shards
from megatron_rl.models.lora import (
    LoraState,
    adapters_disabled,
    attach_lora,
    gather_adapters,
    load_adapters,
    trainable_params,
)
from megatron_rl.models.lora_targets import ADAPTER_WEIGHTS
from megatron_rl.models.peft_format import adapter_config, write_adapter_folder
from megatron_rl.models.safetensors_io import MappedSafetensors


def read_adapter_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the PEFT folder's adapter_model.safetensors, as fp32 copies."""
    mapped = MappedSafetensors(Path(folder) / ADAPTER_WEIGHTS)
    return {name: mapped.get(name).float().clone() for name in mapped.entries if name != "__metadata__"}


def attach_actor_lora(chunks: list[torch.nn.Module], cfg: Config) -> LoraState:
    """Freeze `chunks` and attach the adapters of `cfg.model.lora` (loaded from its init_path when set)."""
    state = attach_lora(chunks, cfg.model, seed=cfg.train.seed)
    if cfg.model.lora.init_path:
        load_adapters(state, read_adapter_tensors(cfg.model.lora.init_path))
    return state


def count_trainable(state: LoraState | None, chunks: list[torch.nn.Module], cfg: Config) -> int:
    """Trainable parameters of the whole model, each global tensor once: the adapters with LoRA, else
    every parameter (collective)."""
    if state is not None:
        return trainable_params(state)
    sizes = {s.global_name: math.prod(s.full_shape) for s in iter_param_shards(chunks, cfg.model)}
    everyone: list[dict[str, int]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, sizes)
    return sum({k: v for part in everyone for k, v in part.items()}.values())


class AdaptersOffReference:
    """The KL reference of a LoRA run: the actor's own module with the adapters off (the frozen base),
    so no second copy of the weights exists. Its log-probs are what `FrozenPolicy` of the base gives."""

    def __init__(self, actor: Any) -> None:
        if actor.lora is None:
            raise ValueError("AdaptersOffReference needs an actor with LoRA adapters (model.lora.rank > 0)")
        self.actor = actor

    def compute_log_probs(
        self, batch: ActorBatch, *, record_routing: bool = False, replay_routing: bool = False
    ) -> LogProbResult:
        with adapters_disabled(self.actor.lora):
            return self.actor.compute_log_probs(batch, record_routing=record_routing, replay_routing=replay_routing)

    def close(self) -> None:
        """Nothing of its own to release: the module is the actor's."""


def start_reference(cfg: Config, actor: Any) -> AdaptersOffReference | FrozenPolicy:
    """The run's KL reference: with LoRA and no `algorithm.ref_path` the actor with its adapters off,
    else a `FrozenPolicy` (the start policy, or ref_path); collective."""
    if actor.lora is not None and cfg.algorithm.ref_path is None:
        return AdaptersOffReference(actor)
    return FrozenPolicy.start(cfg)


BASE_RECORD_FILE = "megatron_rl_base.json"  # next to adapter_config.json: the base's path and SHA-256


def save_adapter_folder(actor: Any, out: str | Path, base_path: str | None) -> None:
    """The actor's adapters as a PEFT folder `out` (adapter_config.json naming `base_path`,
    adapter_model.safetensors in the training dtype, and `BASE_RECORD_FILE`); collective, rank 0 writes."""
    import json
    import shutil

    tensors = gather_adapters(actor.lora)
    if dist.get_rank() == 0:
        out = Path(out)
        if out.exists():
            shutil.rmtree(out)
        dtype = next(p for p in actor.chunks[0].parameters() if p.requires_grad).dtype
        write_adapter_folder(out, tensors, adapter_config(actor.cfg.model, base_path), dtype)
        (out / BASE_RECORD_FILE).write_text(json.dumps(actor.lora_base, indent=2) + "\n", encoding="utf-8")
    dist.barrier()
