"""A training stage's run folder (RL and SFT): config, metrics, checkpoints, exports, resume.

    RUN_DIR/config.yaml                               the resolved config
    RUN_DIR/metrics.jsonl                             the step records (`megatron_rl.metrics`)
    CKPT_DIR/step_NNNNNN/{actor/, loop_state.pt, manifest.json}
                                                      CKPT_DIR: checkpoint.dir, default RUN_DIR/checkpoints
    RUN_DIR/hf, RUN_DIR/hf_start                      the policy as a Hugging Face folder

A fresh run (no `--resume`) refuses a run folder that already holds a run (metrics.jsonl, hf/ or
checkpoint folders) unless `force` is given: then the old run folder is renamed to RUN_DIR.old-N
(and a CKPT_DIR outside it to CKPT_DIR.old-N), N the first free number; nothing is deleted. The
folders are checked writable at start-up, before any step is trained.

A checkpoint is written into CKPT_DIR/step_NNNNNN.tmp: the actor (model, optimizer, schedule,
per-rank RNG), collectively, then on rank 0 `loop_state.pt` (the step, the prompt sampler's
position, rank 0's Python, NumPy and torch RNG states, the rollout seed and the asynchronous rollout
state) and `manifest.json`
(every file with its size, the SHA-256 of the loop state), every file flushed to disk; only then
is the folder renamed to step_NNNNNN. A run killed while saving leaves a `.tmp` folder, which is
ignored and removed at the next save. Resuming takes the newest checkpoint that matches its
manifest and whose loop state loads; a damaged one (a missing or truncated file) is reported,
naming the file, and the previous one is taken. `checkpoint.keep_last` complete folders are kept
(never fewer than the newest complete one). Rollout sampling needs no engine state: every
request's `sampling_seed` is derived from (train.seed, step, round, index)
(`megatron_rl.loop.collect.sampling_seed`). Resuming (`RunFolder(..., resume=True)`) drops the
records of later steps from metrics.jsonl; without a checkpoint the run starts from scratch. The
frozen reference policy of a KL term is not saved: it is the start policy (or
`algorithm.ref_path`), rebuilt from the configuration on resume.

Every rank builds the `RunFolder` before torch.distributed starts, so each decides from the
shared file system: nothing is written into the run folder before every rank has passed its
checks (the actor start that follows is collective), and only rank 0 moves an old run aside.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_rl.config import Config, ConfigError, to_yaml
from megatron_rl.metrics import MetricsLogger, truncate_metrics
from megatron_rl.parallel.rank0 import on_rank0

if TYPE_CHECKING:
    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.data import PromptSampler

logger = logging.getLogger(__name__)

LOOP_STATE_FILE = "loop_state.pt"
MANIFEST_FILE = "manifest.json"
ACTOR_DIR = "actor"
STAGING_SUFFIX = ".tmp"  # step_NNNNNN.tmp: a checkpoint being written
_STEP_DIR = re.compile(r"^step_(\d+)$")
_STAGING_DIR = re.compile(r"^step_\d+" + re.escape(STAGING_SUFFIX) + "$")
FORMAT_VERSION = 1
MANIFEST_VERSION = 1
# what a run leaves in its run folder: a fresh run into a folder holding one of these is refused
RUN_MARKERS = ("metrics.jsonl", "hf")


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
    # the rollout side's state, pickled (`RolloutDriver.checkpoint_state`: one_step_off's pre-generated
    # batch, fully_async's buffer and prompts in flight); None in checkpoints written before it existed
    rollout: bytes | None = None
    # the weight version the engine serves (the last step that trained and synced: below `step` after
    # skipped steps); None in checkpoints written before it existed (then taken as `step`)
    weight_version: int | None = None


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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    """Flush `path` (a file, or a folder's entries) to disk, whichever process wrote it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(folder: str | Path, step: int) -> Path:
    """Flush every file of the checkpoint `folder` to disk and list it in `manifest.json` with its
    size, with the SHA-256 of the loop state (rank 0, after every rank's files are written)."""
    folder = Path(folder)
    files: dict[str, int] = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name != MANIFEST_FILE:
            _fsync(path)
            files[path.relative_to(folder).as_posix()] = path.stat().st_size
    for sub in sorted({p.parent for p in folder.rglob("*")} | {folder}):
        _fsync(sub)
    if LOOP_STATE_FILE not in files:
        raise FileNotFoundError(f"{folder / LOOP_STATE_FILE}: write the loop state before the manifest")
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "step": step,
        "files": files,
        "loop_state_sha256": _sha256(folder / LOOP_STATE_FILE),
    }
    path = folder / MANIFEST_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    _fsync(tmp)
    os.replace(tmp, path)
    _fsync(folder)
    return path


def checkpoint_damage(folder: str | Path) -> str | None:
    """What is wrong with the finished checkpoint `folder` against its manifest (naming the file), or
    None. A folder without manifest (written before manifests) only needs its loop state."""
    folder = Path(folder)
    manifest_path = folder / MANIFEST_FILE
    if not manifest_path.is_file():
        return None if (folder / LOOP_STATE_FILE).is_file() else f"{folder / LOOP_STATE_FILE} is missing"
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files: dict[str, int] = manifest["files"]
        loop_sha = manifest["loop_state_sha256"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
        return f"{manifest_path} is unreadable ({type(err).__name__}: {err})"
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"{path} holds {actual} bytes, the manifest says {size} (truncated or overwritten)"
    if _sha256(folder / LOOP_STATE_FILE) != loop_sha:
        return f"{folder / LOOP_STATE_FILE}: its SHA-256 differs from the manifest's"
    return None


def checkpoints(ckpt_root: str | Path) -> list[tuple[int, Path]]:
    """Finished checkpoints under `ckpt_root` as (step, folder), oldest first: renamed into place
    (not a `.tmp` staging folder) with a manifest or a loop state. `checkpoint_damage` says whether
    their files are intact."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and ((child / MANIFEST_FILE).is_file() or (child / LOOP_STATE_FILE).is_file()):
            found.append((int(match.group(1)), child))
    return sorted(found)


def complete_checkpoints(ckpt_root: str | Path) -> list[tuple[int, Path]]:
    """The finished checkpoints whose files match their manifest, oldest first."""
    return [(step, path) for step, path in checkpoints(ckpt_root) if checkpoint_damage(path) is None]


def latest_checkpoint(ckpt_root: str | Path) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    found = complete_checkpoints(ckpt_root)
    return found[-1][1] if found else None


def resume_point(ckpt_root: str | Path, *, warn: bool = True) -> tuple[Path, LoopState] | None:
    """The newest checkpoint that matches its manifest and whose loop state loads, with that loop
    state; each newer one that does not is skipped with a warning naming the file (`warn`)."""
    for _, folder in reversed(checkpoints(ckpt_root)):
        problem = checkpoint_damage(folder)
        if problem is None:
            try:
                return folder, load_loop_state(folder)
            except Exception as err:  # torch.load: EOFError, zip (RuntimeError), pickle errors
                problem = f"{folder / LOOP_STATE_FILE} does not load ({type(err).__name__}: {err})"
        if warn:
            logger.warning("checkpoint %s is damaged, skipped: %s; trying the previous one", folder, problem)
    return None


def prune_checkpoints(ckpt_root: str | Path, keep_last: int) -> list[Path]:
    """Remove all but the newest `keep_last` complete checkpoints (0: keep all), and the damaged or
    unfinished folders older than the newest complete one; returns the removed folders."""
    root = Path(ckpt_root)
    complete = complete_checkpoints(root)
    doomed = [path for _, path in complete[:-keep_last]] if keep_last > 0 else []
    if complete:
        newest = complete[-1][0]
        kept = {path for _, path in complete}
        for child in root.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and int(match.group(1)) < newest and child not in kept:
                doomed.append(child)
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def remove_staging(ckpt_root: str | Path) -> list[Path]:
    """Remove the `.tmp` folders of saves that never finished; returns them."""
    root = Path(ckpt_root)
    left = [child for child in root.iterdir() if _STAGING_DIR.match(child.name)] if root.is_dir() else []
    for path in left:
        shutil.rmtree(path, ignore_errors=True)
    return left


def run_contents(run_dir: Path, ckpt_root: Path) -> list[Path]:
    """What a run left in `run_dir` (metrics, exports) and `ckpt_root` (checkpoint folders, finished or not)."""
    found = [run_dir / name for name in RUN_MARKERS if (run_dir / name).exists()]
    if ckpt_root.is_dir():
        found += sorted(c for c in ckpt_root.iterdir() if _STEP_DIR.match(c.name) or _STAGING_DIR.match(c.name))
    return found


def _aside(path: Path) -> Path:
    """PATH.old-N for the first N >= 1 that does not exist."""
    n = 1
    while path.with_name(f"{path.name}.old-{n}").exists():
        n += 1
    return path.with_name(f"{path.name}.old-{n}")


def move_run_aside(run_dir: Path, ckpt_root: Path) -> list[tuple[Path, Path]]:
    """Rename `run_dir` (and `ckpt_root` when it is outside it) to PATH.old-N; returns (from, to)."""
    moved = []
    for path in (run_dir, ckpt_root):
        if path.exists() and not (path != run_dir and path.resolve().is_relative_to(run_dir.resolve())):
            target = _aside(path)
            os.rename(path, target)
            moved.append((path, target))
    return moved


def _check_inputs_outside(cfg: Config, folders: list[Path]) -> None:
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


def check_writable(folder: Path, key: str) -> None:
    """Create `folder` (parents too) and a file in it; ConfigError naming `key` when that fails."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ConfigError(
            f"{key}: {folder} is not a writable folder ({type(err).__name__}: {err.strerror or err}); "
            "the run could save no checkpoint: choose another folder"
        ) from None


class RunFolder:
    """One stage's run folder on every rank: where it resumes from, its logs, checkpoints and exports.

    Built before the actor: it finds the checkpoint to resume from and reads its loop state, so
    `start_step` is known from the start.
    """

    def __init__(self, cfg: Config, *, rank: int, resume: bool, force: bool = False) -> None:
        """`resume`: continue from the newest complete checkpoint; otherwise a run folder that holds
        a run is refused, unless `force`: then rank 0 moves the old run aside (nothing is deleted)."""
        if resume and force:
            raise ConfigError("--resume continues the run in logging.run_dir, --force moves it aside: pass one")
        self.cfg = cfg
        self.rank = rank
        self.resume = resume
        self.run_dir = Path(cfg.logging.run_dir)
        self.ckpt_root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.run_dir / "checkpoints"
        self.moved_aside: list[tuple[Path, Path]] = []
        if not resume:
            found = run_contents(self.run_dir, self.ckpt_root)
            if found and not force:
                shown = ", ".join(str(p) for p in found[:3]) + (
                    f" (and {len(found) - 3} more)" if len(found) > 3 else ""
                )
                raise ConfigError(
                    f"logging.run_dir = {str(self.run_dir)!r} already holds a run ({shown}): pass --resume to "
                    f"continue it, or --force to start afresh with the old run moved aside to "
                    f"{_aside(self.run_dir)}"
                )
            if found:
                _check_inputs_outside(cfg, [self.run_dir, self.ckpt_root])
            if found and rank == 0:
                self.moved_aside = move_run_aside(self.run_dir, self.ckpt_root)
        if rank == 0:  # the other ranks would race rank 0's move; the folders are shared
            check_writable(self.run_dir, "logging.run_dir")
            check_writable(self.ckpt_root, "checkpoint.dir" if cfg.checkpoint.dir else "logging.run_dir")
        point = resume_point(self.ckpt_root, warn=rank == 0) if resume else None
        self.resume_from = point[0] if point is not None else None
        self.loop_state = point[1] if point is not None else None
        self.start_step = self.loop_state.step if self.loop_state is not None else 0
        if self.loop_state is not None and self.loop_state.rollout_seed != cfg.train.seed:
            logger.warning(
                "resuming with train.seed = %d, saved with %d: the rollouts will differ from the original run's",
                cfg.train.seed,
                self.loop_state.rollout_seed,
            )

    def start_actor(self, cfg: Config) -> MegatronActor:
        """The actor of `cfg` (collective), with the resumed checkpoint's state: it replaces `checkpoint.load`."""
        from megatron_rl.actor.actor import MegatronActor

        if self.resume_from is None:
            return MegatronActor(cfg)
        actor = MegatronActor(dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, load=None)))
        try:
            actor.load(self.resume_from / ACTOR_DIR)
        except BaseException:
            actor.close()
            raise
        return actor

    def restore_sampler(self, sampler: PromptSampler) -> None:
        """Put `sampler` where the resumed run's was; on rank 0 also restore the RNG state saved with it.

        Call it after the actor has started (its start seeds the generators)."""
        if self.loop_state is None:
            return
        sampler.load_state_dict(self.loop_state.sampler)
        if self.rank == 0:
            restore_rng(self.loop_state.rng)

    def open_log(self, *, desc: str) -> MetricsLogger:
        """Rank 0 writes config.yaml and, when resuming, drops the records after `start_step`; the
        step logger (every rank, writing on rank 0), which reports where the run resumes from."""
        cfg = self.cfg
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(to_yaml(cfg), encoding="utf-8")
            if self.resume_from is not None:
                truncate_metrics(self.run_dir, self.start_step)
        log = MetricsLogger(
            self.run_dir,
            enabled=self.rank == 0,
            total_steps=cfg.train.steps,
            start_step=self.start_step,
            tensorboard=cfg.logging.tensorboard,
            progress=cfg.logging.progress,
            append=self.resume_from is not None,
            desc=desc,
        )
        if self.resume:
            where = (
                f"from {self.resume_from} (step {self.start_step})"
                if self.resume_from
                else "from scratch: no checkpoint"
            )
            log.message(f"resuming {where} in {self.ckpt_root}")
        for old, new in self.moved_aside:
            log.message(f"--force: the previous run's {old} was moved to {new}")
        return log

    def save_checkpoint(
        self,
        actor: MegatronActor,
        step: int,
        sampler: PromptSampler | None,
        rollout: bytes | None = None,
        weight_version: int | None = None,
    ) -> Path:
        """CKPT_DIR/step_NNNNNN (collective): the actor, then rank 0's loop state and manifest into
        step_NNNNNN.tmp, renamed into place once every file is on disk; then pruning to
        `checkpoint.keep_last`. `sampler` is the stage's prompt sampler, needed on rank 0; `rollout`
        rank 0's rollout state (`LoopState.rollout`), `weight_version` the RL loop's (`LoopState.weight_version`)."""
        folder = checkpoint_dir(self.ckpt_root, step)
        staging = folder.with_name(folder.name + STAGING_SUFFIX)
        if self.rank == 0:
            remove_staging(self.ckpt_root)
        dist.barrier()
        actor.save(staging / ACTOR_DIR)
        dist.barrier()  # every rank's files are written before rank 0 lists them

        def finish() -> None:
            if sampler is None:
                raise ValueError("save_checkpoint: rank 0 needs the prompt sampler (its position is loop state)")
            save_loop_state(
                staging,
                LoopState(
                    step=step,
                    sampler=sampler.state_dict(),
                    rollout_seed=self.cfg.train.seed,
                    rollout=rollout,
                    weight_version=weight_version,
                ),
            )
            write_manifest(staging, step)
            if folder.exists():  # this step saved before (a damaged checkpoint skipped at resume)
                shutil.rmtree(folder)
            os.replace(staging, folder)
            _fsync(self.ckpt_root)
            prune_checkpoints(self.ckpt_root, self.cfg.checkpoint.keep_last)

        on_rank0(finish)
        return folder

    def export(self, actor: MegatronActor, out: Path) -> None:
        """The actor's policy as a Hugging Face folder at `out` (collective), replacing what is there."""
        from megatron_rl.models.export import save_hf_folder
        from megatron_rl.models.hf_io import prepare_output_dir
        from megatron_rl.models.source import assets_folder, hf_config_for_export

        if self.rank == 0:
            prepare_output_dir(out, force=True)
        dist.barrier()
        save_hf_folder(
            actor.chunks, self.cfg.model, out, hf_config_for_export(self.cfg), assets_from=assets_folder(self.cfg)
        )
