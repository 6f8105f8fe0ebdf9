"""A training stage's run folder (RL and SFT): config, metrics, checkpoints, exports, resume.

    RUN_DIR/config.yaml                               the resolved config
    RUN_DIR/metrics.jsonl                             the step records (`megatron_rl.metrics`)
    CKPT_DIR/step_NNNNNN/{actor/, loop_state.pt, manifest.json}
                                                      CKPT_DIR: checkpoint.dir, default RUN_DIR/checkpoints
    RUN_DIR/hf, RUN_DIR/hf_start                      the policy as a Hugging Face folder

A fresh run (no `--resume`) refuses a run folder that already holds a run (step records in
metrics.jsonl, hf/ or checkpoint folders) unless `force` is given: then the old run folder is
renamed to RUN_DIR.old-N (and a CKPT_DIR outside it to CKPT_DIR.old-N), N the first free number;
nothing is deleted. The folders are checked writable at start-up, before any step is trained.
Rank 0 holds an exclusive lock on RUN_DIR/.run.lock (`RunLock`) from before anything is written
until the stage ends: a second launch into the same folder is refused, naming the pid of the first.

A checkpoint is written into CKPT_DIR/step_NNNNNN.tmp: the actor (model, optimizer, schedule,
per-rank RNG), collectively, then on rank 0 `loop_state.pt` (the step, the prompt sampler's
position, rank 0's Python, NumPy and torch RNG states, the rollout seed and the asynchronous rollout
state) and `manifest.json`
(every file with its size and SHA-256), every file flushed to disk; only then is the folder renamed
to step_NNNNNN. The SHA-256 of the shards and of the loop state is computed from the bytes as they
are written (`torch_dist_io`), never by a second read; Megatron's small metadata files are hashed
when the manifest is written. A run killed while saving leaves a `.tmp` folder, which is ignored
and removed at the next save. A save that fails (a full disk, a folder made unwritable) stops the
run with one line naming the folder, the cause and the free bytes (`CheckpointWriteError`).

Resuming takes the newest checkpoint whose files match the manifest's sizes and checksums (one read
of its files at start-up) and whose loop state loads; a damaged one is reported, naming the file,
and the previous one is taken. A folder without manifest (older code) needs its loop state and
shards as long as its `.metadata` says. `--resume` (`resume=True`) refuses a run folder with no
usable checkpoint, naming what is wrong with each; `--resume-if-any` (`resume=RESUME_IF_ANY`) starts
afresh a folder that holds no run, and refuses one that does. Neither touches a run folder it
refuses. Resuming drops the records of later steps from metrics.jsonl (a torn last line too).
`checkpoint.keep_last` complete folders are kept, never the newest one this run verified or wrote
among the pruned. Rollout sampling needs no engine state: every request's `sampling_seed` is derived
from (train.seed, step, round, index) (`megatron_rl.loop.collect.sampling_seed`). The frozen
reference policy of a KL term is not saved: it is the start policy (or `algorithm.ref_path`),
rebuilt from the configuration on resume.

Every rank builds the `RunFolder` before torch.distributed starts, so each decides from the
shared file system: nothing is written into the run folder before every rank has passed its
checks (the actor start that follows is collective), and only rank 0 moves an old run aside.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import gc
import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron_rl.config import Config, ConfigError, to_yaml
from megatron_rl.metrics import METRICS_FILE, MetricsLogger, read_metrics, truncate_metrics
from megatron_rl.models.chunked_io import ChunkedWrites
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
MANIFEST_VERSION = 2  # 1: sizes, and the SHA-256 of the loop state only
# what a run leaves in its run folder: a fresh run into a folder holding one of these is refused
# (metrics.jsonl only when it holds a record: a run stopped during its start-up leaves it empty)
RUN_MARKERS = ("metrics.jsonl", "hf")
LOCK_FILE = ".run.lock"
RESUME_IF_ANY = "if_any"  # --resume-if-any: resume when there is a checkpoint, start a folder without a run afresh
ResumeMode = bool | Literal["if_any"]
_HASH_CHUNK = 1 << 20
# Megatron's metadata and common state are small next to the shards: the manifest hashes them by reading
_HASHED_ON_READ = (".metadata", "common.pt", "metadata.json")
_LOW_SPACE = 16 << 20  # bytes free under which a failed write is put down to a full disk


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
    # rollout.async_mode of the run that saved it (None: an SFT checkpoint, or saved before it was kept)
    async_mode: str | None = None
    rng: dict[str, Any] = field(default_factory=capture_rng)
    format_version: int = FORMAT_VERSION
    # the rollout side's state, pickled (`RolloutDriver.checkpoint_state`: one_step_off's pre-generated
    # batch, fully_async's buffer and prompts in flight); None in checkpoints written before it existed
    rollout: bytes | None = None
    # the weight version the engine serves (the last step that trained and synced: below `step` after
    # skipped steps); None in checkpoints written before it existed (then taken as `step`)
    weight_version: int | None = None


def save_loop_state(folder: str | Path, state: LoopState) -> str:
    """Write `state` into the checkpoint `folder` atomically (rank 0 only); returns the file's
    SHA-256, computed while writing."""
    path = Path(folder) / LOOP_STATE_FILE
    tmp = path.with_name(path.name + ".tmp")
    digest = hashlib.sha256()
    with tmp.open("wb") as file:
        torch.save(asdict(state), ChunkedWrites(file, digest))
    os.replace(tmp, path)
    return digest.hexdigest()


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
        for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    """Flush `path` (a file, or a folder's entries) to disk, whichever process wrote it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(folder: str | Path, step: int, digests: dict[str, str]) -> Path:
    """Flush every file of the checkpoint `folder` to disk and list it in `manifest.json` with its
    size and SHA-256 (rank 0, after every rank's files are written). `digests` (path in `folder` ->
    SHA-256) holds what the writers computed while writing: every file but Megatron's small
    metadata files must be in it, so that no shard is read a second time."""
    folder = Path(folder)
    files: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name != MANIFEST_FILE:
            name = path.relative_to(folder).as_posix()
            if name in digests:
                sha = digests[name]
            elif path.name in _HASHED_ON_READ:
                sha = _sha256(path)
            else:
                raise ValueError(f"{path}: no SHA-256 from its writer (every shard is hashed while it is written)")
            _fsync(path)
            files[name] = {"size": path.stat().st_size, "sha256": sha}
    for sub in sorted({p.parent for p in folder.rglob("*")} | {folder}):
        _fsync(sub)
    if LOOP_STATE_FILE not in files:
        raise FileNotFoundError(f"{folder / LOOP_STATE_FILE}: write the loop state before the manifest")
    manifest = {"manifest_version": MANIFEST_VERSION, "step": step, "files": files}
    path = folder / MANIFEST_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    _fsync(tmp)
    os.replace(tmp, path)
    _fsync(folder)
    return path


def _manifest_files(manifest: dict[str, Any]) -> dict[str, tuple[int, str | None]]:
    """name -> (size, SHA-256 or None) of a manifest of either version."""
    if manifest["manifest_version"] == 1:
        files = {name: (int(size), None) for name, size in manifest["files"].items()}
        files[LOOP_STATE_FILE] = (files[LOOP_STATE_FILE][0], manifest["loop_state_sha256"])
        return files
    return {name: (int(entry["size"]), str(entry["sha256"])) for name, entry in manifest["files"].items()}


def _shard_extent_damage(actor_dir: Path) -> str | None:
    """Without a manifest: a shard shorter than its `.metadata` says, or a `.metadata` that does not
    unpickle (naming the file), else None."""
    metadata_path = actor_dir / ".metadata"
    if not metadata_path.is_file():
        return None
    try:
        with metadata_path.open("rb") as file:
            storage = pickle.load(file).storage_data  # torch's own reader unpickles it the same way
        needed: dict[str, int] = {}
        for info in storage.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    except Exception as err:  # unpickling a damaged file raises about anything
        return f"{metadata_path} is unreadable ({type(err).__name__}: {err})"
    for name, size in sorted(needed.items()):
        path = actor_dir / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size < size:
            return f"{path} holds {path.stat().st_size} bytes, its .metadata needs {size} (truncated)"
    return None


def checkpoint_damage(folder: str | Path, *, checksums: bool = True) -> str | None:
    """What is wrong with the finished checkpoint `folder` against its manifest (naming the file), or
    None; `checksums`: also compare every file's SHA-256 (a read of the whole checkpoint), not only
    the sizes. A folder without manifest (written before manifests) needs its loop state and shards
    as long as its `.metadata` says."""
    folder = Path(folder)
    manifest_path = folder / MANIFEST_FILE
    if not manifest_path.is_file():
        if not (folder / LOOP_STATE_FILE).is_file():
            return f"{folder / LOOP_STATE_FILE} is missing"
        return _shard_extent_damage(folder / ACTOR_DIR) if checksums else None
    try:
        files = _manifest_files(json.loads(manifest_path.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"{manifest_path} is unreadable ({type(err).__name__}: {err})"
    for name, (size, _) in files.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"{path} holds {actual} bytes, the manifest says {size} (truncated or overwritten)"
    for name, (_, sha) in files.items() if checksums else ():
        if sha is not None and _sha256(folder / name) != sha:
            return f"{folder / name}: its SHA-256 differs from the manifest's (changed after it was written)"
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
    """The finished checkpoints whose files have the sizes of their manifest, oldest first (the
    checksums are compared at resume only: a read of every checkpoint at every save would cost more
    than the save)."""
    return [(step, path) for step, path in checkpoints(ckpt_root) if checkpoint_damage(path, checksums=False) is None]


def latest_checkpoint(ckpt_root: str | Path) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    found = complete_checkpoints(ckpt_root)
    return found[-1][1] if found else None


def resume_point(
    ckpt_root: str | Path, *, warn: bool = True, damaged: list[str] | None = None
) -> tuple[Path, LoopState] | None:
    """The newest checkpoint that matches its manifest (sizes and checksums) and whose loop state
    loads, with that loop state; each newer one that does not is skipped with a warning naming the
    file (`warn`), and what is wrong with it appended to `damaged` when given."""
    for _, folder in reversed(checkpoints(ckpt_root)):
        problem = checkpoint_damage(folder)
        if problem is None:
            try:
                return folder, load_loop_state(folder)
            except Exception as err:  # torch.load: EOFError, zip (RuntimeError), pickle errors
                problem = f"{folder / LOOP_STATE_FILE} does not load ({type(err).__name__}: {err})"
        if warn:
            logger.warning("checkpoint %s is damaged, skipped: %s; trying the previous one", folder, problem)
        if damaged is not None:
            damaged.append(problem)
    return None


def prune_checkpoints(ckpt_root: str | Path, keep_last: int, *, keep: Path | None = None) -> list[Path]:
    """Remove all but the newest `keep_last` complete checkpoints (0: keep all), and the damaged or
    unfinished folders older than the newest complete one; returns the removed folders. `keep`, the
    newest checkpoint known to verify (resumed from or written by this run), is never removed."""
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
    doomed = [path for path in doomed if keep is None or path != keep]
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


def _holds_records(path: Path) -> bool:
    return path.name != METRICS_FILE or (path.stat().st_size > 0 and bool(path.read_bytes().strip()))


def run_contents(run_dir: Path, ckpt_root: Path) -> list[Path]:
    """What a run left in `run_dir` (metrics with a record, exports) and `ckpt_root` (checkpoint
    folders, finished or not)."""
    found = [run_dir / name for name in RUN_MARKERS if (run_dir / name).exists() and _holds_records(run_dir / name)]
    if ckpt_root.is_dir():
        found += sorted(c for c in ckpt_root.iterdir() if _STEP_DIR.match(c.name) or _STAGING_DIR.match(c.name))
    return found


def _aside(path: Path) -> Path:
    """PATH.old-N for the first N >= 1 that does not exist."""
    n = 1
    while path.with_name(f"{path.name}.old-{n}").exists():
        n += 1
    return path.with_name(f"{path.name}.old-{n}")


def _moved_path(path: Path, moved: list[tuple[Path, Path]]) -> Path:
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


class RunLock:
    """An exclusive lock on a run folder, held by this process: a POSIX lock on RUN_DIR/.run.lock, which
    holds the holder's pid. The kernel drops the lock when its process ends, however it ends, so the
    file a killed run leaves behind locks nothing; `release` removes it."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE
        self._fd: int | None = None
        for _ in range(10):  # another holder may remove the file between our open and our lock
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                if err.errno not in (errno.EACCES, errno.EAGAIN):  # a file system without locks
                    logger.warning(
                        "%s: the run folder cannot be locked (%s): make sure no other run uses it", self.path, err
                    )
                    return
                raise ConfigError(
                    f"logging.run_dir = {str(run_dir)!r} is in use by another run (pid {holder}, lock {self.path}): "
                    "wait for it to end, or choose another logging.run_dir"
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                self._fd = fd
                return
            os.close(fd)
        raise ConfigError(f"{self.path}: could not be locked (removed and created again by other runs)")

    def release(self) -> None:
        """Remove the lock file and unlock (idempotent)."""
        if self._fd is None:
            return
        try:
            if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None


class CheckpointWriteError(RuntimeError):
    """A checkpoint that could not be written (a full disk, a folder made unwritable): one line naming
    the folder, the cause and the bytes free there."""


def _free_bytes(path: Path) -> int:
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def _first_cause(err: BaseException) -> BaseException:
    """A failed distributed save reports each rank's error inside one `CheckpointException`: the first."""
    if isinstance(err, CheckpointException) and err.failures:
        return next(iter(err.failures.values()))[0]
    return err


def _out_of_space(err: BaseException, free: int) -> bool:
    """Whether `err` (or an error it was raised from) is a full disk or quota. torch's zip writer
    reports a failed write as `[enforce fail at inline_container.cc] unexpected pos`, without errno."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(seen) or "Disk quota exceeded" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return free < _LOW_SPACE


def checkpoint_write_error(folder: Path, err: BaseException) -> CheckpointWriteError:
    """The one-line error of a failed save into `folder`, with the free bytes of its file system."""
    err = _first_cause(err)
    free = _free_bytes(folder)
    if _out_of_space(err, free):
        return CheckpointWriteError(
            f"{folder}: no space left to write the checkpoint ({free} bytes free on its file system); "
            "free some space (or set checkpoint.dir elsewhere) and continue with --resume"
        )
    cause = " ".join(f"{type(err).__name__}: {err}".split())
    return CheckpointWriteError(
        f"{folder}: the checkpoint could not be written ({cause}; {free} bytes free there); "
        "fix it and continue with --resume"
    )


def _nothing_to_resume(flag: str, run_dir: Path, ckpt_root: Path, found: list[Path], damaged: list[str]) -> str:
    """The refusal of a resume without a usable checkpoint (nothing was changed)."""
    if damaged:
        why = f"no usable checkpoint in {ckpt_root}: " + "; ".join(damaged)
    else:
        why = f"no checkpoint in {ckpt_root}"
    metrics = run_dir / METRICS_FILE
    if metrics in found:
        records = read_metrics(run_dir)
        why += f" (and {metrics} holds {len(records)} step records)"
    if found:
        return (
            f"{flag}: {why}; nothing was changed: repair the checkpoint, or pass --force to start afresh "
            f"with the run moved aside to {_aside(run_dir)}"
        )
    return f"{flag}: {why}, nothing to resume: start without --resume (or pass --resume-if-any)"


class RunFolder:
    """One stage's run folder on every rank: where it resumes from, its logs, checkpoints and exports.

    Built before the actor: it finds the checkpoint to resume from and reads its loop state, so
    `start_step` is known from the start.
    """

    def __init__(self, cfg: Config, *, rank: int, resume: ResumeMode, force: bool = False) -> None:
        """`resume`: True: continue from the newest complete checkpoint, refused without one;
        `RESUME_IF_ANY`: the same, but a folder that holds no run starts afresh. Otherwise a run folder
        that holds a run is refused, unless `force`: then rank 0 moves the old run aside (nothing is
        deleted). Rank 0 locks the run folder until `close`."""
        if resume and force:
            raise ConfigError("--resume continues the run in logging.run_dir, --force moves it aside: pass one")
        self.cfg = cfg
        self.rank = rank
        self.resume = resume
        self.run_dir = Path(cfg.logging.run_dir)
        self.ckpt_root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.run_dir / "checkpoints"
        self.moved_aside: list[tuple[Path, Path]] = []
        self._lock: RunLock | None = None
        if rank == 0:  # before anything is read or written: a second launch waits for nothing
            check_writable(self.run_dir, "logging.run_dir")
            self._lock = RunLock(self.run_dir)
        try:
            self._open(force)
        except BaseException:
            self.close()
            raise

    def _open(self, force: bool) -> None:
        cfg, rank, resume = self.cfg, self.rank, self.resume
        found = run_contents(self.run_dir, self.ckpt_root)
        if not resume:
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
            if self.moved_aside and self._lock is not None:  # the lock moved with the old run: lock the new folder
                old = self._lock
                old.path = _moved_path(old.path, self.moved_aside)
                self._lock = RunLock(self.run_dir)
                old.release()
            check_writable(self.ckpt_root, "checkpoint.dir" if cfg.checkpoint.dir else "logging.run_dir")
        point = None
        if resume:
            damaged: list[str] = []
            point = resume_point(self.ckpt_root, warn=rank == 0, damaged=damaged)
            if point is None and (resume is True or found):
                flag = "--resume" if resume is True else "--resume-if-any"
                raise ConfigError(_nothing_to_resume(flag, self.run_dir, self.ckpt_root, found, damaged))
        self.resume_from = point[0] if point is not None else None
        # the newest checkpoint known to verify: pruning never removes it
        self.verified: Path | None = self.resume_from
        self.loop_state = point[1] if point is not None else None
        self.start_step = self.loop_state.step if self.loop_state is not None else 0
        saved_mode = self.loop_state.async_mode if self.loop_state is not None else None
        if saved_mode not in (None, "sync") and saved_mode != cfg.rollout.async_mode:
            raise ConfigError(
                f"rollout.async_mode = {cfg.rollout.async_mode!r} but {self.resume_from} was saved with "
                f"{saved_mode!r}, whose rollout state (pre-generated batch or buffer) this mode cannot continue; "
                f"resume with rollout.async_mode={saved_mode}"
            )
        if self.loop_state is not None and self.loop_state.rollout_seed != cfg.train.seed:
            logger.warning(
                "resuming with train.seed = %d, saved with %d: the rollouts will differ from the original run's",
                cfg.train.seed,
                self.loop_state.rollout_seed,
            )

    def close(self) -> None:
        """Release the run folder's lock (rank 0; idempotent)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def start_actor(self, cfg: Config) -> MegatronActor:
        """The actor of `cfg` (collective), with the resumed checkpoint's state: it replaces `checkpoint.load`."""
        from megatron_rl.actor.actor import MegatronActor

        if self.resume_from is None:
            actor = MegatronActor(cfg)
        else:
            actor = MegatronActor(dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, load=None)))
            try:
                actor.load(self.resume_from / ACTOR_DIR)
            except BaseException:
                actor.close()
                raise
        # What exists now (the imported modules, the model, the optimizer) lives as long as the process:
        # kept out of the garbage collector's scans, Megatron's gc.collect() at every checkpoint save
        # (its distributed optimizer's sharded state) walks only what the run made since, not millions
        # of objects (0.4 s a save on a CPU rank).
        gc.freeze()
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
                else "from scratch: no checkpoint (--resume-if-any)"
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
        try:
            written = actor.save(staging / ACTOR_DIR)
        except (Exception, CheckpointException) as err:  # CheckpointException: a BaseException
            raise checkpoint_write_error(staging, err) from err
        shard_digests: list[dict[str, str]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(shard_digests, written)  # also: every rank's files are written before rank 0 lists them

        def finish() -> None:
            if sampler is None:
                raise ValueError("save_checkpoint: rank 0 needs the prompt sampler (its position is loop state)")
            digests = {f"{ACTOR_DIR}/{name}": sha for per_rank in shard_digests for name, sha in per_rank.items()}
            mode = self.cfg.rollout.async_mode if rollout is not None else None
            try:
                digests[LOOP_STATE_FILE] = save_loop_state(
                    staging,
                    LoopState(
                        step=step,
                        sampler=sampler.state_dict(),
                        rollout_seed=self.cfg.train.seed,
                        async_mode=mode,
                        rollout=rollout,
                        weight_version=weight_version,
                    ),
                )
                write_manifest(staging, step, digests)
                if folder.exists():  # this step saved before (a damaged checkpoint skipped at resume)
                    shutil.rmtree(folder)
                os.replace(staging, folder)
                _fsync(self.ckpt_root)
            except (OSError, RuntimeError) as err:  # RuntimeError: torch's zip writer's failed write
                raise checkpoint_write_error(staging, err) from err
            self.verified = folder
            prune_checkpoints(self.ckpt_root, self.cfg.checkpoint.keep_last, keep=self.verified)

        on_rank0(finish)
        return folder

    def export(self, actor: MegatronActor, out: Path) -> None:
        """The actor's policy as a Hugging Face folder at `out` (collective), replacing what is there."""
        from megatron_rl.models.export import save_hf_folder
        from megatron_rl.models.hf_io import prepare_output_dir
        from megatron_rl.models.lora import merged_weights
        from megatron_rl.models.source import assets_folder, hf_config_for_export

        if self.rank == 0:
            prepare_output_dir(out, force=True)
        dist.barrier()
        lora = getattr(actor, "lora", None)
        with merged_weights(lora) if lora is not None else contextlib.nullcontext():  # LoRA: the merged policy
            save_hf_folder(
                actor.chunks, self.cfg.model, out, hf_config_for_export(self.cfg), assets_from=assets_folder(self.cfg)
            )
        if lora is not None:  # and the adapters alone, as a PEFT folder on the base: RUN_DIR/hf_adapter
            from megatron_rl.actor.adapters import save_adapter_folder

            save_adapter_folder(actor, out.parent / "hf_adapter", self.cfg.model.hf_path)
