"""Failed writes of a run's large files (checkpoints, the weight sync's folder) as one line: the
folder, the cause (a full disk or quota named as such) and the bytes free on its file system."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

LOW_SPACE = 16 << 20  # bytes free under which a failed write is put down to a full disk


class StorageWriteError(RuntimeError):
    """Files the run needs that could not be written (a full disk, a folder made unwritable): one
    line naming the folder, the cause and the bytes free there."""


def free_bytes(path: Path) -> int:
    """The bytes free on the file system of `path` (or of its nearest existing parent)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def out_of_space(err: BaseException, free: int) -> bool:
    """Whether `err` (or an error it was raised from) is a full disk or quota. torch's zip writer
    reports a failed write as `[enforce fail at inline_container.cc] unexpected pos`, without errno."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(seen) or "Disk quota exceeded" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return free < LOW_SPACE


def write_failure(folder: Path, err: BaseException, what: str, key: str) -> str:
    """The one line of `what` (e.g. "the checkpoint") failing to be written into `folder`, the folder
    of the config key `key`, with the free bytes of its file system."""
    free = free_bytes(folder)
    if out_of_space(err, free):
        return (
            f"{folder}: no space left to write {what} ({free} bytes free on its file system); "
            f"free some space (or set {key} elsewhere) and continue with --resume"
        )
    cause = " ".join(f"{type(err).__name__}: {err}".split())
    return (
        f"{folder}: {what} could not be written ({cause}; {free} bytes free there); fix it and continue with --resume"
    )
