"""The run folder's layout: what marks a run in it, moving a run aside (`--force`), the writable check.

RUN_DIR/config.yaml                               the resolved config
RUN_DIR/metrics.jsonl                             the step records (`megatron_rl.metrics`)
RUN_DIR/.run.lock                                 the lock of the run using it (`lock.RunLock`)
CKPT_DIR/step_NNNNNN/                             the checkpoints (`megatron_rl.checkpoints`);
                                                  CKPT_DIR: checkpoint.dir, default RUN_DIR/checkpoints
RUN_DIR/weights/                                  the disk weight sync's folders: rollout.sync_dir's default
RUN_DIR/hf, RUN_DIR/hf_start                      the policy as a Hugging Face folder
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from megatron_rl.checkpoints import checkpoint_folders
from megatron_rl.config import Config, ConfigError
from megatron_rl.metrics import METRICS_FILE

# what a run leaves in its run folder: a fresh run into a folder holding one of these is refused
# (metrics.jsonl only when it holds a record: a run stopped during its start-up leaves it empty)
RUN_MARKERS = (METRICS_FILE, "hf")


def sync_folder(cfg: Config) -> Path:
    """Where the disk weight sync writes the weights for the engines: rollout.sync_dir, else RUN_DIR/weights."""
    return Path(cfg.rollout.sync_dir or Path(cfg.logging.run_dir) / "weights").resolve()


def _holds_records(path: Path) -> bool:
    return path.name != METRICS_FILE or (path.stat().st_size > 0 and bool(path.read_bytes().strip()))


def run_contents(run_dir: Path, ckpt_root: Path) -> list[Path]:
    """What a run left in `run_dir` (metrics with a record, exports) and `ckpt_root` (checkpoint
    folders, finished or not)."""
    found = [run_dir / name for name in RUN_MARKERS if (run_dir / name).exists() and _holds_records(run_dir / name)]
    return found + checkpoint_folders(ckpt_root)


def aside(path: Path) -> Path:
    """PATH.old-N for the first N >= 1 that does not exist."""
    n = 1
    while path.with_name(f"{path.name}.old-{n}").exists():
        n += 1
    return path.with_name(f"{path.name}.old-{n}")


def moved_path(path: Path, moved: list[tuple[Path, Path]]) -> Path:
    """Where `path` is after `move_run_aside` renamed the folders `moved`."""
    for old, new in moved:
        if path.is_relative_to(old):
            return new / path.relative_to(old)
    return path


def move_run_aside(run_dir: Path, ckpt_root: Path) -> list[tuple[Path, Path]]:
    """Rename `run_dir` (and `ckpt_root` when it is outside it) to PATH.old-N; returns (from, to)."""
    moved = []
    for path in (run_dir, ckpt_root):
        if path.exists() and not (path != run_dir and path.resolve().is_relative_to(run_dir.resolve())):
            target = aside(path)
            os.rename(path, target)
            moved.append((path, target))
    return moved


def check_inputs_outside(cfg: Config, folders: list[Path]) -> None:
    """--force moves `folders` aside: refuse when the run reads its model, data or reference there."""
    inputs = {
        "model.hf_path": cfg.model.hf_path,
        "checkpoint.load": cfg.checkpoint.load,
        "algorithm.ref_path": cfg.algorithm.ref_path,
        "data.train_path": cfg.data.train_path,
        "data.eval_path": cfg.data.eval_path,
        "data.tokenizer_path": cfg.data.tokenizer_path,
    }
    for key, value in inputs.items():
        for folder in folders:
            if value and Path(value).resolve().is_relative_to(folder.resolve()):
                raise ConfigError(
                    f"--force would move {folder} aside, but {key} = {value!r} is inside it: choose another "
                    "logging.run_dir (or checkpoint.dir)"
                )


def check_writable(folder: Path, key: str, needed_for: str = "the run could save no checkpoint") -> None:
    """Create `folder` (parents too) and a file in it; ConfigError naming `key` (and `needed_for`,
    what the run could not do without it) when that fails."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ConfigError(
            f"{key}: {folder} is not a writable folder ({type(err).__name__}: {err.strerror or err}); "
            f"{needed_for}: choose another folder"
        ) from None
