"""LoRA checkpoints: the adapters (and, with the actor's training state, their optimizer state) alone,
with the base they adapt: its folder and a SHA-256 over its config.json and safetensors files.

The adapters are sharded tensors keyed by their PEFT names (`lora.AdapterContainer`), so they load
under any layout; the base is rebuilt from `model.hf_path`, whose checksum must be the saved one.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from megatron_rl.config import ModelConfig
from megatron_rl.models.checkpoint_io import model_chunk, read_common_state, sharding_metadata
from megatron_rl.models.hf_config import ConversionError
from megatron_rl.models.lora import ADAPTER_KEY_PREFIX

COMMON_KEY = "lora"  # the checkpoint's common-state entry: {"base_path", "base_sha256", "rank", "alpha", ...}


def base_checksum(folder: str | os.PathLike) -> str:
    """SHA-256 over the base folder's config.json and *.safetensors (names and bytes, sorted by name)."""
    digest = hashlib.sha256()
    files = sorted(p for p in Path(folder).iterdir() if p.name == "config.json" or p.suffix == ".safetensors")
    for file in files:
        digest.update(file.name.encode() + b"\0")
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()


def base_record(model: ModelConfig) -> dict[str, Any]:
    """What a LoRA checkpoint says of its base and adapters; rank 0 hashes the base, every rank gets it."""
    box: list[Any] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        path = model.hf_path
        box[0] = {
            "base_path": str(Path(path).resolve()) if path else None,
            "base_sha256": base_checksum(path) if path else None,
            "rank": model.lora.rank,
            "alpha": float(model.lora.alpha),
            "target_modules": sorted(str(n) for n in model.lora.target_modules),
        }
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def adapter_entries(model_state: dict[str, Any]) -> dict[str, Any]:
    """The adapters' entries of a model sharded state dict (what a LoRA checkpoint's `model` holds)."""
    return {k: v for k, v in model_state.items() if k.startswith(ADAPTER_KEY_PREFIX)}


def check_adapters(path: str | os.PathLike, common: dict[str, Any], base: dict[str, Any] | None) -> None:
    """ConversionError when the checkpoint `path` (its common state `common`) and this run disagree on
    LoRA: adapters in one and not the other, or another base, rank, alpha or set of targets than
    `base` (this run's `base_record`; None: a run without LoRA)."""
    saved = common.get(COMMON_KEY)
    if saved is None and base is None:
        return
    if base is None:
        raise ConversionError(
            f"{path}: the checkpoint holds LoRA adapters (rank {saved.get('rank')}, alpha {saved.get('alpha')}, "
            f"targets {saved.get('target_modules')}, base {saved.get('base_path')}) and this run has none "
            "(model.lora.rank = 0): load it with the same model.lora settings"
        )
    if saved is None:
        raise ConversionError(
            f"{path}: not a LoRA checkpoint (the whole model, no adapters) and this run trains LoRA adapters "
            f"(model.lora.rank = {base.get('rank')}): load it with model.lora.rank = 0"
        )
    for key in ("base_sha256", "rank", "alpha", "target_modules"):
        if saved.get(key) != base.get(key):
            raise ConversionError(
                f"{path}: the adapters were trained with {key} = {saved.get(key)!r} (base {saved.get('base_path')}), "
                f"this run has {base.get(key)!r} (base {base.get('base_path')})"
            )


@torch.no_grad()
def load_adapter_weights(
    chunks: list[torch.nn.Module], path: str | os.PathLike, base: dict[str, Any]
) -> dict[str, Any]:
    """Load the adapters of the LoRA checkpoint `path` into `chunks` (collective); its common state.

    ConversionError when `path` holds no adapters (a full checkpoint) or adapts another base or
    another rank, alpha or set of targets than `base` (this run's `base_record`)."""
    common = read_common_state(path)
    check_adapters(path, common, base)
    adapters = adapter_entries(model_chunk(chunks).sharded_state_dict(metadata=sharding_metadata()))
    loaded = dist_checkpointing.load({"model": adapters}, str(path))["model"]
    for key, tensor in adapters.items():
        if loaded[key] is not tensor.data:
            tensor.data.copy_(loaded[key])
    return common
