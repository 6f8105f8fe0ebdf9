"""PEFT's adapter folder: adapter_config.json and adapter_model.safetensors (what
`peft.PeftModel.from_pretrained` and SGLang's /load_lora_adapter read)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from megatron_rl.config import ModelConfig
from megatron_rl.models.lora_targets import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from megatron_rl.models.safetensors_io import write_safetensors


def adapter_config(model: ModelConfig, base_path: str | None, **extra: Any) -> dict[str, Any]:
    """The adapter_config.json of `model.lora` on the base `base_path`; `extra` adds keys (e.g. the
    base's checksum)."""
    lora = model.lora
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_path,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(str(n) for n in lora.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        **extra,
    }


def write_adapter_folder(
    folder: str | os.PathLike, tensors: dict[str, torch.Tensor], config: dict[str, Any], dtype: torch.dtype
) -> int:
    """Write the PEFT folder `folder` (created); returns the bytes of adapter_model.safetensors's data."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return write_safetensors(out / ADAPTER_WEIGHTS, {k: v.to(dtype) for k, v in tensors.items()})
