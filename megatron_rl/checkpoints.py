"""A training stage's checkpoint store (RL and SFT): write, verify, select and prune checkpoints.

    CKPT_DIR/step_NNNNNN/{actor/, [critic/,] loop_state.pt, manifest.json}
                         CKPT_DIR: checkpoint.dir, default RUN_DIR/checkpoints (`megatron_rl.run_folder`)

A checkpoint is written into CKPT_DIR/step_NNNNNN.tmp: the actor (model, optimizer, schedule,
per-rank RNG), collectively, and each other model the stage trains (`stage.Stage.models`: PPO's critic,
critic/, in the actor's format), then on rank 0 `loop_state.pt` (the step, rank 0's Python, NumPy and
torch RNG states, the rollout seed, and the stage's named entries, `stage.Stage.state_dict`: the
prompt sampler's position; the RL loop's asynchronous rollout state and weight version) and `manifest.json`
(every file with its size and SHA-256), every file flushed to disk; only then is the folder renamed
to step_NNNNNN (`commit_checkpoint`). The SHA-256 of the shards and of the loop state is computed
from the bytes as they are written (`torch_dist_io`), never by a second read; Megatron's small
metadata files are hashed when the manifest is written. A run killed while saving leaves a `.tmp`
folder, which is ignored and removed at the next save. A save that fails (a full disk, a folder made
unwritable) stops the run with one line naming the folder, the cause and the free bytes
(`CheckpointWriteError`).

Resuming takes the newest checkpoint whose manifest lists every file in it, whose files match the
manifest's sizes and checksums (one read of its files at start-up) and whose loop state loads; a
damaged one is reported, naming the file, and the previous one is taken. Every checkpoint this code
writes has a full manifest: one missing, or one that leaves out a file, is damage.
`checkpoint.keep_last` complete folders are kept, never the newest one the run verified or wrote
among the pruned. Rollout sampling needs no engine state: every request's `sampling_seed` is derived
from (train.seed, step, round, index) (`megatron_rl.loop.collect.sampling_seed`). The frozen
reference policy of a KL term is not saved: it is the start policy (or `algorithm.ref_path`),
rebuilt from the configuration on resume.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch.distributed.checkpoint.api import CheckpointException

from megatron_rl.models.chunked_io import ChunkedWrites
from megatron_rl.models.write_errors import StorageWriteError, write_failure

logger = logging.getLogger(__name__)

LOOP_STATE_FILE = "loop_state.pt"
MANIFEST_FILE = "manifest.json"
ACTOR_DIR = "actor"
CRITIC_DIR = "critic"
STAGING_SUFFIX = ".tmp"  # step_NNNNNN.tmp: a checkpoint being written
_STEP_DIR = re.compile(r"^step_(\d+)$")
_STAGING_DIR = re.compile(r"^step_\d+" + re.escape(STAGING_SUFFIX) + "$")
FORMAT_VERSION = 2  # 1: the entries were fields of their own (read still)
MANIFEST_VERSION = 2  # 1: sizes, and the SHA-256 of the loop state only
_HASH_CHUNK = 1 << 20
# Megatron's metadata and common state are small next to the shards: the manifest hashes them by reading
_HASHED_ON_READ = (".metadata", "common.pt", "metadata.json")


class Stateful(Protocol):
    """What a checkpoint holds named entries of (torch.distributed.checkpoint's `Stateful`): a stage."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class CheckpointedModel(Protocol):
    """A distributed model a checkpoint holds a folder of (the actor's kind: the critic), saved and loaded
    collectively; `save` returns the SHA-256 of each file this rank wrote, by its name in the folder."""

    def save(self, path: str | os.PathLike) -> dict[str, str]: ...

    def load(self, path: str | os.PathLike) -> dict[str, Any]: ...


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
    # the stage's named entries (`Stage.state_dict`, given back to its `load_state_dict` on resume):
    # "sampler" (the prompt sampler's position); the RL loop's "rollout" (`RolloutRuntime.checkpoint_state`:
    # one_step_off's pre-generated batch, fully_async's buffer and prompts in flight) and "weight_version"
    # (the last step that trained and synced: below `step` after skipped steps)
    entries: dict[str, Any]
    rollout_seed: int
    # rollout.async_mode of the run that saved a "rollout" entry (None: an SFT checkpoint)
    async_mode: str | None = None
    rng: dict[str, Any] = field(default_factory=capture_rng)
    format_version: int = FORMAT_VERSION


def _named_entries(data: dict[str, Any]) -> dict[str, Any]:
    """A loop state of format 1, whose entries were fields of their own, in today's form."""
    entries = {"sampler": data.pop("sampler"), "rollout": data.pop("rollout", None)}
    version = data.pop("weight_version", None)
    entries["weight_version"] = data["step"] if version is None else version  # None: saved before it was kept
    return {**data, "entries": entries, "format_version": FORMAT_VERSION}


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
    if data.get("format_version") == 1:
        data = _named_entries(data)
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


def _shard_extent_damage(model_dir: Path) -> str | None:
    """A shard that the `.metadata` of a model folder (actor/, critic/) names missing or shorter than it says,
    or a `.metadata` that does not unpickle (naming the file), else None."""
    metadata_path = model_dir / ".metadata"
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
        path = model_dir / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size < size:
            return f"{path} holds {path.stat().st_size} bytes, its .metadata needs {size} (truncated)"
    return None


def checkpoint_damage(folder: str | Path, *, checksums: bool = True) -> str | None:
    """What is wrong with the finished checkpoint `folder` against its manifest (naming the file), or
    None. The manifest must list every file of the folder, the loop state among them, with its size;
    `checksums`: also compare every file's SHA-256 (a read of the whole checkpoint) and the shards
    against the extents each model folder's `.metadata` names."""
    folder = Path(folder)
    manifest_path = folder / MANIFEST_FILE
    if not manifest_path.is_file():
        return f"{manifest_path} is missing (every checkpoint is written with one: its files cannot be verified)"
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
    unlisted = sorted(p for p in folder.rglob("*") if p.is_file() and p.relative_to(folder).as_posix() not in files)
    unlisted = [path for path in unlisted if path != manifest_path]
    if unlisted or LOOP_STATE_FILE not in files:
        what = unlisted[0] if unlisted else folder / LOOP_STATE_FILE
        return f"{what} is not in {manifest_path} (a partial manifest: the file cannot be verified)"
    for name, (_, sha) in files.items() if checksums else ():
        if sha is not None and _sha256(folder / name) != sha:
            return f"{folder / name}: its SHA-256 differs from the manifest's (changed after it was written)"
    if not checksums:
        return None
    models = [folder / ACTOR_DIR, *sorted(p for p in folder.iterdir() if p.is_dir() and p.name != ACTOR_DIR)]
    return next((damage for model in models if (damage := _shard_extent_damage(model)) is not None), None)


def checkpoint_folders(ckpt_root: str | Path) -> list[Path]:
    """Every checkpoint folder under `ckpt_root`, finished or not (`.tmp` staging folders too), sorted."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    return sorted(c for c in root.iterdir() if _STEP_DIR.match(c.name) or _STAGING_DIR.match(c.name))


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


def staging_dir(ckpt_root: str | Path, step: int) -> Path:
    """CKPT_DIR/step_NNNNNN.tmp: where the checkpoint of `step` is written before its rename."""
    folder = checkpoint_dir(ckpt_root, step)
    return folder.with_name(folder.name + STAGING_SUFFIX)


def commit_checkpoint(ckpt_root: Path, state: LoopState, digests: dict[str, str]) -> Path:
    """Rank 0's end of the save of `state.step`, once every rank's actor files are in its staging
    folder (`digests`: their SHA-256 by path in it): the loop state and the manifest are written and
    the folder renamed to step_NNNNNN, which it returns. A failed write is a `CheckpointWriteError`."""
    staging, folder = staging_dir(ckpt_root, state.step), checkpoint_dir(ckpt_root, state.step)
    try:
        digests = {**digests, LOOP_STATE_FILE: save_loop_state(staging, state)}
        write_manifest(staging, state.step, digests)
        if folder.exists():  # this step saved before (a damaged checkpoint skipped at resume)
            shutil.rmtree(folder)
        os.replace(staging, folder)
        _fsync(ckpt_root)
    except (OSError, RuntimeError) as err:  # RuntimeError: torch's zip writer's failed write
        raise checkpoint_write_error(staging, err) from err
    return folder


class CheckpointWriteError(StorageWriteError):
    """A checkpoint that could not be written (a full disk, a folder made unwritable): one line naming
    the folder, the cause and the bytes free there."""


def _first_cause(err: BaseException) -> BaseException:
    """A failed distributed save reports each rank's error inside one `CheckpointException`: the first."""
    if isinstance(err, CheckpointException) and err.failures:
        return next(iter(err.failures.values()))[0]
    return err


def checkpoint_write_error(folder: Path, err: BaseException) -> CheckpointWriteError:
    """The one-line error of a failed save into `folder`, with the free bytes of its file system."""
    return CheckpointWriteError(write_failure(folder, _first_cause(err), "the checkpoint", "checkpoint.dir"))
