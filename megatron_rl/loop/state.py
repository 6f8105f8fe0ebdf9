"""Loop checkpoints: CKPT_DIR/step_NNNNNN/{actor/, loop_state.pt}, the latest one, pruning, RNG state.

The actor checkpoint (model, optimizer, schedule, per-rank RNG) is written first, collectively;
rank 0 then writes `loop_state.pt` (the step, the prompt sampler's position, rank 0's Python,
NumPy and torch RNG states and the rollout seed) to a temporary name and renames it, so a folder
holding `loop_state.pt` is complete: a run killed while saving leaves a folder `latest_checkpoint`
skips. Rollout sampling needs no engine state: every request's `sampling_seed` is derived from
(train.seed, step, round, index) (`megatron_rl.loop.collect.sampling_seed`).
"""

from __future__ import annotations

import os
import random
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

LOOP_STATE_FILE = "loop_state.pt"
ACTOR_DIR = "actor"
_STEP_DIR = re.compile(r"^step_(\d+)$")
FORMAT_VERSION = 1


def checkpoint_dir(ckpt_root: str | Path, step: int) -> Path:
    return Path(ckpt_root) / f"step_{step:06d}"


def capture_rng() -> dict[str, Any]:
    """This process's Python, NumPy and torch (CPU) generator states."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


@dataclass
class LoopState:
    """What the loop itself needs to continue where a checkpoint was taken."""

    step: int
    sampler: dict[str, Any]
    rollout_seed: int
    rng: dict[str, Any] = field(default_factory=capture_rng)
    format_version: int = FORMAT_VERSION


def save_loop_state(folder: str | Path, state: LoopState) -> Path:
    """Write `state` into the checkpoint `folder` atomically (rank 0 only); returns the file."""
    path = Path(folder) / LOOP_STATE_FILE
    tmp = path.with_name(path.name + ".tmp")
    torch.save(asdict(state), tmp)
    os.replace(tmp, path)
    return path


def load_loop_state(folder: str | Path) -> LoopState:
    path = Path(folder) / LOOP_STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no loop state (not a complete megatron-rl train checkpoint)")
    data = torch.load(path, weights_only=False)  # our own file: Python/NumPy RNG tuples are not tensors
    if data.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: loop state format {data.get('format_version')}, this code reads {FORMAT_VERSION}")
    return LoopState(**data)


def checkpoints(ckpt_root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `ckpt_root` as (step, folder), oldest first."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / LOOP_STATE_FILE).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(ckpt_root: str | Path) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    found = checkpoints(ckpt_root)
    return found[-1][1] if found else None


def prune_checkpoints(ckpt_root: str | Path, keep_last: int) -> list[Path]:
    """Remove all but the newest `keep_last` complete checkpoints, and incomplete folders older
    than the newest complete one; returns the removed folders."""
    root = Path(ckpt_root)
    complete = checkpoints(root)
    doomed = [path for _, path in complete[:-keep_last]] if keep_last > 0 else []
    if complete:
        newest = complete[-1][0]
        for child in root.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and int(match.group(1)) < newest and not (child / LOOP_STATE_FILE).is_file():
                doomed.append(child)
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed
